"""The offloading modes: one module each, one line each in the registry below.

To add a mode: write `jhybrid/hybrid/modes/<name>.py` with a subclass of `OffloadMode`
(`modes/base.py`: its LayerState groups, its decode attend, its host work) and register it here.
"""

from jhybrid.hybrid.modes.base import DecodeStep, ModeHost, OffloadMode
from jhybrid.hybrid.modes.hgca import Hgca
from jhybrid.hybrid.modes.recall import Recall
from jhybrid.hybrid.modes.scout import Scout
from jhybrid.hybrid.modes.streaming import Streaming
from jhybrid.hybrid.modes.topk import TopK

MODES: dict[str, type[OffloadMode]] = {
    "recall": Recall,
    "hgca": Hgca,
    "scout": Scout,
    "streaming": Streaming,
    "topk": TopK,
}

__all__ = ["MODES", "OffloadMode", "ModeHost", "DecodeStep"]
