"""Hybrid GPU-CPU attention: the offloading modes over one shared core (docs/design.md).

  config     OffloadConfig: the one config (mode, GPU window, host policy), validated
  backend    HybridAttention (the AttentionBackend of every offloading mode) and make_backend
  state      the typed device state: Window, Digests, Pool, DeviceCopy, LayerState, StepMeta
  modes/     one module per mode (recall, hgca, scout, streaming, topk) + the registry
  runtime    HostRuntime: the host side of an open batch (store, workers, eviction, counters)
  window     the GPU window: ring arithmetic, token writes, window attention, MAW
  exchange   the device side of the host exchange (queries out, partial states back)
  selection  Quest top-k blocks from digests, split between the GPU pool and the CPU
  prefill    prefill over an offloaded prompt on the device (copies, extended chunk by chunk)
  transfer   device <-> pinned host copies, log_once
  ingest     placing a restored history (HCache) into an open batch

    backend = make_backend("hgca", window_tokens=2048)       # or make_backend(OffloadConfig(...))
    Generator(model, backend).generate(prompts)              # same model code in every mode
"""

from jhybrid.hybrid.backend import HybridAttention, make_backend
from jhybrid.hybrid.config import EXCHANGES, PREFILL_OFFLOADED, OffloadConfig, mode_names

__all__ = ["OffloadConfig", "HybridAttention", "make_backend", "mode_names", "EXCHANGES", "PREFILL_OFFLOADED"]
