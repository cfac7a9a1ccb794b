"""Restoring a session's KV, layer by layer, pipelined (paper §3.1, §4.1).

A restore plan gives each layer a method:
  "recompute": run the layer again from the tokens (only a PREFIX of layers can do this: layer r
               needs layer r-1's output; the paper puts recomputed layers first);
  "hidden":    read the layer's saved input hidden states [n, d_model] and project them to K, V
               (`kv_from_hidden`: norm, K/V projections, biases, RoPE at positions 0..n-1);
  "kv":        read the layer's saved K, V [n, 2, Hkv, D] as they are.

`restore_kv` reads on a background thread, in the order hidden layers, then KV layers, while the
calling thread recomputes the prefix and dispatches each hidden layer's projection as soon as that
layer has arrived (JAX dispatch is asynchronous), so transfer of layer l+1 overlaps the projection
of layer l (the default `pipeline="reader"`; "upfront" issues every fetch before any projection;
"in_jit" / "in_jit_lhs" run all hidden and KV layers as ONE jitted program whose inputs are the
rows still in pinned host memory, moved to the device inside it so that XLA's scheduler overlaps
the host->device copies with the projections: see `restore_kv`). Every restored layer is handed
to a **sink** `sink(layer, k, v)` with k, v [1, n, Hkv, D] device arrays for positions [0, n).
`FullCacheWriter` is the sink for the `full` backend; a hybrid backend (GPU window + host store)
gets its own sink that writes the last `window` positions to the device window and the rest to
its host store.

Length buckets (compile once per bucket, not once per history length): the jitted projection, KV
split and recompute programs run at a BUCKETED length nb = `bucket_length(n, step)` >= n, so every
history length of a bucket reuses one compilation. Policy (`bucket_length`): n rounded up to a
multiple of max(step, 2 ** (floor(log2(n - 1)) - 2)), step = 256 by default, i.e. multiples of 256
up to 2048 tokens, then 4 buckets per doubling (2560, 3072, 3584, 4096, 5120, ...): padding stays
below 25% of n beyond 1K tokens (below `step` rows under it) and the number of programs grows with
log(n). `LayerKernels(model, bucket=None)` (or 0 / 1) turns bucketing off (exact shapes: the
reference path). Where the padding comes from, two ways:
  * a source sends only the n real rows: they are zero-padded to nb on the device by a tiny copy
    program (`_pad_rows`; no matmul, nothing to autotune, but still one compilation per n and row
    width: ~50 ms each on the CPU backend, so a new length costs ~2 of those instead of the full
    set of projection programs);
  * a source sends nb rows (`SessionFileSource(pad_to=nb)`, `HostMemorySource(pad_to=nb)`): no
    program is compiled for a new length of a known bucket. SessionFileSource zeroes the tail of
    its reused read buffer (no extra host copy); the transfer grows by the padding (< 25% beyond
    1K tokens). HCacheEngine restores use this (a new history length is the common case).
Padded rows are per-row independent of the real ones (norm, projections and
RoPE are row-wise; recompute masks them by position -1), so the real rows' K, V come out exactly
as on the unbucketed path (tested bit for bit on the CPU backend). A sink with `accepts_padded =
True` gets k, v [1, m, Hkv, D] with m >= n (only the first n rows are valid; `FullCacheWriter`
writes only those rows, masked, so no padded position ever enters the cache); any other sink gets
k[:, :n], v[:, :n] (one slice per layer).
"""

from __future__ import annotations

import functools
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jhybrid.attention.full import FullAttention
from jhybrid.hcache.storage import ChunkLayout, CorruptSession, read_layer_chunks, verify_chunks
from jhybrid.models.decoder import CausalLM, KVCache, kv_from_hidden

log = logging.getLogger("jhybrid.hcache")

Sink = Callable[[int, jax.Array, jax.Array], None]
Fetch = Callable[[int, str], jax.Array]


def validate_plan(methods, num_layers: int) -> tuple[str, ...]:
    methods = tuple(methods)
    if len(methods) != num_layers:
        raise ValueError(f"restore plan has {len(methods)} layers, the model {num_layers}")
    bad = [m for m in methods if m not in ("hidden", "kv", "recompute")]
    if bad:
        raise ValueError(f"unknown restore methods {sorted(set(bad))} (hidden, kv, recompute)")
    r = methods.count("recompute")
    if methods[:r] != ("recompute",) * r:
        raise ValueError(f"recomputed layers must come first (a prefix), got {methods}")
    return methods


# Module-level jitted functions with the (hashable) graphdef and config as static arguments, so
# every LayerKernels / engine of the same model shares one compilation per shape.


