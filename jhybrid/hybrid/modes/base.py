"""The interface of an offloading mode: its device state, its decode attend, its host work.

A mode is one class (one module under `jhybrid/hybrid/modes/`, one line in the registry of
`jhybrid.hybrid.modes`). The shared core does everything modes have in common: the GPU window and
eviction to the host store (`jhybrid.hybrid.runtime`, `jhybrid.hybrid.window`), the exact prefill
path, prefill copies of an offloaded prompt (`jhybrid.hybrid.prefill`), transfers, the merge. A
mode adds:

  device side (traced, pure)   `layer_state`: the optional `LayerState` groups it needs;
                               `decode`: one layer's decode attention as partial states (o, lse);
                               `wants_next_query`: the decoder computes the next layer's predicted
                               query for it (scout's layer-ahead selection)
  host side (between steps)    `host(runtime)`: a `ModeHost` whose hooks the runtime calls at fixed
                               points of every step start (docs/design.md, "One decode step")
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import numpy as np

from jhybrid.hybrid.config import OffloadConfig
from jhybrid.hybrid.state import LayerAhead, LayerState


@dataclasses.dataclass(frozen=True)
class DecodeStep:
    """What a mode's `decode` gets for one layer of a decode step (T = 1).

    q [B, 1, Hq, D] (RoPE applied); positions [B, 1] int32 (-1: the row is idle); lengths [B]
    int32 tokens per sequence including this one; offloaded [B] int32 blocks owned by the host
    side (`StepMeta.offloaded_blocks`); scale: the score scale; carry: the previous layer's
    `LayerAhead` (scout) or None; next_q [B, 1, Hq, D]: the next layer's predicted query when the
    mode asked for it (`wants_next_query`), else None; exchange: the device side of the host
    exchange (`jhybrid.hybrid.exchange`).
    """

    layer: int
    num_layers: int
    q: jax.Array
    positions: jax.Array
    lengths: jax.Array
    offloaded: jax.Array
    scale: float
    carry: LayerAhead | None
    next_q: jax.Array | None
    exchange: object


Partial = tuple  # (o [B, T, Hq, D] float32, lse [B, T, Hq] float32): one producer's partial state


class OffloadMode:
    """Base class of the offloading modes (see the module docstring)."""

    name: ClassVar[str] = "abstract"
    # OffloadConfig fields this mode reads besides `config.COMMON_SETTINGS` (the GPU window and host)
    settings: ClassVar[frozenset[str]] = frozenset()
    # What every layer of a decode step submits to the host through the exchange: "context"
    # (hgca's kept tokens), "blocks" (chosen block ids) or None (no host work in decode steps).
    decode_kind: ClassVar[str | None] = None

    def __init__(self, config: OffloadConfig):
        self.config = config

    def decode_host_kind(self) -> str | None:
        """What a decode step's layers submit through the stream-ordered exchange (None: nothing)."""
        return self.decode_kind

    def max_block_ids(self, max_len: int) -> int:
        """Block ids per (sequence, KV head) a decode submit carries ("blocks" kind)."""
        return 0

    # ---- checks before anything is allocated ------------------------------------------------------
    def check(self, model_config, max_len: int) -> None:
        """ValueError when this mode cannot serve the model / context (named values)."""

    # ---- device side -------------------------------------------------------------------------------
    def layer_state(self, layer: int, num_layers: int, batch: int, num_kv_heads: int, head_dim: int,
                    max_len: int, dtype) -> dict:
        """The optional LayerState groups of this mode for one layer, e.g. {"digests": Digests(...)}."""
        return {}

    def wants_next_query(self, layer: int, num_layers: int) -> bool:
        return False

    def decode(self, step: DecodeStep, state: LayerState) -> tuple[list[Partial], jax.Array, LayerState,
                                                                      LayerAhead | None]:
        """One layer's decode attention -> (partial states of every producer, probs [B, Hkv, W]
        float32 of the window's ring slots (for the MAW), the new state, the carry for the next layer)."""
        raise NotImplementedError

    def prefill_token(self, step_layer: int, q: jax.Array, positions: jax.Array, exchange) -> jax.Array | None:
        """A prefill chunk that attends to its offloaded prompt on the device makes no host call:
        a mode that must still see the chunk's queries (hgca) hands them over here and returns a
        token the step ties into its outputs. None: nothing to hand over."""
        return None

    # ---- host side ---------------------------------------------------------------------------------
    def host(self, runtime) -> "ModeHost":
        return ModeHost()


class ModeHost:
    """A mode's host work between steps; every hook is a no-op unless the mode overrides it.
    Call order at a step start: step_start -> (eviction: blocks_stored per block batch, then
    blocks_evicted) -> every_step -> before_prefill_chunk | before_decode."""

    def step_start(self, cache):
        """First thing at a step start (the previous step may still be running)."""
        return cache

    def blocks_stored(self, layer: int, seq: int, numbers: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Blocks `numbers` [n] of (layer, seq) are in the host store now; k, v [n, bs, Hkv, W] as
        the store was given them: the model's values, or where the store rounds them
        (`HostRuntime.store_rounds`) its rows (host.store_format.from_storage gives the values)."""

    def blocks_evicted(self, layer: int, numbers_by_seq: dict[int, np.ndarray]) -> None:
        """The ring evicted these blocks of `layer` (sequence -> block numbers), all stored."""

    def every_step(self, cache):
        return cache

    def before_prefill_chunk(self, positions: np.ndarray) -> None:
        """Before a prefill / append chunk with positions [B, T] (-1 = padding)."""

    def before_decode(self, cache, offloaded_before: np.ndarray):
        """Before a decode step; offloaded_before [B] = host blocks per sequence before this step's
        eviction."""
        return cache

    def adopted(self) -> None:
        """The runtime adopted a filled store or a restored history (`HostRuntime.adopt`)."""

    def counters(self) -> dict:
        return {}

    def reset_counters(self) -> None:
        pass

    def close(self) -> None:
        pass


__all__ = ["DecodeStep", "OffloadMode", "ModeHost", "Partial"]
