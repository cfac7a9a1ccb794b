"""HybridAttention: the attention backend of every offloading mode (recall, hgca, scout, streaming,
topk) over one shared core; `config.mode` picks the mode object (`jhybrid.hybrid.modes`), and
`make_backend` the backend of any mode (a mode that does not run on this core has its own).

Per layer the device holds a `LayerState` (`jhybrid.hybrid.state`: the GPU window, and the mode's
digests / pool / device copies); the host holds every evicted block (`jhybrid.hybrid.runtime`).
Inside the jitted step each layer's `attend` does:

  every step    write this step's k, v into the window (`window.write_tokens`)
  prefill / append (T > 1), every mode, exact:
                GPU: causal jnp attention over sinks + ring; the offloaded part either on the device
                over the `DeviceCopy` the runtime attached (`prefill.offloaded_attention`) or on the
                CPU over every offloaded token (submit before, collect after the GPU part), or not
                at all when the chunk's rows have none (`NothingOffloaded`); the mode's
                `prefill_token` (hgca: the chunk's last queries to its host part)
  decode (T = 1): the mode's `decode` (its producers' partial states)
  then          MAW update from the window's probabilities; exact LSE merge of the partial states

Every producer returns (o, lse) in natural-log float32 (docs/design.md, "Partial states").

A model with sliding-window layers (Gemma 3) keeps each such layer's last `sliding_window` tokens
on the GPU and offloads nothing from it (`jhybrid.hybrid.sliding`); its global layers are the
offloaded layers 0 .. G-1 of the host side, the mode and the exchange (`LayerPlan`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from host.targets import ALL_OFFLOADED
from jhybrid.attention.base import AttentionBackend, LayerContext
from jhybrid.attention.full import PackedRows, pack_rows
from jhybrid.hybrid.config import OffloadConfig
from jhybrid.hybrid.exchange import (CallbackExchange, FfiExchange, RuntimeHandle, ShardedRuntimes, after,
                                     register_ffi_targets)
from jhybrid.hybrid.modes.base import DecodeStep
from jhybrid.hybrid.registry import mode_class
from jhybrid.hybrid.prefill import offloaded_attention
from jhybrid.hybrid.rows import check_rows, part_of_rows, reset_cache_rows, with_part_of_rows
from jhybrid.hybrid.runtime import HostRuntime
from jhybrid.hybrid.sliding import LayerPlan, SlidingWindow, init_sliding, sliding_attention
from jhybrid.hybrid.state import DeviceCopy, LayerState, NothingOffloaded, StepMeta
from jhybrid.hybrid.transfer import log_once
from jhybrid.hybrid.window import exact_window_attention, init_window, update_maw, write_tokens
from jhybrid.merge import merge_partials

SUPPORTED_HEAD_DIMS = (64, 128, 256)  # the Pallas kernels' head dims


class HybridAttention(AttentionBackend):
    """One backend for every offloading mode. `config` must be resolved (a concrete window)."""

    handles_long_context = True
    reuses_rows = True
    chunk_dependent = True  # eviction and the window's attention weights step once per prefill chunk

    @property
    def prefills_rows(self) -> bool:
        """A prefill step may run over some rows (`rows_meta`), on one device; a tensor-parallel
        template's steps (`ShardedRuntimes`) run over every row."""
        return not isinstance(self._handle, ShardedRuntimes)

    @property
    def packs_decode(self) -> bool:
        """A serving step may pack prefill chunks and decode tokens into one call (`PackedRows`):
        on one device, for a mode that `packs_decode` (scout, topk, streaming), when the chunks'
        offloaded prompt is attended on the device (`can_pack`)."""
        return self.prefills_rows and self.mode.packs_decode

    def __init__(self, config: OffloadConfig, handle: RuntimeHandle | ShardedRuntimes | None = None):
        """handle: where the traced step's host calls find their runtime; a `ShardedRuntimes` makes
        this the device-side template of a tensor-parallel backend (`jhybrid.parallel.offload`),
        whose per-device runtimes are other HybridAttention objects."""
        mode = mode_class(config.mode)(config)
        if not mode.offloads or mode.own_backend() is not None:
            raise ValueError(f"mode {config.mode!r} does not run on HybridAttention; use "
                             "jhybrid.hybrid.make_backend(config)")
        if config.window_tokens is None:
            raise ValueError("HybridAttention needs a resolved config: make_backend(config, context=...)")
        self.config = config
        self.name = config.mode
        self.mode = mode
        self._handle = handle or RuntimeHandle()  # where the traced step's host calls find the open runtime
        self._plan: LayerPlan | None = None  # the open model's global layers (set by open)
        self._mixed = False  # some of its layers are sliding-window layers
        self._ahead: tuple | None = None  # per model layer: query_ahead's answer (set by open)
        self._empty: EmptyCache | None = None  # the open batch's empty device state (reset_rows)
        self._native = None  # host.exchange_worker.NativeExchange once made (`exchange`), or False: none
        self._exchange = None
        if config.host_exchange == "ffi":
            self.native  # asked for by name: a library that cannot load is an error now, not at the first step

    @property
    def exchange(self):
        """The device side of the host exchange (made on first use: a capacity estimate, which only
        asks for shapes, never loads the native library)."""
        if self._exchange is None:
            native = self.native
            self._exchange = (CallbackExchange(self._handle) if native is None
                              else FfiExchange(self._handle, native.id))
        return self._exchange

    @property
    def native(self):
        """host.exchange_worker.NativeExchange when the decode steps use it, else None."""
        if self._native is None:
            self._native = self._native_exchange() or False
        return self._native or None

    def _native_exchange(self):
        """The stream-ordered native exchange when config.host_exchange allows it and it loads."""
        import logging

        import jax

        choice = self.config.host_exchange
        if choice == "callback" or self.mode.host_target is None:
            return None
        try:
            from host.exchange_worker import NativeExchange

            native = NativeExchange()
            platform = jax.devices()[0].platform
            register_ffi_targets(native.lib, "cpu")
            if platform == "gpu":
                register_ffi_targets(native.lib, "gpu")
            return native
        except Exception as error:  # noqa: BLE001 - "auto" falls back, logged; "ffi" raises
            if choice == "ffi":
                raise RuntimeError(f"host_exchange='ffi': the native exchange is not usable: {error}") from error
            log_once("native-exchange", logging.WARNING, "the native host exchange is not usable (%s); decode "
                     "steps use jax.pure_callback (slower: each call stalls the stream). Build it with "
                     "scripts/setup.sh", error)
            return None

    # ---- host side --------------------------------------------------------------------------------
    @property
    def runtime(self) -> HostRuntime | None:
        """The open batch's host side (store, workers, counters), or None (always None for the
        device-side template of a tensor-parallel backend)."""
        return None if isinstance(self._handle, ShardedRuntimes) else self._handle.runtime

    def open(self, config, batch_size, max_len, dtype=None, device=None):
        """device: where this batch's cache lives (default: the first device); its native exchange
        is opened there."""
        if isinstance(self._handle, ShardedRuntimes):
            raise RuntimeError("this backend is the device-side template of a tensor-parallel backend; "
                               "open the jhybrid.parallel backend instead")
        if config.head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"hybrid attention needs head_dim in {SUPPORTED_HEAD_DIMS} (the Pallas kernels); "
                             f"the model has {config.head_dim}")
        plan = LayerPlan.of(config)
        offloaded = plan.offloaded_view(config)
        self.mode.check(offloaded, max_len)
        self.close()
        self._handle.runtime = HostRuntime(self.config, self.mode, offloaded, batch_size, max_len,
                                           dtype or config.dtype, native=self.native, device=device)
        self._plan, self._mixed, self._ahead = plan, plan.mixed, self._layers_ahead(plan)
        self._empty = EmptyCache(self, config, batch_size, max_len, np.dtype(jnp.dtype(dtype or config.dtype)).name)
        return self

    def close(self):
        if self._handle.runtime is not None:
            self._handle.runtime.close()
            self._handle.runtime = None

    def before_step(self, cache, positions, decode_positions=None):
        """(decode_positions: `before_packed_step`'s, checked there)"""
        if self.runtime is None:
            raise RuntimeError("hybrid backend: call backend.open(model_config, batch, max_len) before stepping")
        if len(cache.layers) != self._plan.num_layers:
            raise ValueError(f"a cache of {len(cache.layers)} layers; the backend was opened for "
                             f"{self._plan.num_layers}")
        if not self._mixed:  # every layer is offloaded: the host side steps the cache as it is
            return self.runtime.before_step(cache, positions, decode_positions)
        stepped = self.runtime.before_step(self._plan.offloaded_layers(cache), positions, decode_positions)
        return self._plan.merge(cache, stepped)

    def can_pack(self, positions) -> bool:
        return self.packs_decode and self.runtime is not None and self.runtime.packable(positions)

    def overlap_dispatch(self) -> bool:
        """(`AttentionBackend.overlap_dispatch`) The mode's host work that can run in a call's shadow
        (`ModeHost.overlap_dispatch`: scout applies its finished recalls there)."""
        if self.runtime is None:
            raise RuntimeError("hybrid backend: call backend.open(model_config, batch, max_len) before "
                               "overlap_dispatch")
        return self.runtime.mode_host.overlap_dispatch()

    def after_dispatch(self, cache):
        runtime = self.runtime
        if runtime is None or not runtime.mode_host.dispatch_work_due():
            return cache
        if not self._mixed:
            return runtime.after_dispatch(cache)
        return self._plan.merge(cache, runtime.after_dispatch(self._plan.offloaded_layers(cache)))

    def packed_variant(self, cache):
        """The cache with a packed step's meta (`StepMeta.decode_offloaded_blocks` set); None for a
        variant of chunks on the host path (no `LayerState.offloaded`), which never pack."""
        if any(isinstance(s, LayerState) and s.offloaded is None for s in cache.layers):
            return None
        meta = cache.meta
        return cache.replace(meta=meta.replace(decode_offloaded_blocks=meta.offloaded_blocks))

    def before_packed_step(self, cache, positions, decode_positions):
        """`before_step` of a packed step (`HostRuntime.before_step` with decode_positions)."""
        if self.runtime is None:
            raise RuntimeError("hybrid backend: call backend.open(model_config, batch, max_len) before stepping")
        if not self.can_pack(positions):
            raise ValueError("hybrid: these prefill chunks cannot be packed with decode tokens (can_pack is False: "
                             f"mode {self.name!r}, or their offloaded prompt is attended on the host)")
        return self.before_step(cache, positions, decode_positions)

    def reset_rows(self, cache, rows):
        """Empties rows `rows` for new sequences (continuous batching; `AttentionBackend.reset_rows`):
        waits for the last step (its host calls read the store), then the host side forgets the
        rows (`HostRuntime.reset_rows`: counts, eviction, the mode's host state, store blocks), then
        one jitted call empties their device state (`jhybrid.hybrid.rows`). Call between steps."""
        if self.runtime is None:
            raise RuntimeError("hybrid backend: call backend.open(model_config, batch, max_len) before reset_rows")
        rows = check_rows(rows, self.runtime.batch)
        if rows.size == 0:
            return cache
        if len(cache.layers) != self._plan.num_layers or cache.lengths.shape[0] != self.runtime.batch:
            raise ValueError(f"reset_rows: a cache of {len(cache.layers)} layers x {cache.lengths.shape[0]} rows; "
                             f"the backend was opened for {self._plan.num_layers} x {self.runtime.batch}")
        jax.block_until_ready(cache)  # the last step has run: its host calls are done with the rows
        self.runtime.reset_rows(rows)
        if cache.meta.decode_offloaded_blocks is not None:  # a packed step's meta: the empty one has none
            cache = cache.replace(meta=cache.meta.replace(decode_offloaded_blocks=None))
        return reset_cache_rows(cache, rows, self._empty)

    def prefill_variants(self, cache) -> list:
        """The cache without copies (the host path; between steps it may still hold the last
        chunk's), with `NothingOffloaded` (a chunk inside the window), and, where the device path can
        run, with `DeviceCopy`s of each size the runtime attaches (`PrefillCopies.sizes`;
        ShapeDtypeStructs [B, Hkv, P, D] in the model dtype, n_valid [B] int32): on the H100 each
        compiles for ~15 s, which a request would otherwise wait for."""
        if self.runtime is None:
            raise RuntimeError("hybrid backend: call backend.open(model_config, batch, max_len) "
                               "before prefill_variants")
        runtime = self.runtime

        def with_offloaded(make):
            return cache.replace(layers=tuple([s.replace(offloaded=make(s)) if isinstance(s, LayerState) else s
                                               for s in cache.layers]))

        variants = [with_offloaded(lambda s: None), with_offloaded(lambda s: NothingOffloaded())]
        if runtime.prefill.may_use_device():
            on = jax.sharding.SingleDeviceSharding(runtime.device)
            valid = jax.ShapeDtypeStruct((runtime.batch,), jnp.int32, sharding=on)
            for p in runtime.prefill.sizes():
                def copy(s, p=p):
                    b, hkv, _, d = s.window.k_ring.shape
                    kv = jax.ShapeDtypeStruct((b, hkv, p, d), s.window.k_ring.dtype, sharding=on)
                    return DeviceCopy(kv, kv, valid)
                variants.append(with_offloaded(copy))
        return variants

    def precompile_host(self, cache) -> None:
        """The evictor's gathers and the mode's host compiles (`HostRuntime.precompile`)."""
        if self.runtime is None:
            raise RuntimeError("hybrid backend: call backend.open(model_config, batch, max_len) before precompile_host")
        self.runtime.precompile(cache if not self._mixed else self._plan.offloaded_layers(cache))

    @property
    def max_prefill_chunk(self) -> int:
        return self.config.max_prefill_chunk

    def counters(self) -> dict:
        return {} if self.runtime is None else self.runtime.counters()

    def reset_counters(self) -> None:
        if self.runtime is not None:
            self.runtime.reset_counters()

    def step_history(self) -> list[dict]:
        return [] if self.runtime is None else list(self.runtime.history)

    def host_bytes(self) -> int:
        return 0 if self.runtime is None else self.runtime.host_kv_bytes()

    def selections(self, cache) -> list | None:
        states = [s for s in cache.layers if isinstance(s, LayerState) and s.selected is not None]
        return [np.asarray(s.selected) for s in states] or None

    def row_fields(self) -> dict:
        """The mode's settings (`OffloadMode.row_fields`), the host KV format, and what the mode's host
        part measured once its background work is done (`ModeHost.row_stats`)."""
        fields = self.mode.row_fields()
        if self.config.host_kv_dtype is not None:
            fields["host_kv_dtype"] = self.config.host_kv_dtype
        if self.runtime is not None:
            self.runtime.evictor.publish_all()  # the background copies, their sparsification ...
            self.runtime.evictor.wait_background()  # ... and the queued re-evaluations are done
            fields.update(self.runtime.mode_host.row_stats())
        return fields

    def query_ahead(self, layer_idx, config):
        if self._ahead is None or len(self._ahead) != config.num_layers:  # not open (a tensor-parallel template)
            return self._layers_ahead(LayerPlan.of(config))[layer_idx]
        return self._ahead[layer_idx]

    def _layers_ahead(self, plan: LayerPlan) -> tuple:
        """Per model layer: the later layer whose predicted query the mode wants from it, or None."""
        out = []
        for layer in range(plan.num_layers):
            g = plan.offloaded_index(layer)
            wanted = g is not None and self.mode.wants_next_query(g, len(plan.global_layers))
            out.append(plan.global_layers[g + 1] if wanted else None)
        return tuple(out)

    # ---- device state -----------------------------------------------------------------------------
    def init_meta(self, batch_size, max_len):
        return StepMeta(offloaded_blocks=jnp.zeros((batch_size,), jnp.int32))

    def init_layer_cache(self, config, layer_idx, batch_size, max_len, dtype):
        plan = LayerPlan.of(config)
        g = plan.offloaded_index(layer_idx)
        if g is None:  # a sliding-window layer: its window on the device, nothing offloaded
            return init_sliding(batch_size, min(config.sliding_window, max_len), config.num_kv_heads,
                                config.head_dim, dtype)
        window = init_window(self.config, batch_size, config.num_kv_heads, config.head_dim, dtype)
        extra = self.mode.layer_state(g, len(plan.global_layers), batch_size, config.num_kv_heads,
                                      config.head_dim, max_len, dtype)
        return LayerState(window=window, **extra)

    # ---- attention --------------------------------------------------------------------------------
    def rows_meta(self, meta: StepMeta, rows):
        return meta.replace(rows=rows)

    def attend(self, layer_idx, q, k, v, positions, lengths, layer_cache: LayerState | SlidingWindow,
               context: LayerContext):
        if isinstance(context.meta, PackedRows):
            return self._attend_packed(layer_idx, q, k, v, positions, layer_cache, context)
        rows = context.meta.rows
        if rows is None:
            return self._attend(layer_idx, q, k, v, positions, lengths, layer_cache, context, None)
        # A prefill step over some rows (the serving engine, `rows_meta`): the layer attends those
        # rows' part of its state (`rows.part_of_rows`) and writes it back.
        if q.shape[1] == 1:
            raise ValueError("hybrid: a step over some rows of the batch must be a prefill chunk (T > 1); "
                             f"got T = {q.shape[1]}")
        offloaded = context.meta.offloaded_blocks
        meta = context.meta.replace(offloaded_blocks=offloaded[rows], rows=None)
        part = part_of_rows(layer_cache, rows)
        o, part, carry = self._attend(layer_idx, q, k, v, positions, lengths, part,
                                      dataclasses.replace(context, meta=meta), (rows, offloaded.shape[0]))
        return o, with_part_of_rows(layer_cache, part, rows), carry

    def _attend_packed(self, layer_idx, q, k, v, positions, layer_cache: LayerState | SlidingWindow,
                       context: LayerContext):
        """attend for a packed step (`PackedRows`, its `step` the batch's StepMeta): q, k, v
        [1, R*C + B, H, D]. The chunks attend as a prefill step over their rows, then the decode
        tokens as a decode step of the whole batch (the chunks' rows at position -1: untouched),
        over the state the chunks left; the carry to the next layer is the decode tokens'."""
        packed: PackedRows = context.meta
        step: StepMeta = packed.step
        rows, offloaded = packed.rows, step.offloaded_blocks
        (q_c, q_d), (k_c, k_d), (v_c, v_d), (p_c, p_d) = (packed.split(x) for x in (q, k, v, positions))
        chunk_context = dataclasses.replace(context, next_query=None, meta=StepMeta(offloaded_blocks=offloaded[rows]))
        o_c, part, _ = self._attend(layer_idx, q_c, k_c, v_c, p_c, packed.prefill_lengths,
                                    part_of_rows(layer_cache, rows), chunk_context, (rows, offloaded.shape[0]))
        layer_cache = with_part_of_rows(layer_cache, part, rows)
        next_query = None if context.next_query is None else packed.split(context.next_query)[1]
        decode_context = dataclasses.replace(context, next_query=next_query,
                                             meta=StepMeta(offloaded_blocks=step.decode_offloaded_blocks))
        o_d, layer_cache, carry = self._attend(layer_idx, q_d, k_d, v_d, p_d, packed.decode_lengths, layer_cache,
                                               decode_context, None)
        return pack_rows(o_c, o_d[:, 0]), layer_cache, carry

    def _attend(self, layer_idx, q, k, v, positions, lengths, layer_cache: LayerState | SlidingWindow,
                context: LayerContext, batch_rows: tuple | None):
        """attend over the step's rows. batch_rows (rows [R], B) when they are some rows of a batch
        of B: what goes to the host side (which numbers rows of the whole batch) is spread to B rows."""
        def to_batch(x, fill):
            if batch_rows is None:
                return x
            rows, batch = batch_rows
            return jnp.full((batch,) + x.shape[1:], fill, x.dtype).at[rows].set(x)

        def from_batch(x):
            return x if batch_rows is None else x[batch_rows[0]]

        if context.sliding_window is not None:  # nothing offloaded; the carry passes through
            o, state = sliding_attention(layer_cache, q, k, v, positions, context.sliding_window, context.scale)
            return o, state, context.carry
        if context.global_layers is not None:  # number the global layers 0 .. G-1 for the host side
            layer_idx = context.global_layers.index(layer_idx)
            context = dataclasses.replace(context, num_layers=len(context.global_layers))
        cfg, exchange = self.config, self.exchange
        offloaded = context.meta.offloaded_blocks
        state = layer_cache.replace(window=write_tokens(cfg, layer_cache.window, k, v, positions))
        token, carry = None, None
        if q.shape[1] > 1:  # prefill / append: exact
            token = self.mode.prefill_token(layer_idx, to_batch(q, 0), to_batch(positions, -1), exchange)
            gpu_q, cpu = q, None
            if isinstance(state.offloaded, DeviceCopy):  # the offloaded part on the device (prefill copies)
                copy = state.offloaded
                cpu = offloaded_attention(q, copy.k, copy.v, copy.n_valid, context.scale, positions,
                                          cfg.kernel_backend)
            elif state.offloaded is None:  # ... or on the CPU, over every offloaded token of the chunk's
                # rows (a row without a query in the chunk, e.g. one decoding in its own call, is not attended)
                host_q = to_batch(q, 0)
                ticket = exchange.submit(layer_idx, ALL_OFFLOADED, host_q,
                                         rows=to_batch(jnp.any(positions >= 0, axis=1), False))
                gpu_q = after(q, ticket)
            # else NothingOffloaded: the chunk's rows have no offloaded token, the window is all
            o_g, lse_g, probs = exact_window_attention(cfg, gpu_q, state.window, positions, lengths, offloaded,
                                                       context.scale)
            if state.offloaded is None:
                cpu = tuple(from_batch(x) for x in exchange.collect(layer_idx, ticket, host_q.shape, lse_g))
            parts = [(o_g, lse_g)] + ([] if cpu is None else [cpu])
        else:
            step = DecodeStep(layer=layer_idx, num_layers=context.num_layers,
                              q=q, positions=positions, lengths=lengths, offloaded=offloaded, scale=context.scale,
                              carry=context.carry, next_q=context.next_query, exchange=exchange)
            parts, probs, state, carry = self.mode.decode(step, state)
        active = jnp.any(positions >= 0, axis=1)
        maw = update_maw(cfg, state.window.maw, probs, active)
        if token is not None:  # ties the host call to an output, so it runs and is done with the step
            maw = maw + 0.0 * token.astype(jnp.float32)
        state = state.replace(window=state.window.replace(maw=maw))
        o, _ = merge_partials([p[0] for p in parts], [p[1] for p in parts], out_dtype=jnp.float32)
        o = jnp.where((positions >= 0)[:, :, None, None], o, 0.0)
        return o.astype(q.dtype), state, carry


