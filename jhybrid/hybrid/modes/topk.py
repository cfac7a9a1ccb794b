"""`topk`: the GPU window plus a fixed budget of offloaded blocks per (sequence, KV head), chosen by
Quest's digest bound with the exact query and attended by the CPU (a quality baseline; `scout`
builds on it).

Device side, per layer of a decode step: select the top-k blocks from the layer's digests
(`jhybrid.hybrid.selection`) -> submit them to the CPU -> window kernel (+ the recall pool's
block-sparse kernel, scout) -> collect -> merge. Digests are written at eviction by the shared core.
"""

from __future__ import annotations

import jax.numpy as jnp

from jhybrid.hybrid.exchange import after
from jhybrid.hybrid.modes.base import DecodeStep, OffloadMode
from jhybrid.hybrid.selection import Selection, select
from jhybrid.hybrid.state import Digests, LayerState
from jhybrid.hybrid.window import decode_attention
from pallas_kernels.block_sparse_attention import block_sparse_attention


class TopK(OffloadMode):
    name = "topk"
    settings = frozenset({"budget"})
    decode_kind = "blocks"

    def max_block_ids(self, max_len):
        return self.budget_blocks(max_len)

    def check(self, model_config, max_len):
        k = self.config.topk_blocks
        if k is not None and k * self.config.block_size > max_len:
            raise ValueError(f"top-k budget of {k} blocks x {self.config.block_size} tokens is larger than the "
                             f"context of {max_len} tokens")

    def budget_blocks(self, max_len: int) -> int:
        nb = self.config.host_blocks(max_len)
        return min(self.config.topk_blocks or nb, nb)

    def selects_exactly(self, layer: int) -> bool:
        """Does `layer` select with its own exact query (False: scout's layer-ahead prediction)?"""
        return True

    def layer_state(self, layer, num_layers, batch, num_kv_heads, head_dim, max_len, dtype):
        nb = self.config.host_blocks(max_len)
        zeros = lambda: jnp.zeros((batch, num_kv_heads, nb, head_dim), dtype)  # noqa: E731
        out = {"selected": jnp.full((batch, num_kv_heads, self.budget_blocks(max_len)), -1, jnp.int32)}
        if self.selects_exactly(layer):
            out["digests"] = Digests(zeros(), zeros())
        return out

    def decode(self, step: DecodeStep, state: LayerState):
        sel = self._select(step.q, state, step.offloaded, state.digests, pool_blocks=None)
        ticket = step.exchange.submit(step.layer, "blocks", step.q, sel.cpu_ids)
        q = after(step.q, ticket)
        parts, probs = self._gpu_parts(step, q, state, sel)
        parts.append(step.exchange.collect(step.layer, ticket, q.shape, parts[0][1]))
        return parts, probs, self._note(state, sel, step.positions), None

    # ---- shared with scout ------------------------------------------------------------------------
    def _select(self, q, state: LayerState, offloaded, digests: Digests, pool_blocks) -> Selection:
        k = state.selected.shape[2]
        return select(q[:, 0], digests.kmin, digests.kmax, offloaded, k, pool_blocks, self.config.kernel_backend)

    def _gpu_parts(self, step: DecodeStep, q, state: LayerState, sel: Selection):
        """The window (+ the pool's selected blocks) on the GPU -> ([(o, lse), ...], ring probs)."""
        o_w, lse_w, probs = decode_attention(self.config, q, state.window, step.lengths, step.offloaded,
                                             step.scale)
        parts = [(o_w, lse_w)]
        if state.pool is not None:
            parts.append(block_sparse_attention(q, state.pool.k, state.pool.v, sel.gpu_ids, sel.gpu_counts,
                                                scale=step.scale, backend=self.config.kernel_backend))
        return parts, probs

    @staticmethod
    def _note(state: LayerState, sel: Selection, positions) -> LayerState:
        """Record the selection: `selected` (the whole top-k) and, with a pool, each selected slot's
        last use (the recall planner evicts the least recently used slots)."""
        state = state.replace(selected=sel.ids.astype(jnp.int32))
        if state.pool is not None and sel.pool_hit is not None:
            pos = positions[:, 0].astype(jnp.int32)[:, None, None]
            used = jnp.where(sel.pool_hit & (pos >= 0), pos, state.pool.used)
            state = state.replace(pool=state.pool.replace(used=used))
        return state
