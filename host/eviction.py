"""Which full blocks leave the GPU ring, oldest first (HGCA Algorithm 1, lines 5-14).

Per layer and sequence the GPU holds `sink` protected tokens (positions 0..sink-1, never evicted)
plus a ring of `blk_num` blocks of `block_size` tokens. Non-sink token p (p >= sink) belongs to ring
block `(p - sink) // block_size`, which sits in ring slot `block % blk_num`. Before `n_new` tokens
are written, the oldest blocks are evicted so that the ring holds at most `blk_num * block_size`
non-sink tokens afterwards; only full blocks leave. (Algorithm 1 adds first and evicts down to
`l_max - 1`; evicting first to make room for exactly `n_new` is the same policy for a ring that is
written token by token.) A prompt longer than the window evicts some of its own new blocks: they
go straight to the host (`from_incoming`).

Everything here is integer bookkeeping on the caller's thread; the bridge copies the listed blocks
to the host and calls `KVStore.append_blocks`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RingConfig:
    """GPU window of `window_tokens` = sink + blk_num * block_size tokens."""

    window_tokens: int
    block_size: int
    sink: int = 0

    def __post_init__(self):
        for name in ("window_tokens", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value <= 0:
                raise ValueError(f"{name}={value!r}; expected a positive int")
        if not isinstance(self.sink, (int, np.integer)) or self.sink < 0:
            raise ValueError(f"sink={self.sink!r}; expected an int >= 0")
        ring = self.window_tokens - self.sink
        if ring < self.block_size:
            raise ValueError(f"sink={self.sink} does not fit: window_tokens={self.window_tokens} leaves {ring} "
                             f"ring tokens, expected at least one block of block_size={self.block_size}")
        if ring % self.block_size:
            raise ValueError(f"block_size={self.block_size} does not divide the ring of window_tokens - sink = "
                             f"{ring} tokens; expected a multiple of block_size")

    @property
    def blk_num(self) -> int:
        return (self.window_tokens - self.sink) // self.block_size

    @property
    def ring_tokens(self) -> int:
        return self.blk_num * self.block_size


@dataclass(frozen=True)
class EvictionPlan:
    """Blocks to move to the host before writing the new tokens (all int64 arrays, length n)."""

    blocks: np.ndarray         # ring block numbers (= host block numbers), oldest first
    ring_slots: np.ndarray     # slot of each block in the GPU ring (meaningless if from_incoming)
    first_position: np.ndarray # absolute position of each block's first token
    from_incoming: np.ndarray  # bool: the block is made of the new tokens themselves (long prompts)

    @property
    def n_blocks(self) -> int:
        return int(self.blocks.shape[0])


@dataclass
class RingState:
    """Per (layer, sequence): tokens written so far and blocks already evicted."""

    n_tokens: int = 0
    n_evicted_blocks: int = 0


def resident_ring_tokens(cfg: RingConfig, state: RingState) -> int:
    """Non-sink tokens currently on the GPU."""
    return max(0, state.n_tokens - cfg.sink) - state.n_evicted_blocks * cfg.block_size


def plan_eviction(cfg: RingConfig, state: RingState, n_new: int) -> EvictionPlan:
    """Blocks that must leave before `n_new` tokens are written. Does not modify `state`:
    call `commit(cfg, state, plan, n_new)` once the blocks are safely on the host."""
    if not isinstance(n_new, (int, np.integer)) or n_new < 0:
        raise ValueError(f"n_new={n_new!r}; expected an int >= 0")
    non_sink_after = max(0, state.n_tokens + n_new - cfg.sink)
    evicted_after = max(state.n_evicted_blocks, -(-(non_sink_after - cfg.ring_tokens) // cfg.block_size))
    blocks = np.arange(state.n_evicted_blocks, evicted_after, dtype=np.int64)
    non_sink_before = max(0, state.n_tokens - cfg.sink)
    first_token = blocks * cfg.block_size  # among non-sink tokens
    return EvictionPlan(
        blocks=blocks,
        ring_slots=blocks % cfg.blk_num,
        first_position=first_token + cfg.sink,
        from_incoming=first_token + cfg.block_size > non_sink_before,
    )


def commit(cfg: RingConfig, state: RingState, plan: EvictionPlan, n_new: int) -> None:
    """Record that `plan` was carried out and `n_new` tokens were written."""
    if plan.n_blocks and plan.blocks[0] != state.n_evicted_blocks:
        raise ValueError(f"plan starts at block {int(plan.blocks[0])}; the ring state expects block "
                         f"{state.n_evicted_blocks} next (plans must be committed in order)")
    after = RingState(state.n_tokens + n_new, state.n_evicted_blocks + plan.n_blocks)
    if resident_ring_tokens(cfg, after) > cfg.ring_tokens:
        raise ValueError(f"committing {plan.n_blocks} evicted blocks and n_new={n_new} tokens would hold "
                         f"{resident_ring_tokens(cfg, after)} ring tokens, over {cfg.ring_tokens}: "
                         "pass the same n_new as to plan_eviction")
    state.n_tokens, state.n_evicted_blocks = after.n_tokens, after.n_evicted_blocks
