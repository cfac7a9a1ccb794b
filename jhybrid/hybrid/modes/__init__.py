"""The modes: one module each, one line each in the registry below.

To add a mode: write `jhybrid/hybrid/modes/<name>.py` with a subclass of `OffloadMode`
(`modes/base.py`: everything specific to it) and add its "module:Class" line to `REGISTRY`. Nothing
else changes: the config, the backend, capacity, the balanced split, restore and the benchmarks ask
the mode.
"""

import importlib

from jhybrid.hybrid.modes.base import DecodeStep, HostLayout, ModeHost, OffloadMode, SplitBudget, Workload
from jhybrid.hybrid.registry import mode_class, mode_names, register

REGISTRY = (
    "full:Full",            # every token on the device: the reference
    "recall:Recall",        # FlexGen / HF OffloadedCache: the offloaded KV uploaded every step
    "hgca:Hgca",            # HGCA: GPU window + CPU attention over salient offloaded tokens
    "scout:Scout",          # ScoutAttention: top-k blocks, GPU pool + CPU, layer-ahead, recall
    "streaming:Streaming",  # StreamingLLM: sinks + window
    "topk:TopK",            # Quest top-k blocks on the CPU (a quality baseline)
    "quest:Quest",          # Quest top-k blocks all on the GPU (the GPU-only baseline)
)

for _entry in REGISTRY:
    _module, _name = _entry.split(":")
    register(getattr(importlib.import_module(f"jhybrid.hybrid.modes.{_module}"), _name))

__all__ = ["OffloadMode", "ModeHost", "DecodeStep", "HostLayout", "SplitBudget", "Workload", "mode_class",
           "mode_names", "REGISTRY"]
