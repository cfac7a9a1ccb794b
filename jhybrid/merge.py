"""Exact merge of partial attention states (docs/design.md, "Partial states").

A partial state over a token set S is ``(o, lse)``:
  o    [..., D]  attention output normalised within S (any float dtype)
  lse  [...]     float32, natural-log ``log(sum_{j in S} exp(s_j))`` of the already-scaled scores
An empty S is ``o = 0, lse = -inf``. Merging states of disjoint token sets gives the state of their
union; merging only empty states gives an empty state, never NaN.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax.numpy as jnp


class PartialState(NamedTuple):
    """Attention over one token set. ``o``: [..., D] any float dtype; ``lse``: [...] float32."""

    o: jnp.ndarray
    lse: jnp.ndarray


def merge_partials(
    outputs: Sequence[jnp.ndarray], lses: Sequence[jnp.ndarray], out_dtype=None
) -> PartialState:
    """Merge N partial states.

    Args:
      outputs: N arrays of identical shape ``[..., D]``.
      lses: N arrays of shape ``[...]`` (any float dtype; computed in float32).
      out_dtype: dtype of the merged ``o`` (default: dtype of ``outputs[0]``).

    Returns:
      ``PartialState(o [..., D] out_dtype, lse [...] float32)``.
    """
    if len(outputs) != len(lses) or not outputs:
        raise ValueError(
            f"merge_partials needs the same positive number of outputs and lses, got "
            f"{len(outputs)} outputs and {len(lses)} lses"
        )
    shape = outputs[0].shape
    for i, (o, lse) in enumerate(zip(outputs, lses)):
        if o.shape != shape:
            raise ValueError(f"outputs[{i}].shape={o.shape} differs from outputs[0].shape={shape}")
        if lse.shape != shape[:-1]:
            raise ValueError(f"lses[{i}].shape={lse.shape}, expected {shape[:-1]} (outputs' shape minus D)")
    out_dtype = out_dtype or outputs[0].dtype
    lse_stack = jnp.stack([jnp.asarray(l, jnp.float32) for l in lses])  # [N, ...]
    m = jnp.max(lse_stack, axis=0)
    # All-empty rows have m = -inf; use 0 there so exp(-inf - 0) = 0 instead of exp(nan).
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse_stack - m_safe)  # [N, ...], 0 for empty partitions
    w_sum = jnp.sum(w, axis=0)
    o_acc = sum(w[i][..., None] * jnp.asarray(o, jnp.float32) for i, o in enumerate(outputs))
    o = jnp.where(w_sum[..., None] > 0, o_acc / jnp.where(w_sum > 0, w_sum, 1.0)[..., None], 0.0)
    lse = jnp.where(w_sum > 0, m_safe + jnp.log(jnp.where(w_sum > 0, w_sum, 1.0)), -jnp.inf)
    return PartialState(o.astype(out_dtype), lse.astype(jnp.float32))


def merge_two(a: PartialState, b: PartialState, out_dtype=None) -> PartialState:
    """Merge two partial states (see ``merge_partials``)."""
    return merge_partials([a.o, b.o], [a.lse, b.lse], out_dtype=out_dtype)