def _join(rows) -> jax.Array:
    """rows: one array [n, r] or a tuple of pieces [n_i, r] along the token axis -> [n, r]."""
    if isinstance(rows, (tuple, list)):
        return rows[0] if len(rows) == 1 else jnp.concatenate(rows, axis=0)
    return rows


DEFAULT_BUCKET = 256


def bucket_length(n: int, step: int | None = DEFAULT_BUCKET) -> int:
    """The padded length the restore programs run at for n history tokens (module docstring).

    step None, 0 or 1: no bucketing (n itself). Otherwise n rounded up to a multiple of
    max(step, 2 ** (floor(log2(n - 1)) - 2)): multiples of step while those are coarser, then
    4 buckets per doubling of n (n <= nb < 1.25 n beyond 4 * step tokens)."""
    n = int(n)
    if not step or step <= 1 or n <= 0:
        return n
    grain = max(int(step), 1 << max(0, (n - 1).bit_length() - 3))
    return -(-n // grain) * grain


def _rows_len(rows) -> int:
    return sum(r.shape[0] for r in rows) if isinstance(rows, (tuple, list)) else rows.shape[0]


@functools.partial(jax.jit, static_argnums=(1,))
def _pad_rows(rows, length):
    """rows [n, r] (or pieces) -> [length, r], zero rows after n: joins and pads on the device."""
    rows = _join(rows)
    return jnp.pad(rows, ((0, length - rows.shape[0]), (0, 0)))


def _take_queries(hidden, positions, num_queries, n):
    """The last num_queries of the n valid rows of hidden [1, m, d] and positions [1, m]."""
    if n is None:
        return hidden[:, -num_queries:], positions[:, -num_queries:]
    start = n - num_queries
    return (jax.lax.dynamic_slice_in_dim(hidden, start, num_queries, axis=1),
            jax.lax.dynamic_slice_in_dim(positions, start, num_queries, axis=1))


def _project_rows(config, graphdef, state, rows, positions, num_queries, n=None):
    """The body of `_project` (also traced into the in_jit restore program, `_restore_layers`)."""
    layer = nnx.merge(graphdef, state)
    hidden = _join(rows)[None].astype(config.dtype)  # [1, m, d]
    k, v = kv_from_hidden(layer, hidden, positions)
    if not num_queries:
        return k, v, None
    tail, tail_positions = _take_queries(hidden, positions, num_queries, n)
    q = layer.attention.project_q(layer.attention_input(tail), tail_positions)
    return k, v, q


@functools.partial(jax.jit, static_argnums=(0, 1, 5))
def _project(config, graphdef, state, rows, positions, num_queries, n=None):
    """rows [n, d_model] (or pieces, joined here: inside the jit, on the dispatching thread) ->
    k, v [1, n, Hkv, D] and, when num_queries > 0, the queries q [1, num_queries, Hq, D] of the
    last num_queries positions (norm + W_q + RoPE, what the layer computed for those tokens).
    n (traced int32 scalar, or None = every row): the valid rows when rows are bucket-padded; the
    queries are those of positions n - num_queries .. n - 1."""
    return _project_rows(config, graphdef, state, rows, positions, num_queries, n)


def _split_rows(rows, num_kv_heads, head_dim):
    """The body of `_split_kv` (also traced into `_restore_layers`)."""
    kv = _join(rows)
    kv = kv.reshape(1, kv.shape[0], 2, num_kv_heads, head_dim)
    return kv[:, :, 0], kv[:, :, 1]


@functools.partial(jax.jit, static_argnums=(1, 2))
def _split_kv(rows, num_kv_heads, head_dim):
    """KV rows [n, 2*Hkv*D] (or pieces) -> k, v [1, n, Hkv, D] (one program, no eager copies)."""
    return _split_rows(rows, num_kv_heads, head_dim)


def _to_device_memory(x):
    """Inside a jit: an input living in host memory (a `pinned_host` / `unpinned_host` jax array)
    -> device memory. JAX lowers this to an `annotate_device_placement` custom call on GPU/TPU,
    which XLA's host offloader turns into an async copy-start / copy-done pair (run on a separate
    copy stream on GPU) that the latency-hiding scheduler can overlap with other layers'
    projections. On the CPU backend JAX lowers it to nothing (one memory). Inputs already in
    device memory pass through."""
    if jax.typeof(x).memory_space == jax.memory.Space.Host:
        return jax.device_put(x, jax.memory.Space.Device)
    return x


def _restore_layers(config, graphdefs, methods, num_queries, states, rows, positions, n):
    """The in_jit restore program: every "hidden" / "kv" layer of a restore in ONE program.

    rows[i]: layer i's rows (one array or a tuple of pieces along the token axis), each in host
    memory (moved to the device inside the program, `_to_device_memory`) or on the device;
    n real rows or nb = positions.shape[1] (bucket-padded) rows, zero-padded to nb here.
    methods[i] "hidden": `_project_rows` with graphdefs[i], states[i]; "kv": `_split_rows`.
    -> per layer (k, v, q or None), k, v [1, nb, Hkv, D]: op for op the math of the reader
    pipeline's `_pad_rows` + `_project` / `_split_kv` programs."""
    nb = positions.shape[1]
    out = []
    for graphdef, method, state, layer_rows in zip(graphdefs, methods, states, rows):
        pieces = layer_rows if isinstance(layer_rows, tuple) else (layer_rows,)
        x = _join(tuple(_to_device_memory(p) for p in pieces))
        if x.shape[0] < nb:
            x = jnp.pad(x, ((0, nb - x.shape[0]), (0, 0)))
        if method == "hidden":
            out.append(_project_rows(config, graphdef, state, x, positions, num_queries, n))
        else:
            out.append(_split_rows(x, config.num_kv_heads, config.head_dim) + (None,))
    return tuple(out)


_IN_JIT_STATIC = (0, 1, 2, 3)
# "in_jit": XLA's default options; "in_jit_lhs": the same program compiled with XLA:GPU's
# latency-hiding scheduler forced on (the pass that moves copy-starts early so that a layer's
# host->device copy runs under earlier layers' projections), should the default have it off.
_RESTORE_PROGRAMS = {
    "in_jit": jax.jit(_restore_layers, static_argnums=_IN_JIT_STATIC),
    "in_jit_lhs": jax.jit(_restore_layers, static_argnums=_IN_JIT_STATIC,
                          compiler_options={"xla_gpu_enable_latency_hiding_scheduler": True}),
}


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(5,))
def _run_layer(graphdef, state, x, positions, lengths, layer_cache):
    layer = nnx.merge(graphdef, state)
    x, layer_cache, _ = layer(x, positions, lengths, layer_cache, FullAttention(), None)
    return x, layer_cache


