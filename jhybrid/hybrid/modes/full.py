"""`full`: every token's KV on the device (`jhybrid.attention.full.FullAttention`), the reference
every other mode is measured against. Nothing is offloaded: no window, no host store."""

from __future__ import annotations

from jhybrid.attention.full import FullAttention
from jhybrid.hybrid.modes.base import OffloadMode


class Full(OffloadMode):
    name = "full"
    offloads = False
    reference = True

    def own_backend(self):
        return FullAttention()

    def step_scratch_bytes(self, model_config, max_len):
        """The jnp attention's float32 score rows of one layer: Hq x max_len, four times (scores,
        probabilities and their reductions)."""
        return 4 * model_config.num_heads * max_len * 4
