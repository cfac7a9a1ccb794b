"""What one host attention call attends: a typed target instead of a kind string.

The three targets of the CPU side (docs/design.md, "Modes"):

  KEPT_TOKENS      hgca: each (sequence, KV head)'s kept tokens in the sparse context cache, clipped to
                   the blocks the host side owns at this step (`published_tokens`)
  ALL_OFFLOADED    every stored token of each sequence (a prefill chunk over an offloaded prompt on
                   the host path; keep-all exactness)
  CHOSEN_BLOCKS    chosen block numbers per (sequence, KV head) (scout's and topk's CPU part)

A mode names its decode target (`OffloadMode.host_target`); the device side of the exchange passes
the object through, and the host end runs `target.attend(...)`: no string dispatch anywhere.

    o, lse = CHOSEN_BLOCKS.attend(store, layer, seq_ids, queries, scale, block_ids=ids)
"""

from __future__ import annotations

import numpy as np

from host.attention import attend_all, attend_blocks, paged_attention
from host.exchange_worker import clip_to_published


class HostTarget:
    """A set of offloaded tokens a host attention call reads (see the module docstring)."""

    name = "abstract"
    needs_block_ids = False  # the call carries block ids [B, Hkv, k] (CHOSEN_BLOCKS)

    def attend(self, store, layer: int, seq_ids, queries: np.ndarray, scale: float | None,
               block_ids: np.ndarray | None = None, published_tokens: np.ndarray | None = None):
        """queries [B, Tq, Hq, D] float32 -> (o [B, Tq, Hq, D], lse [B, Tq, Hq]) float32.
        published_tokens int64 [B] (KEPT_TOKENS): attend only tokens of the published blocks."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"HostTarget({self.name})"


class _KeptTokens(HostTarget):
    name = "kept tokens"

    def attend(self, store, layer, seq_ids, queries, scale, block_ids=None, published_tokens=None):
        seq_ids = list(seq_ids)
        with store.lock:
            view = store.context.snapshot_locked(layer, seq_ids)
            if published_tokens is not None:
                view = clip_to_published(view, store.context.layers[layer].arrays["token_index"],
                                         np.asarray(published_tokens, np.int64))
            store.begin_read()
        try:
            return paged_attention(queries, view, scale)
        finally:
            store.end_read()


class _AllOffloaded(HostTarget):
    name = "all offloaded"

    def attend(self, store, layer, seq_ids, queries, scale, block_ids=None, published_tokens=None):
        return attend_all(store, layer, seq_ids, queries, scale)


class _ChosenBlocks(HostTarget):
    name = "chosen blocks"
    needs_block_ids = True

    def attend(self, store, layer, seq_ids, queries, scale, block_ids=None, published_tokens=None):
        if block_ids is None:
            raise ValueError("chosen-blocks attention needs block_ids [B, Hkv, k]")
        return attend_blocks(store, layer, seq_ids, queries, block_ids, scale)


KEPT_TOKENS: HostTarget = _KeptTokens()
ALL_OFFLOADED: HostTarget = _AllOffloaded()
CHOSEN_BLOCKS: HostTarget = _ChosenBlocks()

__all__ = ["HostTarget", "KEPT_TOKENS", "ALL_OFFLOADED", "CHOSEN_BLOCKS"]
