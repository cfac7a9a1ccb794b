"""`topk`: the GPU window plus a fixed budget of offloaded blocks per (sequence, KV head), chosen by
Quest's digest bound with the exact query and attended by the CPU (a quality baseline).

Device side, per layer of a decode step: select the top-k blocks from the layer's digests
(`jhybrid.hybrid.selection`) -> submit them to the CPU -> window kernel -> collect -> merge.
Digests are written at eviction by the shared core. The CPU reads the chosen blocks
(`host.targets.CHOSEN_BLOCKS`; the exchange worker's `BlockPages`).
"""

from __future__ import annotations

import jax.numpy as jnp

from host.exchange_worker import BlockPages
from host.targets import CHOSEN_BLOCKS
from jhybrid.hybrid.exchange import after
from jhybrid.hybrid.modes.base import DecodeStep, ModeHost, OffloadMode, SplitBudget
from jhybrid.hybrid.selection import budget_blocks, check_budget, gpu_parts, note_selection, select_for
from jhybrid.hybrid.state import Digests, LayerState


class TopK(OffloadMode):
    name = "topk"
    packs_decode = True
    settings = frozenset({"budget"})
    host_target = CHOSEN_BLOCKS

    def max_block_ids(self, max_len):
        return budget_blocks(self.config, max_len)

    def check(self, model_config, max_len):
        check_budget(self.config, max_len)

    def layer_state(self, layer, num_layers, batch, num_kv_heads, head_dim, max_len, dtype):
        nb = self.config.host_blocks(max_len)
        zeros = lambda: jnp.zeros((batch, num_kv_heads, nb, head_dim), dtype)  # noqa: E731
        return {"selected": jnp.full((batch, num_kv_heads, budget_blocks(self.config, max_len)), -1, jnp.int32),
                "digests": Digests(zeros(), zeros())}

    def decode(self, step: DecodeStep, state: LayerState):
        cfg = self.config
        sel = select_for(cfg, step.q, state, step.offloaded, state.digests, pool_blocks=None)
        ticket = step.exchange.submit(step.layer, CHOSEN_BLOCKS, step.q, sel.cpu_ids)
        q = after(step.q, ticket)
        parts, probs = gpu_parts(cfg, step, q, state, sel)
        parts.append(step.exchange.collect(step.layer, ticket, q.shape, parts[0][1]))
        return parts, probs, note_selection(state, sel, step.positions), None

    def host(self, context) -> "BlocksHost":
        return BlocksHost(context, self.max_block_ids(context.shape.max_len))

    def balanced(self, budget: SplitBudget) -> dict:
        """The budget: every selected token is the CPU's, so at most what it attends in the GPU's time."""
        bs = self.config.block_size
        return {"budget": min(max(bs, budget.cpu_tokens // bs * bs), max(bs, budget.offloaded // bs * bs))}

    def row_fields(self) -> dict:
        return {"budget": self.config.effective_budget}


class BlocksHost(ModeHost):
    """The host part of a mode whose CPU attends chosen blocks: the pages of the store's blocks."""

    def __init__(self, context, k: int):
        self.ctx, self.k = context, k

    def exchange_pages(self, published):
        return BlockPages.of(self.ctx.store, self.k, self.ctx.slot_tables, published)
