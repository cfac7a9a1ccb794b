"""`streaming`: attention sinks + the GPU window only (StreamingLLM). Offloaded tokens are kept in
the host store (a later re-evaluation or another mode could bring them back) but never attended."""

from __future__ import annotations

from jhybrid.hybrid.modes.base import DecodeStep, OffloadMode
from jhybrid.hybrid.state import LayerState
from jhybrid.hybrid.window import decode_attention


class Streaming(OffloadMode):
    name = "streaming"
    packs_decode = True

    def decode(self, step: DecodeStep, state: LayerState):
        o, lse, probs = decode_attention(self.config, step.q, state.window, step.lengths, step.offloaded,
                                         step.scale)
        return [(o, lse)], probs, state, None
