"""Serving: a continuous-batching engine over one model, and an OpenAI-compatible HTTP server.

  jhybrid.serving.api           what callers use: Request, RequestOutput, RequestHandle, Engine, EngineStats
  jhybrid.serving.engine        ServingEngine: slots, the admission queue, the step loop, its thread
  jhybrid.serving.sampling      per-row sampling (each request its own parameters in one batch)
  jhybrid.serving.prefix_cache  the prefix cache: block-hash matching, device / host / disk LRU tiers
  jhybrid.serving.kv_blocks     the prefix cache's device pool and its copies to and from cache rows
  jhybrid.serving.disk_tier     the prefix cache's disk tier: blocks in HCache's checksummed layer files
  jhybrid.serving.warmup        warm-up requests that run every step shape once before real requests
  jhybrid.serving.server        the HTTP server (`jhybrid serve`)

    from jhybrid.serving import ServingEngine, Request
    engine = ServingEngine(model, slots=4, max_len=4096, prefill_chunk=256)
    engine.start()
    out = engine.submit(Request(prompt=ids, max_tokens=32)).result()
    engine.close()
"""

from jhybrid.serving.api import (AdmissionError, Engine, EngineClosed, EngineStats, FinishReason, Request,
                                 RequestHandle, RequestOutput)

_LAZY = {  # the engine imports JAX and the models: loaded on first use
    "ServingEngine": "jhybrid.serving.engine",
    "StepRecord": "jhybrid.serving.engine",
    "StepTimes": "jhybrid.serving.engine",
    "PrefixCacheConfig": "jhybrid.serving.prefix_cache",
    "PrefixCacheSpillError": "jhybrid.serving.prefix_cache",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jhybrid.serving' has no attribute {name!r}")


__all__ = ["AdmissionError", "Engine", "EngineClosed", "EngineStats", "FinishReason", "Request", "RequestHandle",
           "RequestOutput", *_LAZY]
