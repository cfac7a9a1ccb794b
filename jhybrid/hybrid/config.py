"""OffloadConfig: the one switch that picks an attention mode and its GPU window / host policy.

The same validated dataclass is the Python API (`make_backend(OffloadConfig(...))`), the YAML
`offload:` section of a run config (every field can be set and swept by its name) and the flags of
`jhybrid generate` (`--mode`, `--window-tokens`, ... one flag per field). User-facing conveniences
are resolved here and nowhere else: `gpu_ratio` (a share of the context) becomes `window_tokens`
in `resolved(context)`, and `budget` (tokens) becomes `topk_blocks` (blocks).

Modes (docs/design.md, "Modes"): every mode registered in `jhybrid.hybrid.modes` (`full`: every
token's KV on the device; the offloading modes recall, hgca, scout, streaming, topk; ...). The
config checks its fields' types and ranges; what a mode adds (its own settings, checks and default
window) it declares on its class, found through `jhybrid.hybrid.registry`.

GPU window per layer and sequence: `sink` tokens (positions 0..sink-1, never evicted) plus a ring
of `window_tokens - sink` tokens in blocks of `block_size`. Offloaded tokens are never dropped.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from jhybrid.hybrid.registry import mode_class, mode_names

HOST_EXCHANGES = ("auto", "ffi", "callback")
HOST_KV_DTYPES = (None, "bf16", "fp16", "fp32", "int8")
PREFILL_OFFLOADED = ("auto", "device", "host")
KERNEL_BACKENDS = (None, "triton", "interpret", "reference")

# Fields every offloading mode reads (the GPU window, the host store and its workers); a mode's
# own fields are listed by its class (`OffloadMode.settings`).
COMMON_SETTINGS = frozenset({"window_tokens", "gpu_ratio", "sink", "block_size", "ring_slack_blocks",
                             "eviction_lag_steps", "eviction_spread", "prefill_offloaded",
                             "prefill_upload_max_bytes", "host_threads", "host_memory_cap_bytes", "host_kv_dtype",
                             "kernel_backend", "host_exchange", "exchange_timeout_s", "exchange_timing"})


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class InvalidOffloadConfig(ValueError):
    """Invalid OffloadConfig settings; `problems` lists (field, value, what was expected)."""

    def __init__(self, problems: list[tuple[str, object, str]]):
        self.problems = problems
        super().__init__("invalid offload config: " + "; ".join(f"{field}={value!r} ({expected})"
                                                                 for field, value, expected in problems))


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    """
    mode: 'full' or an offloading mode (recall, hgca, scout, streaming, topk).
    window_tokens: GPU tokens per layer and sequence, sinks included (HGCA's window) ...
    gpu_ratio: ... or this share of the context, rounded down to sink + whole blocks (at least two
        ring blocks); set at most one of the two (neither: the mode's default window,
        `OffloadMode.default_window_tokens`). Resolved by `resolved`.
    sink: attention-sink tokens kept on the GPU forever.
    block_size: tokens per eviction / selection block.
    ring_slack_blocks: blocks the GPU ring holds beyond the window, so that evictions finish in the
        background: a block's copy to the host starts when the policy evicts it, the GPU keeps
        attending it until the host publishes it (`eviction_lag_steps` decode steps later).
    eviction_lag_steps: decode steps between the start of a block's copy and its publication to the
        host side (the step start waits only if the background is later than that).
    eviction_spread: spread the sequences' evictions over block_size decode steps (sequence b starts
        its copies at steps where (step + b) % block_size == 0, or when its slack runs out), so no
        step carries every sequence's eviction at once.
    alpha: hgca: MAW moving-average factor, A = (1 - alpha) A + alpha A_new.
    beta: hgca: keep an offloaded token for CPU attention iff MAW > beta / window_tokens (HGCA's
        salience); tiny values (e.g. 1e-30) keep everything.
    keep_after: hgca: each kept token also keeps the keep_after tokens after it (spans for copying;
        not in HGCA, whose rule is keep_after = 0; `host.sparsify.extend_spans`).
    max_keep_share: hgca: of the tokens that pass the salience threshold, keep at most this share of
        the examined ones per (sequence, KV head), the highest-scoring (None = HGCA's rule alone; not
        in HGCA). Bounds the CPU's work per step; the balanced split sets it (`jhybrid.hybrid.split`).
    reevaluate_queries: hgca: how many of a new turn's last queries re-score the offloaded tokens.
    host_overlap: hgca: True = the CPU's part is submitted before the GPU window attention and
        collected after it (the CPU works while the GPU does); False = one synchronous host call
        per layer that computes on the spot, then the window (for comparison).
    budget: scout / topk / quest: tokens selected per step and KV head besides the window, rounded
        up to whole blocks (`topk_blocks`); None = every block; "auto" (default) = the mode's own
        default (`OffloadMode.defaults`: scout and quest 2048, topk every block).
    recall_blocks: scout: GPU pool slots per (layer, sequence, KV head) for important offloaded blocks
        (None, default: twice the budget's blocks; 8 when the budget is every block).
    recall_threshold: scout: recall a layer's important blocks when the CPU's share of its selected
        blocks exceeds this (ScoutAttention's default 12%) ...
    recall_min_interval: scout: ... but at most once every this many decode steps.
    recall_lag_steps: scout: None (default, for throughput) = a recall is applied at the first step
        start after its upload finished, never waited for; an int N = exactly N decode steps after
        its trigger, waiting for the upload if needed: results do not depend on timing (accuracy
        runs, tests).
    recall_after_dispatch: scout (recall_lag_steps None): apply finished recalls right after each
        call's dispatch, in its shadow (True), instead of at decode step starts (False, default). Off
        by default because it measured slower on the H200: decode steps of 26.7 ms against 25.4 ms at
        step starts (BENCHMARKS.md, session q): a call's launch returns only near its end, and the
        scatter's launch then waits behind it.
    recall_layers_per_step: scout: None (default) = every layer due recalls at a step start; an int N
        = at most N layers start a recall at one step start, and (recall_lag_steps None) at most N
        recalls are applied at one: the others wait for the next steps (the layers taken in turn
        from where the last step stopped). Spreads a burst (every layer's warm start after a
        prefill) over steps: each group of recalls costs the step start a dispatch, and each layer
        background CPU time beside the host attention.
    predict_query: scout: CPU attention uses the layer-ahead predicted query (True, the paper's
        design, approximate) or each layer's exact query (False; exact).
    scout_exact_layers: scout with predict_query: the layers that select and attend with their exact
        query anyway. "auto" (default): the layers whose predicted query's mean cosine similarity
        with the exact one is below scout_min_cos on a calibration text, measured once per model
        (`jhybrid.hybrid.calibration`; resolved by `make_backend(..., model=, calibration_tokens=)`,
        the CLI and the benchmarks; left unresolved, only layer 0 is exact, logged). Or a tuple of
        layer indices, or an int N meaning layers 0..N-1. Layer 0 is always exact (nothing runs
        ahead of it); each exact layer costs one more exchange per step. With sliding-window layers
        (Gemma 3) the indices count the global layers only (0 = the first).
    scout_min_cos: scout_exact_layers="auto": a layer whose predicted query's mean cosine similarity
        is below this runs on its exact query.
    prefill_offloaded: where a prefill / append chunk attends to the already offloaded part of its
        sequence: "device" = copies of those blocks on the device (`jhybrid.hybrid.prefill`),
        "host" = CPU attention over the host store, "auto" = device on a GPU, host elsewhere.
    prefill_upload_max_bytes: "device" / "auto": a chunk whose copies (K + V of every layer, padded)
        would exceed this many bytes uses the host path instead (logged). None = no limit.
    host_threads: Numba threads of the host worker (None: all cores but one).
    host_memory_cap_bytes: cap of the host store; a context that cannot fit is a ValueError.
    host_kv_dtype: how the host store keeps offloaded K / V: None = the model's dtype (bf16 / fp16 /
        fp32), or "int8" = 8-bit rows with a per-(token, head) float32 scale (half the host bytes and
        half the bytes the CPU reads; host.store_format). The GPU window keeps the model's dtype.
    kernel_backend: pallas_kernels backend (None: triton on GPU, jnp reference elsewhere, logged).
    host_exchange: how decode steps reach the host: "ffi" = XLA FFI custom calls into the native
        library (stream-ordered, no Python per layer; built by scripts/setup.sh), "callback" =
        jax.pure_callback (each call stalls the stream and takes the GIL), "auto" = ffi where the
        library loads, else callback (logged once).
    exchange_timeout_s: a decode step's host part not answered within this many seconds is an error
        naming the layer (never a hang).
    exchange_timing: the native exchange records CUDA events around its copies and its wait (counters
        exchange_wait_s: the stream waiting for the host; exchange_gpu_s: the exchange's own GPU work).
    """

    mode: str = "full"
    window_tokens: int | None = None
    gpu_ratio: float | None = None
    sink: int = 16
    block_size: int = 16
    ring_slack_blocks: int = 4
    eviction_lag_steps: int = 2
    eviction_spread: bool = True
    alpha: float = 0.1
    beta: float = 1.0
    keep_after: int = 0
    max_keep_share: float | None = None
    reevaluate_queries: int = 16
    host_overlap: bool = True
    budget: int | None | str = "auto"
    recall_blocks: int | None = None
    recall_threshold: float = 0.12
    recall_min_interval: int = 4
    recall_lag_steps: int | None = None
    recall_after_dispatch: bool = False
    recall_layers_per_step: int | None = None
    predict_query: bool = True
    scout_exact_layers: tuple[int, ...] | int | str = "auto"
    scout_min_cos: float = 0.9
    prefill_offloaded: str = "auto"
    prefill_upload_max_bytes: int | None = 8 * 2**30
    host_threads: int | None = None
    host_memory_cap_bytes: int | None = None
    host_kv_dtype: str | None = None
    kernel_backend: str | None = None
    host_exchange: str = "auto"
    exchange_timeout_s: float = 300.0
    exchange_timing: bool = False

    def __post_init__(self):
        exact = self.scout_exact_layers
        if isinstance(exact, list):
            object.__setattr__(self, "scout_exact_layers", tuple(exact))  # hashable: a jit static
        problems = self._problems()
        if problems:
            raise InvalidOffloadConfig(problems)

    def _problems(self) -> list[tuple[str, object, str]]:
        """(field, value, what was expected) of every invalid setting."""
        bad: list[tuple[str, object, str]] = []

        def check(name: str, ok: bool, expected: str) -> None:
            if not ok:
                bad.append((name, getattr(self, name), expected))

        modes = mode_names()
        check("mode", self.mode in modes, f"expected one of {', '.join(modes)}")
        for name in ("block_size", "recall_min_interval", "reevaluate_queries"):
            value = getattr(self, name)
            check(name, _is_int(value) and value > 0, "expected a positive int")
        for name in ("sink", "keep_after", "ring_slack_blocks", "eviction_lag_steps"):
            value = getattr(self, name)
            check(name, _is_int(value) and value >= 0, "expected an int >= 0")
        for name in ("window_tokens", "host_threads", "host_memory_cap_bytes"):
            value = getattr(self, name)
            check(name, value is None or (_is_int(value) and value > 0), "expected None or a positive int")
        check("budget", self.budget in (None, "auto") or (_is_int(self.budget) and self.budget > 0),
              "expected 'auto', None (every block) or a positive int (tokens)")
        check("recall_lag_steps", self.recall_lag_steps is None or (_is_int(self.recall_lag_steps)
                                                                and self.recall_lag_steps >= 1),
              "expected None (apply when ready) or an int >= 1 (decode steps after the trigger)")
        check("recall_after_dispatch", isinstance(self.recall_after_dispatch, bool), "expected true or false")
        if not bad and self.recall_after_dispatch and self.recall_lag_steps is not None:
            bad.append(("recall_after_dispatch", True, f"with recall_lag_steps={self.recall_lag_steps}: a lagged "
                        "recall is applied at a decode step start (set one of them only)"))
        check("recall_layers_per_step", self.recall_layers_per_step is None
              or (_is_int(self.recall_layers_per_step) and self.recall_layers_per_step >= 1),
              "expected None (every layer due) or an int >= 1 (layers a step start)")
        check("recall_blocks", self.recall_blocks is None or (_is_int(self.recall_blocks) and self.recall_blocks >= 0),
              "expected None (twice the budget) or an int >= 0")
        check("gpu_ratio", self.gpu_ratio is None or (_is_number(self.gpu_ratio) and 0.0 < self.gpu_ratio <= 1.0),
              "expected a fraction in (0, 1]")
        if not bad and self.window_tokens is not None and self.gpu_ratio is not None:
            bad.append(("window_tokens", self.window_tokens, f"window_tokens and gpu_ratio={self.gpu_ratio} are "
                        "exclusive (set one, the other to None)"))
        if not bad and self.window_tokens is not None:
            bad += self._window_problems(self.window_tokens)
        check("alpha", _is_number(self.alpha) and 0.0 < self.alpha <= 1.0, "expected a float in (0, 1]")
        check("beta", _is_number(self.beta) and 0.0 < self.beta < math.inf, "expected a float in (0, inf)")
        check("max_keep_share", self.max_keep_share is None or (_is_number(self.max_keep_share)
                                                              and 0.0 < self.max_keep_share <= 1.0),
              "expected None or a fraction in (0, 1]")
        check("recall_threshold", _is_number(self.recall_threshold) and 0.0 <= self.recall_threshold <= 1.0,
              "expected a fraction in [0, 1]")
        check("predict_query", isinstance(self.predict_query, bool), "expected true or false")
        check("eviction_spread", isinstance(self.eviction_spread, bool), "expected true or false")
        check("exchange_timing", isinstance(self.exchange_timing, bool), "expected true or false")
        check("host_overlap", isinstance(self.host_overlap, bool), "expected true or false")
        check("prefill_offloaded", self.prefill_offloaded in PREFILL_OFFLOADED,
              f"expected one of {PREFILL_OFFLOADED}")
        limit = self.prefill_upload_max_bytes
        check("prefill_upload_max_bytes", limit is None or (_is_int(limit) and limit >= 0),
              "expected None or an int >= 0")
        check("kernel_backend", self.kernel_backend in KERNEL_BACKENDS, f"expected one of {KERNEL_BACKENDS}")
        check("host_exchange", self.host_exchange in HOST_EXCHANGES, f"expected one of {HOST_EXCHANGES}")
        check("host_kv_dtype", self.host_kv_dtype in HOST_KV_DTYPES, f"expected one of {HOST_KV_DTYPES}")
        check("exchange_timeout_s", _is_number(self.exchange_timeout_s) and self.exchange_timeout_s > 0,
              "expected a positive number of seconds")
        check("scout_min_cos", _is_number(self.scout_min_cos) and -1.0 <= self.scout_min_cos <= 1.0,
              "expected a cosine in [-1, 1]")
        bad += self._exact_layer_problems()
        if not bad:  # what the mode itself requires of its settings
            bad += mode_class(self.mode).config_problems(self)
        return bad

    def _window_problems(self, window: int) -> list[tuple[str, object, str]]:
        ring = window - self.sink
        if ring < self.block_size:
            return [("window_tokens", window, f"with sink={self.sink} it leaves {ring} ring tokens: too small for "
                     f"one block of block_size={self.block_size}")]
        if ring % self.block_size:
            return [("window_tokens", window, f"window_tokens - sink = {ring} is not a multiple of "
                     f"block_size={self.block_size}")]
        return []

    def _exact_layer_problems(self) -> list[tuple[str, object, str]]:
        exact, name = self.scout_exact_layers, "scout_exact_layers"
        if exact == "auto":
            return []
        if isinstance(exact, bool) or not isinstance(exact, (int, tuple)):
            return [(name, exact, "expected 'auto', a tuple of layer indices or an int N = layers 0..N-1")]
        if isinstance(exact, int):
            return [] if exact >= 0 else [(name, exact, "expected an int N >= 0 = layers 0..N-1")]
        wrong = [x for x in exact if not _is_int(x) or x < 0]
        if wrong:
            return [(name, exact, f"{', '.join(map(repr, wrong))} not a layer index (expected ints >= 0)")]
        if len(set(exact)) != len(exact):
            return [(name, exact, "names a layer twice")]
        return []

    # ---- resolution of the conveniences ---------------------------------------------------------
    def with_defaults(self) -> "OffloadConfig":
        """The config with the mode's own defaults for the fields left to it (`OffloadMode.defaults`:
        budget "auto", recall_blocks None, ...)."""
        changes = mode_class(self.mode).defaults(self)
        return dataclasses.replace(self, **changes) if changes else self

    def resolved(self, context: int | None = None) -> "OffloadConfig":
        """The config with the mode's defaults applied (`with_defaults`) and, for a mode with a GPU
        window, a concrete `window_tokens` (gpu_ratio x context, else the mode's default) and no
        `gpu_ratio`. `context`: tokens per sequence, needed only when gpu_ratio is set."""
        config = self.with_defaults()
        mode = mode_class(self.mode)
        if "window_tokens" not in self._read_by(mode) or config.window_tokens is not None:
            return config
        if config.gpu_ratio is None:
            window = mode.default_window_tokens
        else:
            if context is None:
                raise ValueError(f"gpu_ratio={config.gpu_ratio} needs the context length to size the GPU window "
                                 "(pass context=..., or set window_tokens)")
            ring = int(config.gpu_ratio * context) - config.sink
            window = config.sink + max(2, ring // config.block_size) * config.block_size
        bad = config._window_problems(window)
        if bad:
            raise InvalidOffloadConfig(bad)
        return dataclasses.replace(config, window_tokens=window, gpu_ratio=None)

    @staticmethod
    def _read_by(mode) -> frozenset:
        """The fields a mode class reads: its own settings, and the window / host fields if it offloads."""
        return mode.settings | (COMMON_SETTINGS if mode.offloads else frozenset())

    def ignored_settings(self) -> list[str]:
        """Fields set to a non-default value that this mode never reads (e.g. beta for scout)."""
        used = self._read_by(mode_class(self.mode))
        return [f.name for f in dataclasses.fields(self)
                if f.name != "mode" and f.name not in used and getattr(self, f.name) != f.default]

    # ---- derived sizes (need a resolved window) ---------------------------------------------------
    def _window(self) -> int:
        if self.window_tokens is None:
            raise ValueError("the GPU window is not resolved yet: call config.resolved(context) first")
        return self.window_tokens

    @functools.cached_property
    def ring_tokens(self) -> int:
        """Non-sink GPU tokens (W of the ring buffer)."""
        return self._window() - self.sink

    @functools.cached_property
    def blk_num(self) -> int:
        """Blocks of the window's ring (the eviction policy's)."""
        return self.ring_tokens // self.block_size

    @functools.cached_property
    def ring_capacity(self) -> int:
        """Token slots of the device ring buffer: the window's ring plus the eviction slack."""
        return self.ring_tokens + self.ring_slack_blocks * self.block_size

    @functools.cached_property
    def ring_blocks(self) -> int:
        """Block slots of the device ring buffer."""
        return self.ring_capacity // self.block_size

    @functools.cached_property
    def max_prefill_chunk(self) -> int:
        """Longest prefill chunk whose eviction never needs the chunk's own tokens (ring - 1 block)."""
        return max(1, self.ring_tokens - self.block_size)

    @functools.cached_property
    def topk_blocks(self) -> int | None:
        """scout / topk / quest budget in blocks per (sequence, KV head); None = every block."""
        budget = self.effective_budget
        return None if budget is None else -(-budget // self.block_size)

    @functools.cached_property
    def effective_budget(self) -> int | None:
        """The budget in tokens: "auto" is the mode's `default_budget` (None = every block)."""
        return mode_class(self.mode).default_budget if self.budget == "auto" else self.budget

    def host_blocks(self, max_len: int) -> int:
        """Upper bound on offloaded blocks per (layer, sequence) for a context of max_len tokens."""
        return max(1, -(-max(0, max_len - self.sink) // self.block_size))


__all__ = ["OffloadConfig", "InvalidOffloadConfig", "HOST_EXCHANGES", "PREFILL_OFFLOADED", "COMMON_SETTINGS",
           "mode_names"]