@functools.partial(jax.jit, static_argnums=(0, 1))
def _embed(config, graphdef, state, tokens, positions):
    # Mirrors the first lines of CausalLM.hidden_states (embedding, scale, learned positions).
    embed, position_embed = nnx.merge(graphdef, state)
    x = embed(tokens)
    if config.embed_scale is not None:
        x = x * jnp.asarray(config.embed_scale, x.dtype)
    if position_embed is not None:
        x = x + position_embed(jnp.maximum(positions, 0) + config.learned_position_offset)
    return x


class LayerKernels:
    """Jitted per-layer functions of one model, compiled once per layer KIND (not per layer).

    Layers of the same kind (sliding or not) have identical structure; their graphdefs differ
    only in the static `layer_idx`, which kv_from_hidden and the full backend do not use, so one
    representative graphdef per kind serves all of them with each layer's own parameters.

    bucket: the length-bucket step (module docstring; None, 0 or 1: exact shapes).
    """

    def __init__(self, model: CausalLM, bucket: int | None = DEFAULT_BUCKET):
        self.config = model.config
        self.bucket = bucket
        self.states = []
        representative: dict[bool, object] = {}
        self.graphdef_of = []
        for i, layer in enumerate(model.layers):
            graphdef, state = nnx.split(layer)
            kind = model.config.is_sliding_layer(i)
            representative.setdefault(kind, graphdef)
            self.graphdef_of.append(representative[kind])
            self.states.append(state)
        self._positions: dict[int, jax.Array] = {}
        self.embed_parts = nnx.split((model.embed, model.position_embed))

    def positions(self, n: int) -> jax.Array:
        """[1, n] int32 positions 0..n-1 on the device (cached: one upload per history length)."""
        out = self._positions.get(n)
        if out is None:
            out = self._positions[n] = jnp.arange(n, dtype=jnp.int32)[None]
            if len(self._positions) > 8:
                self._positions.pop(next(iter(self._positions)))
        return out

    def padded_length(self, n: int) -> int:
        """The bucketed length nb >= n the programs run at for n history tokens."""
        return bucket_length(n, self.bucket)

    def pad(self, rows, n: int | None = None):
        """rows of n real tokens -> rows of padded_length(n). rows: [n, r] (or pieces along n):
        zero-padded on the device (a tiny program per n); or one array already of
        padded_length(n) rows (a source that sent the padding: `pad_to`), passed through."""
        m = _rows_len(rows)
        n = m if n is None else n
        nb = self.padded_length(n)
        if m == nb and (nb == n or not isinstance(rows, (tuple, list))):
            return rows  # unbucketed pieces are joined inside the heavy jits themselves
        if m != n:
            raise ValueError(f"restore rows hold {m} tokens; expected {n} (or {nb} padded)")
        return _pad_rows(tuple(rows) if isinstance(rows, list) else rows, nb)

    def project(self, layer: int, rows, num_queries: int = 0, padded: bool = False,
                n: int | None = None):
        """rows [n, d_model] (storage dtype; or a tuple of pieces along n) -> k, v [1, n, Hkv, D]
        at positions 0..n-1; with num_queries > 0 -> (k, v, q [1, num_queries, Hq, D]), the
        queries of the last num_queries positions. The projection runs at the bucketed length;
        padded=True returns k, v [1, nb, Hkv, D] (rows n.. are padding), else [1, n, Hkv, D].
        n: the real tokens when rows come padded already (see `pad`); default all of rows."""
        n = _rows_len(rows) if n is None else n
        rows = self.pad(rows, n)
        nb = self.padded_length(n)
        k, v, q = _project(self.config, self.graphdef_of[layer], self.states[layer], rows,
                           self.positions(nb), min(num_queries, n),
                           None if nb == n else np.int32(n))
        if not padded and nb != n:
            k, v = k[:, :n], v[:, :n]
        return (k, v) if not num_queries else (k, v, q)

    def split_kv(self, rows, padded: bool = False, n: int | None = None):
        """Saved KV rows [n, 2*Hkv*D] (or pieces; or [nb, ...] already padded, with n given) ->
        k, v [1, n, Hkv, D] ([1, nb, Hkv, D] with padded=True, rows n.. padding)."""
        n = _rows_len(rows) if n is None else n
        k, v = _split_kv(self.pad(rows, n), self.config.num_kv_heads, self.config.head_dim)
        if not padded and k.shape[1] != n:
            k, v = k[:, :n], v[:, :n]
        return k, v

    def embed(self, tokens, positions) -> jax.Array:
        """tokens, positions [B, T] int32 -> the first layer's input [B, T, d_model]."""
        return _embed(self.config, self.embed_parts[0], self.embed_parts[1], tokens, positions)

    def run_layer(self, layer: int, x, positions, lengths, layer_cache):
        """One DecoderLayer on the full backend: -> (output [B, T, d_model], new layer cache)."""
        return _run_layer(self.graphdef_of[layer], self.states[layer], x, positions, lengths,
                          layer_cache)


