"""The interface of a mode: everything specific to it, declared here and implemented in its file.

A mode is one class (one module under `jhybrid/hybrid/modes/`, one line in the registry of
`jhybrid.hybrid.modes`). The shared core does everything the offloading modes have in common: the
GPU window and eviction to the host store (`jhybrid.hybrid.runtime`, `jhybrid.hybrid.window`), the
exact prefill path, prefill copies of an offloaded prompt (`jhybrid.hybrid.prefill`), the merge.
Nothing outside `jhybrid/hybrid/modes/` tests a mode's name: callers ask the mode.

  what it is            `name`, `settings` (the OffloadConfig fields it reads), `offloads` (False:
                        every token stays on the device, e.g. `full`), `own_backend()` (a backend
                        of its own instead of the shared `HybridAttention`),
                        `default_window_tokens`, `config_problems`, `check`
  device side (traced)  `layer_state` (its optional LayerState groups), `decode` (one layer's decode
                        attention as partial states), `wants_next_query`, `prefill_token`
  host side             `host_target` (what its decode steps attend on the CPU, host.targets), and
                        `host(context)`: a `ModeHost` whose hooks the runtime calls at fixed points
                        of every step start (docs/design.md, "One decode step"), and whose
                        `reset_rows` drops a row's per-sequence state (continuous batching)
  around the core       `host_bytes_per_sequence` (capacity), `balanced` (its part of the balanced
                        split), `restore_queries` / `restored_window` (HCache restore),
                        `for_model` (per-model calibration), `row_fields` (benchmark row columns)

Device bytes are never computed by hand: `jhybrid.hybrid.capacity` takes them from the shapes the
backend allocates (`jax.eval_shape` of its `init_layer_cache`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, ClassVar

import jax
import numpy as np

from jhybrid.hybrid.state import LayerAhead, LayerState

if TYPE_CHECKING:
    from host.targets import HostTarget
    from jhybrid.hybrid.config import OffloadConfig
    from jhybrid.hybrid.runtime import ModeHostContext


@dataclasses.dataclass(frozen=True)
class DecodeStep:
    """What a mode's `decode` gets for one layer of a decode step (T = 1).

    q [B, 1, Hq, D] (RoPE applied); positions [B, 1] int32 (-1: the row is idle); lengths [B]
    int32 tokens per sequence including this one; offloaded [B] int32 blocks owned by the host
    side (`StepMeta.offloaded_blocks`); scale: the score scale; carry: the previous layer's
    `LayerAhead` (scout) or None; next_q [B, 1, Hq, D]: the next layer's predicted query when the
    mode asked for it (`wants_next_query`), else None; exchange: the device side of the host
    exchange (`jhybrid.hybrid.exchange`).
    """

    layer: int
    num_layers: int
    q: jax.Array
    positions: jax.Array
    lengths: jax.Array
    offloaded: jax.Array
    scale: float
    carry: LayerAhead | None
    next_q: jax.Array | None
    exchange: object


Partial = tuple  # (o [B, T, Hq, D] float32, lse [B, T, Hq] float32): one producer's partial state


@dataclasses.dataclass(frozen=True)
class Workload:
    """Attention statistics of the contexts served, measured on real text (jhybrid.bench.selection_stats)
    or assumed by a benchmark: what sizes a mode's host state and CPU work.

    kept_share      hgca: share of the offloaded tokens its salience threshold keeps for the CPU
    resident_share  scout: share of a step's selected blocks already resident in the GPU pool
    """

    kept_share: float = 0.1
    resident_share: float = 0.73


@dataclasses.dataclass(frozen=True)
class HostLayout:
    """The host store's layout for one model (from host.kv_store / host.context_cache, never by hand):
    n_layers offloaded layers; block_bytes: one stored block of one layer (K, V of every KV head,
    MAW, positions); n_kv_heads, head_dim and the model dtype; page_tokens / page_bytes: one
    context-cache page of one (layer, KV head) (hgca's kept tokens)."""

    n_layers: int
    block_bytes: int
    n_kv_heads: int
    head_dim: int
    dtype: str
    page_tokens: int
    page_bytes: int


@dataclasses.dataclass(frozen=True)
class SplitBudget:
    """What the balanced split (jhybrid.hybrid.split) gives a mode to size its CPU work with, per
    layer and decode step: `cpu_tokens` tokens per (sequence, KV head) the host can attend in the
    GPU's time, `offloaded` tokens per sequence on the host, and the expected `workload`."""

    cpu_tokens: int
    offloaded: int
    workload: Workload


class OffloadMode:
    """Base class of the modes (see the module docstring)."""

    name: ClassVar[str] = "abstract"
    # OffloadConfig fields this mode reads besides `config.COMMON_SETTINGS` (the GPU window and host)
    settings: ClassVar[frozenset[str]] = frozenset()
    # False: every token's KV stays on the device (no window, no host store)
    offloads: ClassVar[bool] = True
    # The mode every other is measured against (`full`; plots draw it as the reference)
    reference: ClassVar[bool] = False
    # budget "auto": this many tokens (None: every block). An "auto" budget larger than a context is
    # clamped to it; a budget given larger than the context is an error.
    default_budget: ClassVar[int | None] = None
    # The GPU window when the config gives neither window_tokens nor gpu_ratio.
    default_window_tokens: ClassVar[int] = 1024
    # The balanced split gives the window all the device memory the batch leaves (a dense window that
    # grows with the context: hgca's regime). False: the window stays the config's (scout's short
    # recent window; its important blocks live in a pool sized from the budget).
    grows_window: ClassVar[bool] = True
    # What every layer of a decode step attends on the CPU through the exchange (host.targets), or
    # None: decode steps make no host call.
    host_target: ClassVar["HostTarget | None"] = None
    # Its decisions read the window's moving-average attention weights (hgca's salience): attention
    # history, which a history placed without running attention (a prefix-cache hit) does not carry,
    # so such a placement must leave every placed ring token to be evicted and re-scored by the
    # prefill that follows (`jhybrid.hybrid.ingest.reusable_prefix`).
    reads_maw: ClassVar[bool] = False
    # A serving step may pack prefill chunks and decode tokens into one call (`PackedRows`): the
    # mode's prefill chunks hand nothing to the host (`prefill_token` None) and its decode steps
    # read no `LayerState.offloaded` (the chunks' prefill copies ride in that field).
    packs_decode: ClassVar[bool] = False

    def __init__(self, config: "OffloadConfig"):
        self.config = config

    # ---- checks before anything is allocated ------------------------------------------------------
    @classmethod
    def config_problems(cls, config: "OffloadConfig") -> list[tuple[str, object, str]]:
        """(field, value, what was expected) for settings this mode cannot take (OffloadConfig raises
        them with its own field checks)."""
        return []

    @classmethod
    def defaults(cls, config: "OffloadConfig") -> dict:
        """OffloadConfig changes that fill in the fields this mode leaves to itself (e.g. scout's pool
        size), applied by `OffloadConfig.with_defaults` / `resolved`; {} when there are none."""
        return {}

    def check(self, model_config, max_len: int) -> None:
        """ValueError when this mode cannot serve the model / context (named values)."""

    def own_backend(self):
        """The AttentionBackend of a mode that does not run on the shared HybridAttention core
        (`full`, GPU-only modes); None: HybridAttention."""
        return None

    def max_block_ids(self, max_len: int) -> int:
        """Block ids per (sequence, KV head) a decode submit carries (chosen-blocks target)."""
        return 0

    # ---- device side -------------------------------------------------------------------------------
    def layer_state(self, layer: int, num_layers: int, batch: int, num_kv_heads: int, head_dim: int,
                    max_len: int, dtype) -> dict:
        """The optional LayerState groups of this mode for one layer, e.g. {"digests": Digests(...)}."""
        return {}

    def wants_next_query(self, layer: int, num_layers: int) -> bool:
        return False

    def decode(self, step: DecodeStep, state: LayerState) -> tuple[list[Partial], jax.Array, LayerState,
                                                                      LayerAhead | None]:
        """One layer's decode attention -> (partial states of every producer, probs [B, Hkv, W]
        float32 of the window's ring slots (for the MAW), the new state, the carry for the next layer)."""
        raise NotImplementedError

    def prefill_token(self, step_layer: int, q: jax.Array, positions: jax.Array, exchange) -> jax.Array | None:
        """A prefill chunk's queries q [B, T, Hq, D] for a mode that must see them on the host
        (hgca's re-evaluation): hand them over and return a token the step ties into its outputs.
        None: nothing to hand over."""
        return None

    # ---- host side ---------------------------------------------------------------------------------
    def host(self, context: "ModeHostContext") -> "ModeHost":
        """This mode's host work for one open batch (see ModeHost)."""
        return ModeHost()

    def host_bytes_per_sequence(self, layout: HostLayout, offloaded_blocks: int, max_len: int,
                                workload: Workload) -> int:
        """Host bytes one sequence holds with `offloaded_blocks` blocks per layer on the host (contexts
        of up to max_len tokens): the store's blocks, plus what the mode keeps besides (hgca: its
        context-cache pages; recall: its mirror)."""
        return layout.n_layers * offloaded_blocks * layout.block_bytes if self.offloads else 0

    def step_scratch_bytes(self, model_config, max_len: int) -> int:
        """Device bytes per sequence a decode step of this mode needs beyond its cache and the
        logits, at most (an estimate where XLA does not measure it)."""
        return 0

    # A step start builds these LayerState groups anew while the previous step's still exist (recall's
    # upload of the offloaded KV): device memory counts them twice.
    rebuilt_each_step: ClassVar[tuple[str, ...]] = ()

    # ---- around the core ---------------------------------------------------------------------------
    def balanced(self, budget: SplitBudget) -> dict:
        """This mode's part of the balanced split: OffloadConfig changes that keep its CPU work
        within `budget` (a budget, a pool, a kept-share cap; {} when it has no CPU work)."""
        return {}

    def restore_queries(self) -> int:
        """How many of a restored history's last queries this mode's restore needs (HCache)."""
        return 0

    def restored_window(self, window, queries: jax.Array, n_tokens: int, evicted: int, scale: float):
        """A restored layer's `Window` given the history's last queries [1, R, Hq, D] (hgca: its
        ring MAW from them); unchanged by default."""
        return window

    @classmethod
    def needs_calibration(cls, config: "OffloadConfig") -> bool:
        """Does `for_model` need a calibration text for this config?"""
        return False

    @classmethod
    def for_model(cls, config: "OffloadConfig", model, calibration_tokens) -> "OffloadConfig":
        """The config with per-model settings resolved on a calibration text ([T] token ids)."""
        return config

    def row_fields(self) -> dict:
        """This mode's settings as benchmark row columns (e.g. hgca's beta, scout's budget)."""
        return {}


class ModeHost:
    """A mode's host work between steps; every hook is a no-op unless the mode overrides it.
    Call order at a step start: step_start -> (eviction: blocks_stored per block batch, then
    blocks_evicted) -> before_prefill_chunk | before_decode."""

    def step_start(self, cache):
        """First thing at a step start (the previous step may still be running)."""
        return cache

    def blocks_stored(self, layer: int, seq: int, numbers: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Blocks `numbers` [n] of (layer, seq) are in the host store now; k, v [n, bs, Hkv, W] as
        the store was given them: the model's values, or where the store rounds them
        (`ModeHostContext.store_rounds`) its rows (host.store_format.from_storage gives the values)."""

    def blocks_evicted(self, layer: int, numbers_by_seq: dict[int, np.ndarray]) -> None:
        """The ring evicted these blocks of `layer` (sequence -> block numbers), all stored."""

    def before_prefill_chunk(self, positions: np.ndarray) -> None:
        """Before a prefill / append chunk with positions [B, T] (-1 = padding)."""

    def before_decode(self, cache, offloaded_before: np.ndarray):
        """Before a decode step; offloaded_before [B] = host blocks per sequence before this step's
        eviction."""
        return cache

    def overlap_dispatch(self) -> bool:
        """The driver calls `after_dispatch` after every call from now on (`AttentionBackend.
        overlap_dispatch`): move what can run in a call's shadow there. Returns whether anything
        moved."""
        return False

    def dispatch_work_due(self) -> bool:
        """Whether `after_dispatch` has work now (cheap: asked after every call)."""
        return False

    def after_dispatch(self, cache):
        """Right after a call's dispatch, while the device runs it (`overlap_dispatch`); `cache` is the
        call's output. Returns the cache for the next call."""
        return cache

    def precompile(self, cache) -> None:
        """Compile now what this mode's host work compiles on first use (`HostRuntime.precompile`)."""

    def exchange_pages(self, published: np.ndarray):
        """(Exchange worker thread, store lock held) the pages this decode step's host calls read
        for blocks `published` [B] owned by the host side (host.exchange_worker.ContextPages /
        BlockPages); only called for modes with a `host_target`."""
        raise NotImplementedError(f"{type(self).__name__} makes no host call in decode steps")

    def receive_queries(self, layer: int, tail: np.ndarray, valid: np.ndarray) -> None:
        """A prefill chunk's last queries (`OffloadMode.prefill_token`): tail [B, keep, Hq, D]
        float32, valid [B] tokens of the chunk per row."""

    def adopted(self, store_replaced: bool) -> None:
        """The runtime adopted a history (`HostRuntime.adopt`): a filled store (store_replaced) or
        blocks appended to its own store (HCache restore)."""

    def reset_rows(self, rows: np.ndarray) -> None:
        """Rows `rows` ([n] int) start new sequences at position 0 (continuous batching,
        `HostRuntime.reset_rows`): drop what this mode keeps for them, and wait for (or void) its
        own background work on them. Called between steps, after the eviction thread has landed
        every started copy and before the rows' store blocks are freed and their counts zeroed;
        the other rows go on untouched. Nothing to do for a mode without per-sequence host state."""

    def restored(self, queries: dict[int, np.ndarray]) -> None:
        """A restored history's last queries {layer: [1, R, Hq, D]} (restore_queries > 0)."""

    @classmethod
    def coordinate(cls, hosts: list["ModeHost"]) -> None:
        """Tensor parallelism, before a decode step: decisions a single device takes over all of its
        KV heads, taken over every shard of this process (`hosts`, one per shard, this class)."""

    def counters(self) -> dict:
        return {}

    def reset_counters(self) -> None:
        pass

    def row_stats(self) -> dict:
        """Measured benchmark row columns of this mode's host work (e.g. hgca's kept share)."""
        return {}

    def host_bytes(self) -> int:
        """Host bytes this mode holds besides the store (recall's mirror)."""
        return 0

    def close(self) -> None:
        pass


__all__ = ["DecodeStep", "OffloadMode", "ModeHost", "Partial", "Workload", "HostLayout", "SplitBudget"]
