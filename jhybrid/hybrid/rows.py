"""Continuous batching on the device: rows of a cache emptied for new sequences (`reset_rows`), and
the part of a layer's state a prefill step over some rows reads and writes (`part_of_rows`).

A serving engine starts a new sequence in row b of a running batch while the other rows go on
(`AttentionBackend.reset_rows`). On the device that means: the row's length is 0, and every array
of its layer states (window, digests, selections, pool, ...) holds what a freshly initialised cache
holds. Every device-state array is batch-major on its first axis: [B, ...] or [B * m, ...] with
row b's entries at b * m .. b * m + m - 1 (`state.Pool`'s [B * R] slots, quest's [B * NB] blocks);
`reset_cache_rows` relies on that.

One jitted call for the whole cache, compiled once per cache shape: the row indices are padded to
the batch (padding = B, dropped by the scatter), the cache is donated, so only the reset rows are
written (no copy of the rest), with the values of the backend's own empty state (`fresh`, traced
inside the call: constants, never allocated as a second cache). A layer state's `offloaded` (this
step's device copies, whose kind and shape change from step to step) stays outside the call: it
would make every kind of step a compile of its own (a serving engine's resets after a prefill call
compiled three more times under load, 2.6 s each at the 32-layer 8B shape).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jhybrid.hybrid.state import DeviceCopy, LayerState


def check_rows(rows, batch: int) -> np.ndarray:
    """rows ([n] ints, any sequence) as int64 NumPy, sorted and unique; ValueError naming a row
    outside [0, batch)."""
    out = np.unique(np.asarray(rows, np.int64).reshape(-1))
    bad = out[(out < 0) | (out >= batch)]
    if bad.size:
        raise ValueError(f"reset_rows: row {int(bad[0])} is out of range for a batch of {batch} (rows 0..{batch - 1})")
    return out


def reset_cache_rows(cache, rows: np.ndarray, fresh):
    """The cache (a `KVCache`, donated) with rows `rows` ([n] int, checked) emptied: lengths 0 and
    every layer-state array and the step metadata as `fresh` gives them.

    fresh: a hashable callable, fresh(cache) -> (layers, meta) of an empty cache of the same shapes
    (called inside the jit, on the traced cache). A `LayerState`'s `offloaded` (device copies of
    offloaded tokens, transient: the next step start drops them) passes through unchanged."""
    batch = int(cache.lengths.shape[0])
    padded = np.full(batch, batch, np.int32)
    padded[:rows.size] = rows
    offloaded = [state.offloaded if isinstance(state, LayerState) else None for state in cache.layers]
    reset = _reset(fresh, cache.replace(layers=tuple(_without_copies(s) for s in cache.layers)), jnp.asarray(padded))
    layers = tuple(state.replace(offloaded=copies) if isinstance(state, LayerState) else state
                   for state, copies in zip(reset.layers, offloaded))
    return reset.replace(layers=layers)


def _reset_array(x: jax.Array, empty: jax.Array, rows: jax.Array, batch: int) -> jax.Array:
    """x with the entries of rows (int32 [B], padding = B) set to empty's."""
    if x.shape[0] % batch:
        raise ValueError(f"reset_rows: a cache array of shape {x.shape} is not batch-major (batch {batch})")
    m = x.shape[0] // batch
    index = (rows[:, None] * m + jnp.arange(m, dtype=jnp.int32)[None, :]).reshape(-1)  # padding: >= B * m
    values = empty[jnp.minimum(index, x.shape[0] - 1)].astype(x.dtype)
    return x.at[index].set(values, mode="drop")


def _without_copies(state):
    return state.replace(offloaded=None) if isinstance(state, LayerState) else state


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(1,))
def _reset(fresh, cache, rows):
    batch = cache.lengths.shape[0]
    empty_layers, empty_meta = fresh(cache)
    reset = functools.partial(_reset_array, rows=rows, batch=batch)
    layers = []
    for state, empty in zip(cache.layers, empty_layers):
        layers.append(jax.tree_util.tree_map(reset, state, _without_copies(empty)))
    meta = None if cache.meta is None else jax.tree_util.tree_map(reset, cache.meta, empty_meta)
    lengths = cache.lengths.at[rows].set(0, mode="drop")
    return cache.replace(layers=tuple(layers), lengths=lengths, meta=meta)


# ---- a prefill step over some rows ------------------------------------------------------------------
# The serving engine prefills only the rows that are prefilling (`StepMeta.rows`): each layer takes
# those rows' part of its state, attends and writes it as a step over R rows would, and puts it back.
# A prefill chunk reads only a LayerState's window and offloaded copies and writes only its window
# (digests, selections and pools change at decode steps and step starts), so the part holds those
# alone: a prefill path that read another group would fail on its None. One layer's part at a time
# lives on the device (R rows' window and copies), never a second cache.

def part_of_rows(state, rows: jax.Array):
    """(traced) The rows' part of one layer's state, rows [R] int32: a LayerState's window and
    offloaded copies ([R, ...]; the other groups None), a SlidingWindow's arrays ([R, ...])."""
    take = functools.partial(_take_rows, rows=rows)
    if not isinstance(state, LayerState):
        return jax.tree_util.tree_map(take, state)
    copies = state.offloaded
    if isinstance(copies, DeviceCopy):
        copies = jax.tree_util.tree_map(take, copies)
    return LayerState(window=jax.tree_util.tree_map(take, state.window), offloaded=copies)


def with_part_of_rows(state, part, rows: jax.Array):
    """(traced) state with the rows' part written back: a LayerState's window (its other groups,
    offloaded copies included, are state's), a SlidingWindow whole."""
    if not isinstance(state, LayerState):
        return jax.tree_util.tree_map(lambda x, p: x.at[rows].set(p), state, part)
    return state.replace(window=jax.tree_util.tree_map(lambda x, p: x.at[rows].set(p), state.window, part.window))


def _take_rows(x: jax.Array, rows: jax.Array) -> jax.Array:
    return x[rows]


__all__ = ["check_rows", "reset_cache_rows", "part_of_rows", "with_part_of_rows"]