def recompute_kv(kernels: LayerKernels, tokens: np.ndarray, num_layers: int, sink: Sink,
                 chunk: int = 1024) -> None:
    """Token recomputation of the first `num_layers` layers (an exact chunked prefill of those
    layers, full backend); each layer's k, v [1, n, Hkv, D] goes to the sink at the end
    ([1, m >= n, ...] to a sink with accepts_padded). Chunk and cache capacity follow the
    bucketed length, so every n of a bucket runs the same programs."""
    n, config = len(tokens), kernels.config
    if num_layers == 0 or n == 0:
        return
    nb = max(kernels.padded_length(n), -(-n // 16) * 16)
    chunk = min(chunk, nb)
    capacity = -(-nb // chunk) * chunk
    backend = FullAttention()
    caches = [backend.init_layer_cache(config, i, 1, capacity, config.dtype) for i in range(num_layers)]
    for begin in range(0, n, chunk):
        pos = begin + np.arange(chunk, dtype=np.int32)
        positions = np.where(pos < n, pos, -1)[None]
        chunk_tokens = np.zeros((1, chunk), np.int32)
        chunk_tokens[0, :min(chunk, n - begin)] = tokens[begin:begin + chunk]
        lengths = np.full((1,), min(n, begin + chunk), np.int32)
        x = kernels.embed(chunk_tokens, positions)
        for layer in range(num_layers):
            x, caches[layer] = kernels.run_layer(layer, x, positions, lengths, caches[layer])
    padded = bool(getattr(sink, "accepts_padded", False))
    for layer in range(num_layers):
        k, v = caches[layer]["k"], caches[layer]["v"]
        if not padded or k.shape[1] < n:
            k, v = k[:, :n], v[:, :n]
        sink(layer, k, v)


PIPELINES = ("reader", "upfront", "in_jit", "in_jit_lhs")
_logged: set = set()


def _log_once(level: int, key, message: str, *args) -> None:
    if key not in _logged:
        _logged.add(key)
        log.log(level, message, *args)


def _dispatch_layer(kernels: LayerKernels, layer: int, method: str, rows, n: int,
                    num_queries: int, padded: bool, sink: Sink) -> None:
    """One "hidden" / "kv" layer of the reader / upfront pipelines: its program, then the sink."""
    if method == "hidden":
        if num_queries:
            k, v, q = kernels.project(layer, rows, num_queries, padded=padded, n=n)
            sink.queries(layer, q)
        else:
            k, v = kernels.project(layer, rows, padded=padded, n=n)
    else:
        k, v = kernels.split_kv(rows, padded=padded, n=n)
    sink(layer, k, v)


def _in_memory_space(x, space) -> bool:
    return isinstance(x, jax.Array) and jax.typeof(x).memory_space == space


def _dispatch_in_jit(kernels: LayerKernels, methods, io_order, host_rows, n: int,
                     num_queries: int, pipeline: str):
    """Dispatches the in_jit restore program (`_restore_layers`) over every io_order layer.
    -> (outputs per io_order layer (k, v, q or None) at the bucketed length, the mode used), or
    (None, reason) when XLA refused to compile it (the caller falls back to the reader)."""
    nb = kernels.padded_length(n)
    rows = []
    for layer in io_order:
        r = host_rows(layer, methods[layer])
        r = tuple(r) if isinstance(r, (tuple, list)) else r
        m = _rows_len(r)
        if m != n and not (m == nb and not isinstance(r, tuple)):
            raise ValueError(f"layer {layer}: host rows hold {m} tokens; expected {n} "
                             f"(or {nb} padded, as one array)")
        rows.append(r)
    leaves = jax.tree_util.tree_leaves(rows)
    not_host = sum(not _in_memory_space(x, jax.memory.Space.Host) for x in leaves)
    platform = kernels.positions(nb).devices().pop().platform
    if not_host:
        mode = f"{pipeline}:dispatch_copies"
        _log_once(logging.WARNING, ("in_jit-not-host", platform),
                  "hcache restore %s: %d of %d row arrays are not jax arrays in host memory "
                  "(pinned_host) but NumPy or device arrays: jit copies them to the device before "
                  "the program starts, so transfers do not overlap projections inside it (same "
                  "numerics)", pipeline, not_host, len(leaves))
    else:
        mode = pipeline
        if platform == "cpu":
            _log_once(logging.INFO, ("in_jit-cpu",),
                      "hcache restore %s on the CPU backend: host and device memory are one, the "
                      "in-program host->device moves lower to nothing (numerics and program "
                      "structure only)", pipeline)
    graphdefs = tuple(kernels.graphdef_of[l] if methods[l] == "hidden" else None for l in io_order)
    states = tuple(kernels.states[l] if methods[l] == "hidden" else None for l in io_order)
    kinds = tuple(methods[l] for l in io_order)
    try:
        out = _RESTORE_PROGRAMS[pipeline](
            kernels.config, graphdefs, kinds, min(num_queries, n), states, tuple(rows),
            kernels.positions(nb), None if nb == n else np.int32(n))
    except jax.errors.JaxRuntimeError as err:
        reason = f"XLA could not compile the {pipeline} restore program ({err})"
        _log_once(logging.WARNING, ("in_jit-compile", pipeline, str(err)[:200]),
                  "hcache restore: %s; falling back to the reader pipeline", reason)
        return None, reason
    return out, mode


def restore_kv(kernels: LayerKernels, methods, tokens: np.ndarray, fetch: Fetch, sink: Sink,
               recompute_chunk: int = 1024, pipeline: str = "reader") -> str:
    """Restores K, V of positions [0, n) (n = len(tokens)) of every layer into `sink`.

    methods: per layer "recompute" (a prefix), "hidden" or "kv" (see module docstring).
    fetch(layer, method) -> device rows [n, d_model] for "hidden", [n, 2 * Hkv * D] for "kv"
    (storage dtype), or a tuple of pieces of such rows along n, or one array of
    kernels.padded_length(n) rows (the source sent the bucket padding, e.g. `pad_to`; the rows
    after n are ignored whatever they hold); runs on one background reader
    thread, in I/O order. fetch must only START TRANSFERS (device_put), never dispatch device
    computations (concatenate, reshape, ...): on a GPU the reader thread runs ahead of the
    projections, and a computation it enqueued for layer l+5 would sit in the compute stream in
    front of layer l's projection and wait for layer l+5's transfer — serialising transfer and
    projection. Pieces are joined inside the projection's jit on this (the calling) thread.
    A sink with an int attribute `num_queries` > 0 also gets, for each "hidden" layer,
    sink.queries(layer, q) with q [1, num_queries, Hq, D]: the queries of the last positions
    (hgca's re-evaluation of offloaded tokens needs them; see jhybrid.hybrid.ingest).
    A sink with `accepts_padded = True` gets k, v [1, m >= n, Hkv, D] of which only the first n
    rows are valid (the bucketed programs' outputs, no slicing copy); others get [1, n, Hkv, D].
    Returns when every layer has been dispatched to the sink (the device work may still run:
    block on the sink's arrays to time it).

    pipeline (how the "hidden" / "kv" layers are moved and projected; same K, V bit for bit):
      "reader"      (default) the reader thread above; one jitted program per layer.
      "upfront"     no thread: this thread calls fetch for every layer first (all transfers
                    issued before any projection is dispatched), then dispatches the projections.
                    Only sensible for asynchronous fetches (device_put from host memory).
      "in_jit"      ONE jitted program for all those layers (`_restore_layers`) whose inputs are
                    the rows still in host memory: `fetch.host_rows(layer, method)` must return
                    them (rows as for fetch — one array or pieces, n or padded_length(n) rows —
                    but `pinned_host` jax arrays NOT moved to the device). The program moves each
                    layer's rows to the device itself (JAX memory kinds: XLA async copies that its
                    scheduler overlaps with the projections), then projects / splits them.
      "in_jit_lhs"  "in_jit" compiled with XLA:GPU's latency-hiding scheduler forced on.
    The in_jit variants fall back, with a WARNING logged once per cause, never silently: to
    "reader" when fetch has no `host_rows` or XLA cannot compile the program; to copying the
    rows at dispatch (the program itself unchanged, mode "<pipeline>:dispatch_copies") when host
    rows are NumPy or device arrays rather than host-memory jax arrays. On the CPU backend
    in-program moves are no-ops (one memory; logged at INFO). Sink calls come in the same order
    for every pipeline (recomputed layers, then I/O order); in_jit calls the sink only after its
    one program has been dispatched.
    Returns the pipeline used: pipeline itself, "<pipeline>:dispatch_copies", or "reader" after
    a fallback.
    """
    config, n = kernels.config, len(tokens)
    methods = validate_plan(methods, config.num_layers)
    if pipeline not in PIPELINES:
        raise ValueError(f"unknown restore pipeline {pipeline!r} ({', '.join(PIPELINES)})")
    num_queries = int(getattr(sink, "num_queries", 0) or 0)
    padded = bool(getattr(sink, "accepts_padded", False))
    io_order = ([l for l, m in enumerate(methods) if m == "hidden"]
                + [l for l, m in enumerate(methods) if m == "kv"])
    num_recompute = methods.count("recompute")
    used = pipeline
    if pipeline.startswith("in_jit") and io_order:
        host_rows = getattr(fetch, "host_rows", None)
        if host_rows is None:
            _log_once(logging.WARNING, ("in_jit-no-host-rows", type(fetch).__name__),
                      "hcache restore %s: the source %s has no host_rows(layer, method) (rows "
                      "still in host memory); falling back to the reader pipeline", pipeline,
                      type(fetch).__name__)
            used = pipeline = "reader"
        else:
            # Dispatched before the recompute prefix: its transfers start at once and the
            # recompute programs queue behind it (as the reader's transfers run under them).
            out, mode = _dispatch_in_jit(kernels, methods, io_order, host_rows, n, num_queries,
                                         pipeline)
            if out is None:
                used = pipeline = "reader"
            else:
                recompute_kv(kernels, tokens, num_recompute, sink, recompute_chunk)
                for layer, (k, v, q) in zip(io_order, out):
                    if q is not None and num_queries:
                        sink.queries(layer, q)
                    if not padded and k.shape[1] != n:
                        k, v = k[:, :n], v[:, :n]
                    sink(layer, k, v)
                return mode
    if pipeline == "upfront" or not io_order:
        arrived = {l: fetch(l, methods[l]) for l in io_order}
        recompute_kv(kernels, tokens, num_recompute, sink, recompute_chunk)
        for layer in io_order:
            _dispatch_layer(kernels, layer, methods[layer], arrived.pop(layer), n, num_queries,
                            padded, sink)
        return used
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="hcache-reader") as reader:
        arriving = {l: reader.submit(fetch, l, methods[l]) for l in io_order}
        try:
            recompute_kv(kernels, tokens, num_recompute, sink, recompute_chunk)
            for layer in io_order:
                rows = arriving.pop(layer).result()
                # the device rows can go as soon as the projection has consumed them
                _dispatch_layer(kernels, layer, methods[layer], rows, n, num_queries, padded, sink)
                del rows
        except BaseException:
            for future in arriving.values():
                future.cancel()
            raise
    return used


# ----------------------------------------------------------------------------- sinks


@functools.partial(jax.jit, donate_argnums=(0,))
def _write_prefix(buffer, values, n):
    """buffer [1, S, Hkv, D], values [1, m, Hkv, D] -> buffer with slots [0, n) = values[:, :n];
    the other slots keep their content (padded rows n.. of values are masked out, never written).
    Compiled per (S, m), not per n (n is traced)."""
    m = min(values.shape[1], buffer.shape[1])
    values = values[:, :m].astype(buffer.dtype)
    old = buffer[:, :m]
    keep = jnp.arange(m, dtype=jnp.int32)[None, :, None, None] < n
    return jax.lax.dynamic_update_slice(buffer, jnp.where(keep, values, old), (0, 0, 0, 0))


class FullCacheWriter:
    """Sink that writes restored layers into a fresh `full`-backend KVCache of max_len slots.

    After restore_kv: `writer.cache()` is a KVCache holding positions [0, n) with lengths [n].
    Accepts bucket-padded k, v [1, m >= n, Hkv, D]: only rows [0, n) are written.
    """

    accepts_padded = True

    def __init__(self, model: CausalLM, max_len: int, num_tokens: int):
        if num_tokens > max_len:
            raise ValueError(f"restoring {num_tokens} tokens into a cache of {max_len} slots")
        self.cache_layers = list(model.init_cache(1, max_len).layers)
        self.num_tokens = num_tokens

    def __call__(self, layer: int, k: jax.Array, v: jax.Array) -> None:
        old = self.cache_layers[layer]
        n = np.int32(self.num_tokens)
        self.cache_layers[layer] = {"k": _write_prefix(old["k"], k, n), "v": _write_prefix(old["v"], v, n)}

    def cache(self) -> KVCache:
        return KVCache(layers=tuple(self.cache_layers),
                       lengths=jnp.full((1,), self.num_tokens, jnp.int32))


class CollectingSink:
    """Sink that keeps each layer's (k, v) [1, n, Hkv, D] (tests, benchmarks)."""

    def __init__(self, num_layers: int):
        self.layers: list = [None] * num_layers

    def __call__(self, layer, k, v):
        self.layers[layer] = (k, v)

    def block(self):
        jax.block_until_ready([kv for kv in self.layers if kv is not None])


# ----------------------------------------------------------------------------- sources


def to_device(host: np.ndarray, device=None) -> jax.Array:
    """Host rows -> a device array that no longer depends on `host` (the buffer is reused).

    On the CPU backend device_put may alias NumPy memory, so it copies instead.
    """
    device = device or jax.devices()[0]
    if device.platform == "cpu":
        out = jnp.array(host, copy=True)
    else:
        out = jax.device_put(host, device)
    return out.block_until_ready()


class SessionFileSource:
    """`fetch` over a saved session's chunk files (storage.ChunkLayout), crc-checked.

    manifest: the session's manifest (storage part: row_values, num_full_chunks, chunk_crc,
    tail_file, tail_offsets, tail_crc). Reads the first `num_tokens` tokens of a layer with one
    sequential read per stripe into a reused host buffer, verifies the chunks' crc32, copies to
    the device.
    pad_to (>= num_tokens, e.g. LayerKernels.padded_length(num_tokens)): send that many rows,
    the rows after num_tokens zeroed in the read buffer (no extra host copy; the transfer grows
    by the padding) so the restore needs no per-length pad program on the device. None: send
    only the real rows (padded on the device).
    """

    def __init__(self, layout: ChunkLayout, manifest: dict, num_tokens: int, dtype,
                 buffers: dict | None = None, pad_to: int | None = None):
        self.layout, self.manifest, self.num_tokens = layout, manifest, num_tokens
        self.send_rows = max(num_tokens, pad_to or 0)
        self.session_id = manifest["session_id"]
        self.dtype = np.dtype(dtype)
        chunk = layout.chunk_tokens
        self.num_chunks = min(manifest["num_full_chunks"] or 0, num_tokens // chunk)
        # Host read buffers by row width, reused across restores when the caller passes a dict
        # (first touch of fresh memory is slow); one restore at a time per dict.
        self.buffers: dict[int, np.ndarray] = {} if buffers is None else buffers
        self.tail_bytes = None
        if num_tokens > self.num_chunks * chunk:
            if num_tokens > manifest["num_tokens"]:
                raise ValueError(f"session {self.session_id} holds {manifest['num_tokens']} tokens, "
                                 f"not {num_tokens}")
            path = os.path.join(layout.session_dir(0, self.session_id), manifest["tail_file"])
            try:
                with open(path, "rb") as f:
                    self.tail_bytes = f.read()
            except OSError as err:
                raise CorruptSession(f"session {self.session_id}: tail file unreadable: {err}") from err

    def _buffer(self, row: int) -> np.ndarray:
        rows_needed = -(-self.send_rows // self.layout.chunk_tokens) * self.layout.chunk_tokens
        buf = self.buffers.get(row)
        if buf is None or len(buf) < rows_needed or buf.dtype != self.dtype:
            buf = self.buffers[row] = np.empty((rows_needed, row), self.dtype)
        return buf

    def __call__(self, layer: int, method: str) -> jax.Array:
        import zlib

        manifest, chunk = self.manifest, self.layout.chunk_tokens
        if manifest["methods"][layer] != method:
            raise ValueError(f"layer {layer} was saved as {manifest['methods'][layer]!r}, not {method!r}")
        row = manifest["row_values"][layer]
        buf = self._buffer(row)
        what = f"session {self.session_id} layer {layer} ({method})"
        read_layer_chunks(self.layout, self.session_id, layer, self.num_chunks, buf)
        verify_chunks(buf[:self.num_chunks * chunk], chunk, manifest["chunk_crc"][layer][:self.num_chunks],
                      what)
        rest = self.num_tokens - self.num_chunks * chunk
        if rest:
            begin, end = manifest["tail_offsets"][layer]
            tail = self.tail_bytes[begin:end]
            if len(tail) != end - begin or zlib.crc32(tail) != manifest["tail_crc"][layer]:
                raise CorruptSession(f"{what}: tail checksum mismatch")
            tail_rows = np.frombuffer(tail, self.dtype).reshape(-1, row)
            buf[self.num_chunks * chunk:self.num_tokens] = tail_rows[:rest]
        buf[self.num_tokens:self.send_rows] = 0
        return to_device(buf[:self.send_rows])


class HostMemorySource:
    """`fetch` over per-layer arrays already in host memory (the "dram" storage).

    hidden[l]: [>= n, d_model], kv[l]: [>= n, 2*Hkv*D] — NumPy arrays, or pinned_host jax arrays
    on GPU (device_put from pinned memory runs at full PCIe speed and asynchronously).
    pad_to: send that many rows where the array holds them (the rows after num_tokens as stored:
    the restore ignores them), else only the real rows (padded on the device).
    An array of exactly the rows to send is sent as it is. A longer jax array must be sliced,
    and slicing a pinned_host jax array is a device program (dispatched from the reader thread,
    logged once): size the arrays to the rows to send (or pad_to) where that matters.
    `host_rows(layer, method)`: the rows to send, still in host memory (restore_kv's in_jit
    pipelines move them to the device inside their program).
    """

    def __init__(self, hidden: list | None, kv: list | None, num_tokens: int, device=None,
                 pad_to: int | None = None):
        self.arrays = {"hidden": hidden, "kv": kv}
        self.num_tokens = num_tokens
        self.pad_to = pad_to
        self.device = device or jax.devices()[0]

    def host_rows(self, layer: int, method: str):
        array = self.arrays[method][layer]
        send = self.pad_to if self.pad_to and array.shape[0] >= self.pad_to else self.num_tokens
        if array.shape[0] == send:
            return array  # no slice: x[:len(x)] of a jax array is a no-op today, but say so
        if isinstance(array, jax.Array):
            _log_once(logging.INFO, ("host-slice", str(array.sharding.memory_kind)),
                      "hcache HostMemorySource: slicing %s rows of a %s-row %s jax array runs a "
                      "slice program; arrays of exactly the rows to send avoid it", send,
                      array.shape[0], array.sharding.memory_kind)
        return array[:send]

    def __call__(self, layer: int, method: str) -> jax.Array:
        rows = self.host_rows(layer, method)
        if isinstance(rows, np.ndarray):
            return to_device(rows, self.device)
        return jax.device_put(rows, jax.sharding.SingleDeviceSharding(self.device))


def bytes_per_token(config, methods, itemsize: int) -> int:
    """Storage bytes per token of a plan: hidden d_model, KV 2*Hkv*D values per layer; token ids
    (int32) when any layer is recomputed."""
    per_layer = {"hidden": config.d_model, "kv": 2 * config.num_kv_heads * config.head_dim,
                 "recompute": 0}
    total = sum(per_layer[m] for m in methods) * itemsize
    return total + (4 if "recompute" in methods else 0)


def row_values(config, methods) -> list[int]:
    """Values per token row stored for each layer of a plan."""
    per_layer = {"hidden": config.d_model, "kv": 2 * config.num_kv_heads * config.head_dim,
                 "recompute": 0}
    return [per_layer[m] for m in methods]

