"""Hybrid GPU-CPU attention backends: recall, hgca, scout, streaming, topk (one class, one config).

    from jhybrid.attention.hybrid import make_backend
    from jhybrid.hybrid import HybridConfig
    backend = make_backend(HybridConfig(mode="hgca", window_tokens=2048))   # or mode="full", ...
    Generator(model, backend).generate(prompts)                           # same model code

Per layer the device holds the GPU window (`jhybrid.hybrid.ring`: sinks + ring + MAW) and, per
mode, recall buffers or digests and a recall pool; the host store holds every evicted block. The
`KVManager` (Python, between steps) evicts and recalls; inside the jitted step each layer does:

  prefill / append (T > 1), every mode: exact. GPU: causal jnp attention over sinks + ring;
      offloaded tokens: on the device over the copies the manager put in the state (pf_k, pf_v,
      pf_len; passed through, dropped at the next step start; config.prefill_offloaded "device",
      "auto" on a GPU), else
      CPU `attend_all` over every offloaded token (submit before, collect after the GPU part).
  decode (T = 1):
    streaming  window kernel only (offloaded tokens kept, not attended)
    recall     window kernel + the same kernel over the offloaded KV uploaded this step
    hgca       exchange "split": submit(q) -> window kernel (+ MAW probs) -> collect -> merge
               (2 callbacks per layer, the CPU overlaps the GPU window attention);
               "sync": one callback computing on the spot, then the window kernel
    topk       digests -> top-k blocks with the exact q -> submit the blocks to the CPU ->
               window kernel -> collect -> merge (2 callbacks per layer)
    scout      exact layers (layer 0 + config.scout_exact_layers): as topk (+ the pool).
               Predicted layer i: the selection and CPU job submitted by layer i - 1; window
               kernel + block-sparse kernel over the selected blocks in the GPU pool; then ONE
               callback that collects layer i's CPU part and, if layer i+1 is predicted, submits
               layer i+1's, chosen and attended with layer i+1's norm + W_q + RoPE applied to
               layer i's input. An exact layer whose successor is predicted also submits it in its
               collect callback; a layer whose successor is exact submits nothing ahead.
               Callbacks per decode step: L + |exact layers| (L + 1 with layer 0 only).
               With predict_query=False every layer is exact: topk plus the pool (exact at keep-all).
Every producer returns (o, lse); `jhybrid.merge.merge_partials` combines them exactly.
"""

from __future__ import annotations

import jax.numpy as jnp

from jhybrid.attention.base import AttentionBackend, LayerContext
from jhybrid.attention.full import FullAttention
from jhybrid.hybrid import bridge
from jhybrid.hybrid.config import HybridConfig
from jhybrid.hybrid.prefill_upload import offloaded_attention
from jhybrid.hybrid.manager import KVManager
from jhybrid.hybrid.ring import (exact_window_attention, init_window, ring_meta, update_maw,
                                 write_tokens)
from jhybrid.hybrid.selection import select
from jhybrid.merge import merge_partials
from pallas_kernels.block_sparse_attention import block_sparse_attention
from pallas_kernels.window_attention import window_attention


def make_backend(config: HybridConfig | str = "hgca", **overrides) -> AttentionBackend:
    """The backend for a mode: a HybridConfig, or a mode name plus HybridConfig fields."""
    if isinstance(config, str):
        config = HybridConfig(mode=config, **overrides)
    elif overrides:
        import dataclasses
        config = dataclasses.replace(config, **overrides)
    if config.mode == "full":
        return FullAttention()
    return HybridAttention(config)