@dataclasses.dataclass(frozen=True)
class EmptyCache:
    """The empty device state of an open batch, for `reset_cache_rows` (a jit static: hashable)."""

    backend: HybridAttention
    model_config: object
    batch: int
    max_len: int
    dtype: str

    def __call__(self, cache):
        layers = tuple(self.backend.init_layer_cache(self.model_config, i, self.batch, self.max_len, self.dtype)
                       for i in range(self.model_config.num_layers))
        return layers, self.backend.init_meta(self.batch, self.max_len)


def make_backend(config: OffloadConfig | str | None = None, context: int | None = None, *, model=None,
                 calibration_tokens=None, **fields) -> AttentionBackend:
    """The backend of a mode: an OffloadConfig, or a mode name plus OffloadConfig fields (neither:
    OffloadConfig's default, `full`). `context` (tokens per sequence) resolves a `gpu_ratio` into the
    GPU window; `model` and `calibration_tokens` ([T] token ids of a calibration text) resolve the
    mode's per-model settings (`OffloadMode.for_model`: scout's scout_exact_layers="auto", cached per
    model)."""
    if config is None or isinstance(config, str):
        if config is not None and "mode" in fields:
            raise TypeError(f"make_backend({config!r}, mode={fields['mode']!r}): give the mode once")
        config = OffloadConfig(**({} if config is None else {"mode": config}), **fields)
    elif fields:
        config = dataclasses.replace(config, **fields)
    mode = mode_class(config.mode)
    if model is not None and calibration_tokens is not None and mode.needs_calibration(config):
        config = mode.for_model(config, model, calibration_tokens)
    config = config.resolved(context)
    own = mode(config).own_backend()
    return own if own is not None else HybridAttention(config)


__all__ = ["HybridAttention", "EmptyCache", "make_backend"]
