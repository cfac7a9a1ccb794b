"""The attention backend interface: the one place that knows where KV lives.

Every attention layer of every model calls `backend.attend(...)` with its already projected and
rotated q and the new k, v of this step; the backend stores k, v in its own per-layer cache state
(an explicit pytree passed in and returned, so the whole step stays a pure, jittable function) and
returns the attention output. `full` (all KV on the device) is `jhybrid.attention.full`; offloading
and hybrid backends (recall, hgca, scout, streaming, top-k) implement the same two methods.

Position convention (all backends): `positions [B, T]` int32 holds each token's absolute position
in its sequence; a padding slot has position -1 and must be neither stored nor attended. Valid
positions of one sequence are contiguous and start at that sequence's current length, so a ragged
batch is right-padded within each step (prompt tokens first, -1 slots after).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

import jax

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the models import the attention package, not the other way round
    from jhybrid.models.config import ModelConfig

LayerCache = Any  # a backend-defined pytree of arrays with static shapes


@dataclasses.dataclass(frozen=True)
class LayerContext:
    """What a backend may want besides q/k/v (most backends ignore it).

    layer_input: [B, T, d_model] the layer's input hidden state (before its norm) — ScoutAttention
        applies the NEXT layer's W_q to it to predict that layer's query one layer ahead.
    next_layer: the next `DecoderLayer` module (None for the last layer); its
        `attention.project_q(normed, positions)` gives that prediction.
    scale: the score scale (1/sqrt(head_dim) for every supported family).
    sliding_window: attend only to keys with q_pos - key_pos < sliding_window (None: no window).
    """

    layer_input: jax.Array
    next_layer: Any
    scale: float
    sliding_window: int | None = None


class AttentionBackend(abc.ABC):
    """Interface every attention mode implements. Instances must be hashable (they are jit statics)."""

    name: str = "abstract"
    # True for offloading modes that can hold more context than the device cache: generation then
    # lets prompts exceed `max_len` instead of raising.
    handles_long_context: bool = False

    @abc.abstractmethod
    def init_layer_cache(self, config: ModelConfig, layer_idx: int, batch_size: int, max_len: int,
                         dtype) -> LayerCache:
        """An empty cache state for one layer."""

    @abc.abstractmethod
    def attend(
        self,
        layer_idx: int,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        positions: jax.Array,
        lengths: jax.Array,
        layer_cache: LayerCache,
        context: LayerContext,
    ) -> tuple[jax.Array, LayerCache]:
        """Stores this step's k, v and attends q causally over everything the sequence holds.

        q: [B, T, Hq, D]; k, v: [B, T, Hkv, D] (RoPE already applied to q and k).
        positions: [B, T] int32, -1 for padding. lengths: [B] int32, each sequence's number of
        tokens INCLUDING this step's (so the keys are positions 0 .. lengths-1).
        Returns o [B, T, Hq, D] in q's dtype (padding rows are zero) and the new layer cache.
        """
