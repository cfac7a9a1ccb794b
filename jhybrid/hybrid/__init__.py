"""Hybrid GPU-CPU attention: the modes over one shared core (docs/design.md).

  config     OffloadConfig: the one config (mode, GPU window, host policy), validated
  registry   mode name -> mode class (the modes register themselves in modes/__init__.py)
  modes/     one module per mode (full, recall, hgca, scout, streaming, topk, ...) + the registry lines
  backend    HybridAttention (the AttentionBackend of every offloading mode) and make_backend
  state      the typed device state: Window, Digests, Pool, DeviceCopy, LayerState, StepMeta
  runtime    HostRuntime: the host side of an open batch (store, workers, eviction, counters) and
             the ModeHostContext a mode's host part sees
  window     the GPU window: ring arithmetic, token writes, window attention, MAW
  exchange   the device side of the host exchange (queries out, partial states back)
  selection  Quest top-k blocks from digests, split between the GPU pool and the CPU
  prefill    prefill over an offloaded prompt on the device (copies, extended chunk by chunk)
  transfer   device <-> pinned host copies, log_once
  ingest     placing a restored history (HCache) into an open batch
  capacity   device / host bytes per sequence of a mode, from the layouts the code allocates
  split      the balanced GPU / CPU split

    backend = make_backend("hgca", window_tokens=2048)       # or make_backend(OffloadConfig(...))
    Generator(model, backend).generate(prompts)              # same model code in every mode
"""

from jhybrid.hybrid import modes  # noqa: F401 - registers every mode
from jhybrid.hybrid.backend import HybridAttention, make_backend
from jhybrid.hybrid.config import PREFILL_OFFLOADED, OffloadConfig
from jhybrid.hybrid.registry import mode_names

__all__ = ["OffloadConfig", "HybridAttention", "make_backend", "mode_names", "PREFILL_OFFLOADED"]
