"""HCache: save sessions, restore their KV fast from per-layer hidden states (shared/papers/hcache.txt).

  jhybrid.hcache.storage   file layout (per-layer chunk files, striping), Orbax manifests,
                           checksums, prefix index, errors
  jhybrid.hcache.saver     two-stage saving: bulk device->host snapshot, background chunk packer
  jhybrid.hcache.restorer  pipelined layer-wise restore (hidden / kv / recompute) into a KV sink
  jhybrid.hcache.planner   per-layer costs profiled on this machine -> bubble-free restore plan
  jhybrid.hcache.session   HCacheEngine / Session: generate, save, restore, prefix reuse
  jhybrid.hcache.admin     list / delete sessions, collect orphaned data (no model needed)
"""

from jhybrid.hcache.planner import (LayerCosts, RestorePlan, confirm_plan, estimate_seconds, plan_restore,
                                   profile_costs)
from jhybrid.hcache.restorer import (CollectingSink, FullCacheWriter, HostMemorySource, LayerKernels,
                                     SessionFileSource, bytes_per_token, recompute_kv, restore_kv)
from jhybrid.hcache.session import HCacheEngine, Session
from jhybrid.hcache.admin import collect_garbage, delete_session, list_sessions
from jhybrid.hcache.storage import (CorruptSession, HCacheError, ModelMismatch, SessionClosed, SessionLocked,
                                    SessionNotFound, StorageFull, StoreNotWritable)

__all__ = ["HCacheEngine", "Session", "LayerCosts", "RestorePlan", "confirm_plan", "estimate_seconds", "plan_restore",
           "profile_costs", "CollectingSink", "FullCacheWriter", "HostMemorySource", "LayerKernels",
           "SessionFileSource", "bytes_per_token", "recompute_kv", "restore_kv", "CorruptSession",
           "HCacheError", "ModelMismatch", "SessionClosed", "SessionLocked", "SessionNotFound", "StorageFull",
           "StoreNotWritable",
           "collect_garbage", "delete_session", "list_sessions"]