class HybridAttention(AttentionBackend):
    """One backend for every offloading mode; `config.mode` picks the decode path."""

    handles_long_context = True

    def __init__(self, config: HybridConfig):
        if config.mode == "full":
            raise ValueError("mode 'full' is FullAttention; use make_backend(config)")
        self.config = config
        self.name = config.mode
        self.manager: KVManager | None = None
        self._carry: dict = {}  # trace-time hand-over of scout's layer-ahead selection and ticket

    @property
    def max_prefill_chunk(self) -> int:
        return self.config.max_prefill_chunk

    def _bridge(self):
        return self.manager.bridge

    # ---- state ---------------------------------------------------------------------------------
    def init_layer_cache(self, config, layer_idx, batch_size, max_len, dtype):
        """Layer 0 (re)builds the host runtime for this batch: every new cache is a new batch."""
        cfg = self.config
        if config.head_dim not in (64, 128, 256):
            raise ValueError(f"hybrid attention needs head_dim in (64, 128, 256) (the Pallas kernels); "
                             f"the model has {config.head_dim}")
        if any(config.is_sliding_layer(i) for i in range(config.num_layers)):
            raise ValueError("hybrid attention does not support sliding-window layers (Gemma 3 local "
                             "layers); use mode 'full'")
        nb = cfg.host_blocks(max_len)
        if cfg.topk_blocks is not None and cfg.topk_blocks * cfg.block_size > max_len:
            raise ValueError(f"top-k budget of {cfg.topk_blocks} blocks x {cfg.block_size} tokens is larger "
                             f"than the context of {max_len} tokens")
        if layer_idx == 0:
            cfg.check_layers(config.num_layers)
            if self.manager is not None:
                self.manager.close()
            self.manager = KVManager(cfg, config, batch_size, max_len, dtype)
        hkv, d, bs = config.num_kv_heads, config.head_dim, cfg.block_size
        state = init_window(cfg, batch_size, hkv, d, dtype)
        if cfg.mode == "recall":
            state["off_k"] = jnp.zeros((batch_size, hkv, nb * bs, d), dtype)
            state["off_v"] = jnp.zeros((batch_size, hkv, nb * bs, d), dtype)
        if cfg.uses_selection():
            last = layer_idx == config.num_layers - 1
            # The whole top-k of this layer's last decode step (read by the manager's recall planner
            # and by benchmarks for the selection drift); written, never read, by the step.
            state["sel_ids"] = jnp.full((batch_size, hkv, min(cfg.topk_blocks or nb, nb)), -1, jnp.int32)
            # Digests of this layer (exact-query selection here) or of the next layer (its
            # layer-ahead selection runs here): each layer's digests live in exactly one place.
            ahead = cfg.predicts() and not last and not cfg.exact_query(layer_idx + 1)
            if cfg.exact_query(layer_idx):
                state["kmin"] = jnp.zeros((batch_size, hkv, nb, d), dtype)
                state["kmax"] = jnp.zeros((batch_size, hkv, nb, d), dtype)
            if ahead:
                state["next_kmin"] = jnp.zeros((batch_size, hkv, nb, d), dtype)
                state["next_kmax"] = jnp.zeros((batch_size, hkv, nb, d), dtype)
            r = cfg.pool_blocks()
            if r:
                state["pool_k"] = jnp.zeros((batch_size * r, hkv, bs, d), dtype)
                state["pool_v"] = jnp.zeros((batch_size * r, hkv, bs, d), dtype)
                state["pool_blocks"] = jnp.full((batch_size, hkv, r), -1, jnp.int32)
                state["pool_used"] = jnp.full((batch_size, hkv, r), -1, jnp.int32)
                if ahead:
                    state["next_pool_blocks"] = jnp.full((batch_size, hkv, r), -1, jnp.int32)
        return state

    def before_step(self, cache, positions):
        """Between-step bookkeeping (evict, recall, re-evaluate); Generator calls it before each step."""
        if self.manager is None:
            raise RuntimeError("hybrid backend: call model.init_cache(..., backend) before stepping")
        return self.manager.before_step(cache, positions)

    def counters(self) -> dict:
        """Cumulative per-run instrumentation (seconds, counts): see KVManager / host.bridge."""
        return {} if self.manager is None else self.manager.counters()

    # ---- attention -------------------------------------------------------------------------------
    def _window(self, q, state, lengths, scale):
        cfg = self.config
        _, ring_len, ring_start, sink_len = ring_meta(cfg, lengths)
        sinks = {}
        if cfg.sink:
            sinks = dict(sink_k=state["sink_k"], sink_v=state["sink_v"], sink_lengths=sink_len)
        return window_attention(q, state["k_ring"], state["v_ring"], ring_len, ring_start, scale=scale,
                                return_probs=True, backend=cfg.kernel_backend, **sinks)

    def attend(self, layer_idx, q, k, v, positions, lengths, layer_cache, context: LayerContext):
        if context.sliding_window is not None:
            raise ValueError("hybrid attention does not support sliding-window layers")
        cfg = self.config
        state = write_tokens(cfg, layer_cache, k, v, positions)
        active = jnp.any(positions >= 0, axis=1)
        get = self._bridge
        scale = context.scale
        token = None
        if q.shape[1] > 1 and "pf_k" in state:  # prefill / append, offloaded part on the device
            o_c, lse_c = offloaded_attention(q, state["pf_k"], state["pf_v"], state["pf_len"], scale)
            if cfg.mode == "hgca":  # the re-evaluation's queries reach the host without an attention call
                token = bridge.record_tail(get, layer_idx, q, positions, cfg.reevaluate_queries)
            o_g, lse_g, probs = exact_window_attention(cfg, q, state, positions, lengths, scale)
            parts = [(o_g, lse_g), (o_c, lse_c)]
        elif q.shape[1] > 1:  # prefill / append, offloaded part on the CPU: exact
            ticket = bridge.submit(get, layer_idx, "all", q)
            q_gpu = bridge.after(q, ticket)
            o_g, lse_g, probs = exact_window_attention(cfg, q_gpu, state, positions, lengths, scale)
            parts = [(o_g, lse_g), bridge.collect(get, ticket, q.shape, lse_g)]
        else:
            parts, probs = self._decode(layer_idx, q, positions, lengths, state, context)
        state["maw"] = update_maw(cfg, state["maw"], probs, active)
        if token is not None:  # ties the callback to an output, so it runs and is done with the step
            state["maw"] = state["maw"] + 0.0 * token.astype(jnp.float32)
        o, _ = merge_partials([p[0] for p in parts], [p[1] for p in parts], out_dtype=jnp.float32)
        o = jnp.where((positions >= 0)[:, :, None, None], o, 0.0)
        return o.astype(q.dtype), state

    def _decode(self, layer_idx, q, positions, lengths, state, context):
        cfg = self.config
        get = self._bridge
        scale = context.scale
        if cfg.mode == "streaming":
            o_w, lse_w, probs = self._window(q, state, lengths, scale)
            return [(o_w, lse_w)], probs
        if cfg.mode == "recall":
            o_w, lse_w, probs = self._window(q, state, lengths, scale)
            e, *_ = ring_meta(cfg, lengths)
            o_o, lse_o = window_attention(q, state["off_k"], state["off_v"], e * cfg.block_size,
                                          jnp.zeros_like(e), scale=scale, backend=cfg.kernel_backend)
            return [(o_w, lse_w), (o_o, lse_o)], probs
        if cfg.mode == "hgca":
            if cfg.exchange == "sync":
                cpu = bridge.attend_now(get, layer_idx, "context", q)
                o_w, lse_w, probs = self._window(bridge.after(q, cpu[1]), state, lengths, scale)
                return [(o_w, lse_w), cpu], probs
            ticket = bridge.submit(get, layer_idx, "context", q)
            o_w, lse_w, probs = self._window(bridge.after(q, ticket), state, lengths, scale)
            return [(o_w, lse_w), bridge.collect(get, ticket, q.shape, lse_w)], probs
        return self._decode_selected(layer_idx, q, positions, lengths, state, context)

    def _k(self, state) -> int:
        return state["sel_ids"].shape[2]

    @staticmethod
    def _note_selection(state, sel, positions):
        """Record the layer's selection in its state: sel_ids [B, Hkv, k] (the whole top-k) and, with
        a pool, pool_used [B, Hkv, R] int32 = the position of the last step that selected each slot
        (-1 never) — the recall planner evicts the least recently used slots."""
        state["sel_ids"] = sel.ids.astype(jnp.int32)
        if "pool_used" in state and sel.pool_hit is not None:
            pos = positions[:, 0].astype(jnp.int32)[:, None, None]
            state["pool_used"] = jnp.where(sel.pool_hit & (pos >= 0), pos, state["pool_used"])

    def _gpu_selected(self, q, state, sel, scale):
        """GPU partial state over the selected blocks held in the recall pool (none without a pool)."""
        parts = []
        if "pool_k" in state:
            parts.append(block_sparse_attention(q, state["pool_k"], state["pool_v"], sel.gpu_ids,
                                                sel.gpu_counts, scale=scale,
                                                backend=self.config.kernel_backend))
        return parts

    def _decode_selected(self, layer_idx, q, positions, lengths, state, context):
        """scout and topk decode."""
        cfg = self.config
        get = self._bridge
        scale = context.scale
        e, *_ = ring_meta(cfg, lengths)
        pool = state.get("pool_blocks")
        if cfg.exact_query(layer_idx):
            # Exact query (topk; scout's layer 0 and scout_exact_layers): select with q, submit the
            # CPU part before the GPU window attention, collect after it. If the next layer runs on a
            # prediction, this layer's collect also submits it (one exchange callback).
            if layer_idx == 0:
                self._carry.clear()  # a new traced step (drops leftovers of a failed trace)
            elif layer_idx in self._carry:
                raise RuntimeError(f"scout: layer {layer_idx} runs on its exact query but a layer-ahead "
                                   "selection was submitted for it")
            sel = select(q[:, 0], state["kmin"], state["kmax"], e, self._k(state), pool, cfg.kernel_backend)
            ticket = bridge.submit(get, layer_idx, "blocks", q, sel.cpu_ids)
            q = bridge.after(q, ticket)
        else:  # scout, predicted at the previous layer
            if layer_idx not in self._carry:
                raise RuntimeError(f"scout: no layer-ahead selection for layer {layer_idx} (layers must run "
                                   "in order inside one traced step)")
            sel, ticket = self._carry.pop(layer_idx)
        self._note_selection(state, sel, positions)
        nxt = context.next_layer
        ahead = cfg.predicts() and nxt is not None and not cfg.exact_query(layer_idx + 1)
        next_q = next_ids = None
        if ahead:
            hidden = nxt.attention_input(context.layer_input)
            next_q = nxt.attention.project_q(hidden, positions)  # [B, 1, Hq, D] predicted
            next_sel = select(next_q[:, 0], state["next_kmin"], state["next_kmax"], e, self._k(state),
                              state.get("next_pool_blocks"), cfg.kernel_backend)
            next_ids = next_sel.cpu_ids
        o_w, lse_w, probs = self._window(q, state, lengths, scale)
        parts = [(o_w, lse_w)] + self._gpu_selected(q, state, sel, scale)
        if ahead:
            o_c, lse_c, next_ticket = bridge.exchange(get, ticket, q.shape, "blocks", layer_idx + 1,
                                                      next_q, next_ids, lse_w)
            self._carry[layer_idx + 1] = (next_sel, next_ticket)
        else:
            o_c, lse_c = bridge.collect(get, ticket, q.shape, lse_w)
        parts.append((o_c, lse_c))
        return parts, probs


__all__ = ["HybridAttention", "make_backend"]
