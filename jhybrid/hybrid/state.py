"""The device state of the hybrid modes: typed pytrees, each group documented once.

Shapes: B sequences, Hkv KV heads, D head dim, S = sink, W = ring tokens (window - sink),
bs = block_size, NB = host blocks per (layer, sequence) at most (`OffloadConfig.host_blocks`),
R = recall-pool slots per (sequence, KV head), k = top-k budget in blocks, P = padded tokens of a
device copy. "model dtype" is the dtype the cache was built with (bfloat16 / float32 / float16).

One `LayerState` per decoder layer lives in `KVCache.layers`; the per-step `StepMeta` (shared by all
layers) lives in `KVCache.meta`; scout's layer-ahead hand-over between two layers of one step is a
`LayerAhead`, threaded by the decoder from one layer's `attend` to the next. Nothing else is
device state: the host side (store, workers, counters) belongs to `jhybrid.hybrid.runtime`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
from flax import struct


@struct.dataclass
class Window:
    """The GPU window of one layer: sinks + ring buffer + moving-average attention weights.

    sink_k, sink_v  [B, Hkv, S, D]  model dtype; token p < S lives in sink slot p
    k_ring, v_ring  [B, Hkv, W, D]  model dtype; non-sink token i = p - S lives in slot i % W
    maw             [B, Hkv, W]     float32 moving-average attention weight of each ring slot, summed
                                    over the KV group's query heads (what host.sparsify expects)
    The ring's bookkeeping (valid tokens, oldest slot) follows from each sequence's length and its
    offloaded block count (`jhybrid.hybrid.window.ring_meta`): no counters in the state.
    """

    sink_k: jax.Array
    sink_v: jax.Array
    k_ring: jax.Array
    v_ring: jax.Array
    maw: jax.Array


@struct.dataclass
class Digests:
    """Quest key digests of every offloaded block: kmin, kmax [B, Hkv, NB, D] model dtype
    (channel-wise min / max of the block's keys; zeros past a sequence's offloaded blocks)."""

    kmin: jax.Array
    kmax: jax.Array


@struct.dataclass
class Pool:
    """scout's recall pool: offloaded blocks recalled to the GPU, per (sequence, KV head).

    k, v    [B * R, Hkv, bs, D] model dtype; slot r of sequence b is row b * R + r; head h of a slot
            holds head h of host block blocks[b, h, r]
    blocks  [B, Hkv, R] int32 host block number in each slot (-1 = empty)
    used    [B, Hkv, R] int32 position of the last step that selected the slot (-1 = never)
    """

    k: jax.Array
    v: jax.Array
    blocks: jax.Array
    used: jax.Array


@struct.dataclass
class DeviceCopy:
    """Offloaded tokens copied to the device for the current step: k, v [B, Hkv, P, D] model dtype
    (rows of sequence b past n_valid[b] are zeros), n_valid [B] int32. recall mode uploads the whole
    offloaded KV before every decode step; a prefill chunk over an offloaded prompt gets its copies
    (`jhybrid.hybrid.prefill`). Passed through the step, dropped at the next step start."""

    k: jax.Array
    v: jax.Array
    n_valid: jax.Array


@struct.dataclass
class NothingOffloaded:
    """In place of a `DeviceCopy`: a prefill chunk whose rows have no offloaded token yet (a prompt
    still inside its GPU window). The step attends to the window alone, exactly (the offloaded part
    is empty), with no host call: the host path would copy every layer's queries to the host and
    back (~1 s a [4, 256] chunk on the H100) to attend to nothing. No arrays: a static marker (the
    step compiles once with it). Passed through the step, dropped at the next step start."""


@struct.dataclass
class LayerState:
    """Everything one layer keeps on the device. Groups a mode does not use are None.

    window          the GPU window (every mode)
    digests         this layer's block digests (scout / topk layers that select with their own query)
    next_digests    the NEXT layer's digests (scout: its layer-ahead selection runs here, one layer
                    early); each layer's digests live in exactly one of the two places
    selected        [B, Hkv, k] int32 the layer's whole top-k at the last decode step, best first
                    (-1 past a sequence's blocks): read by the recall planner and by benchmarks
    pool            scout's recall pool
    next_pool_blocks  [B, Hkv, R] int32 copy of the NEXT layer's pool table (its layer-ahead
                    selection runs here); always written together with that layer's pool
    offloaded       a `DeviceCopy` of offloaded tokens for this step (recall; prefill copies), or
                    `NothingOffloaded` (a prefill chunk of rows with none)
    """

    window: Window
    digests: Digests | None = None
    next_digests: Digests | None = None
    selected: jax.Array | None = None
    pool: Pool | None = None
    next_pool_blocks: jax.Array | None = None
    offloaded: DeviceCopy | None = None


@struct.dataclass
class StepMeta:
    """Per-step metadata built on the host before each step (`HostRuntime.before_step`).

    offloaded_blocks  [B] int32: blocks of each sequence held by the host side during this step
                      (tokens S .. S + offloaded_blocks * bs - 1); the GPU ring holds the rest.
    rows              [R] int32 (distinct), or None: a prefill step over some rows of the batch (the
                      serving engine's `HybridAttention.rows_meta`, set inside the step): its token
                      row r is batch row rows[r], and every layer attends and writes those rows only.
    decode_offloaded_blocks  [B] int32, or None: a packed step's (`PackedRows`) offloaded blocks for
                      its decode tokens: offloaded_blocks, with 0 for the chunks' rows (they do not
                      decode: the host side reads none of their blocks, which may still be in flight).
    """

    offloaded_blocks: jax.Array
    rows: jax.Array | None = None
    decode_offloaded_blocks: jax.Array | None = None


class LayerAhead(NamedTuple):
    """scout's hand-over from layer i to layer i + 1 within one decode step: the selection made for
    layer i + 1 with its predicted query, and the ticket of the CPU work submitted for it (int32)."""

    selection: "object"  # jhybrid.hybrid.selection.Selection
    ticket: jax.Array


__all__ = ["Window", "Digests", "Pool", "DeviceCopy", "NothingOffloaded", "LayerState", "StepMeta", "LayerAhead"]
