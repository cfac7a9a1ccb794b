"""OffloadConfig: the one switch that picks an attention mode and its GPU window / host policy.

The same validated dataclass is the Python API (`make_backend(OffloadConfig(...))`), the YAML
`offload:` section of a run config (every field can be set and swept by its name) and the flags of
`jhybrid generate` (`--mode`, `--window-tokens`, ... one flag per field). User-facing conveniences
are resolved here and nowhere else: `gpu_ratio` (a share of the context) becomes `window_tokens`
in `resolved(context)`, and `budget` (tokens) becomes `topk_blocks` (blocks).

Modes (docs/design.md, "Modes"): `full` (every token's KV on the device) and the offloading modes
registered in `jhybrid.hybrid.modes` (recall, hgca, scout, streaming, topk).

GPU window per layer and sequence: `sink` tokens (positions 0..sink-1, never evicted) plus a ring
of `window_tokens - sink` tokens in blocks of `block_size`. Offloaded tokens are never dropped.
"""

from __future__ import annotations

import dataclasses
import math

EXCHANGES = ("split", "sync")
HOST_EXCHANGES = ("auto", "ffi", "callback")
HOST_KV_DTYPES = (None, "bf16", "fp16", "fp32", "int8")
PREFILL_OFFLOADED = ("auto", "device", "host")
KERNEL_BACKENDS = (None, "triton", "interpret", "reference")
DEFAULT_WINDOW_TOKENS = 1024  # an offloading mode given neither window_tokens nor gpu_ratio

# Fields every offloading mode reads (the GPU window, the host store and its workers); a mode's
# own fields are listed by its class (`OffloadMode.settings`).
COMMON_SETTINGS = frozenset({"window_tokens", "gpu_ratio", "sink", "block_size", "ring_slack_blocks",
                             "eviction_lag_steps", "eviction_spread", "prefill_offloaded",
                             "prefill_upload_max_bytes", "host_threads", "host_memory_cap_bytes", "host_kv_dtype",
                             "kernel_backend", "host_exchange", "exchange_timeout_s", "exchange_timing"})


def mode_names() -> tuple[str, ...]:
    """'full' and every registered offloading mode."""
    from jhybrid.hybrid.modes import MODES  # the registry imports this module: import late

    return ("full",) + tuple(MODES)


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
        ring blocks); set at most one of the two (neither: 1024 tokens). Resolved by `resolved`.
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
    exchange: hgca: "split" = submit before the GPU window attention, collect after it (the CPU
        overlaps the GPU); "sync" = one exchange that computes on the spot.
    budget: scout / topk: offloaded tokens attended per step and KV head, rounded up to whole
        blocks (`topk_blocks`); None = every offloaded block.
    recall_blocks: scout: GPU slots per (layer, sequence, KV head) for recalled offloaded blocks.
    recall_threshold: scout: recall a layer's important blocks when the CPU's share of its selected
        blocks exceeds this (ScoutAttention's default 12%) ...
    recall_min_interval: scout: ... but at most once every this many decode steps.
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
    exchange: str = "split"
    budget: int | None = None
    recall_blocks: int = 8
    recall_threshold: float = 0.12
    recall_min_interval: int = 4
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
        for name in ("sink", "keep_after", "recall_blocks", "ring_slack_blocks", "eviction_lag_steps"):
            value = getattr(self, name)
            check(name, _is_int(value) and value >= 0, "expected an int >= 0")
        for name in ("window_tokens", "budget", "host_threads", "host_memory_cap_bytes"):
            value = getattr(self, name)
            check(name, value is None or (_is_int(value) and value > 0), "expected None or a positive int")
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
        check("exchange", self.exchange in EXCHANGES, f"expected one of {EXCHANGES}")
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
        if self.mode == "scout" and not self.predict_query and set(exact) - {0}:
            return [(name, exact, "with predict_query=False every layer already uses its exact query "
                     "(set one of the two)")]
        return []

    # ---- resolution of the conveniences ---------------------------------------------------------
    def resolved(self, context: int | None = None) -> "OffloadConfig":
        """The config with a concrete `window_tokens` (gpu_ratio x context, else the default) and
        no `gpu_ratio`. `context`: tokens per sequence, needed only when gpu_ratio is set."""
        if self.mode == "full" or self.window_tokens is not None:
            return self
        if self.gpu_ratio is None:
            window = DEFAULT_WINDOW_TOKENS
        else:
            if context is None:
                raise ValueError(f"gpu_ratio={self.gpu_ratio} needs the context length to size the GPU window "
                                 "(pass context=..., or set window_tokens)")
            ring = int(self.gpu_ratio * context) - self.sink
            window = self.sink + max(2, ring // self.block_size) * self.block_size
        bad = self._window_problems(window)
        if bad:
            raise InvalidOffloadConfig(bad)
        return dataclasses.replace(self, window_tokens=window, gpu_ratio=None)

    def ignored_settings(self) -> list[str]:
        """Fields set to a non-default value that this mode never reads (e.g. beta for scout)."""
        from jhybrid.hybrid.modes import MODES

        used = MODES[self.mode].settings | COMMON_SETTINGS if self.mode != "full" else frozenset()
        return [f.name for f in dataclasses.fields(self)
                if f.name != "mode" and f.name not in used and getattr(self, f.name) != f.default]

    # ---- derived sizes (need a resolved window) ---------------------------------------------------
    def _window(self) -> int:
        if self.window_tokens is None:
            raise ValueError("the GPU window is not resolved yet: call config.resolved(context) first")
        return self.window_tokens

    @property
    def ring_tokens(self) -> int:
        """Non-sink GPU tokens (W of the ring buffer)."""
        return self._window() - self.sink

    @property
    def blk_num(self) -> int:
        """Blocks of the window's ring (the eviction policy's)."""
        return self.ring_tokens // self.block_size

    @property
    def ring_capacity(self) -> int:
        """Token slots of the device ring buffer: the window's ring plus the eviction slack."""
        return self.ring_tokens + self.ring_slack_blocks * self.block_size

    @property
    def ring_blocks(self) -> int:
        """Block slots of the device ring buffer."""
        return self.ring_capacity // self.block_size

    @property
    def max_prefill_chunk(self) -> int:
        """Longest prefill chunk whose eviction never needs the chunk's own tokens (ring - 1 block)."""
        return max(1, self.ring_tokens - self.block_size)

    @property
    def topk_blocks(self) -> int | None:
        """scout / topk budget in blocks per (sequence, KV head); None = every block."""
        return None if self.budget is None else -(-self.budget // self.block_size)

    def host_blocks(self, max_len: int) -> int:
        """Upper bound on offloaded blocks per (layer, sequence) for a context of max_len tokens."""
        return max(1, -(-max(0, max_len - self.sink) // self.block_size))


__all__ = ["OffloadConfig", "InvalidOffloadConfig", "EXCHANGES", "HOST_EXCHANGES", "PREFILL_OFFLOADED", "COMMON_SETTINGS", "mode_names"]
