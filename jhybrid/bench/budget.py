"""KV budget calculator (`jhybrid budget`): how much KV a model needs, and what to offload.

GQA-aware: the KV of one token is 2 (K and V) x layers x KV heads x head_dim x bytes per element;
query heads do not count. The GPU window for a target GPU share s of a context N is
sink + whole blocks of round-down(s x N - sink), the rest (N - window tokens per sequence and
layer) lives in the host store.

Sliding-window layers (Gemma 3's local layers) hold at most `sliding_window` tokens in the
offloading modes and offload nothing: only the global layers have a window and a host store.
`full` keeps every layer's whole context (what `jhybrid.attention.full` allocates).
"""

from __future__ import annotations

import dataclasses
import math
import re

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1, "int8": 1}


def dtype_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


# OffloadConfig.host_kv_dtype names (host.store_format) -> the dtype names used here
HOST_KV_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def host_bytes_per_value(config, host_kv_dtype: str | None) -> float:
    """Host-store bytes per offloaded K or V value: the model dtype's (None), a store format's
    (bf16 / fp16 / fp32), or int8's 1 byte plus its per-row float32 scale spread over head_dim."""
    if host_kv_dtype == "int8":
        return (config.head_dim + 4) / config.head_dim
    if host_kv_dtype in HOST_KV_DTYPE_NAMES:
        return dtype_bytes(HOST_KV_DTYPE_NAMES[host_kv_dtype])
    return dtype_bytes(host_kv_dtype or config.dtype)


def kv_bytes_per_token(config, kv_dtype: str | None = None) -> int:
    """Bytes of K and V of one token over all layers (GQA: num_kv_heads, not num_heads)."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype_bytes(kv_dtype or config.dtype)


def layer_kinds(config) -> tuple[int, int]:
    """(global layers, sliding-window layers) of a model."""
    n_global = len(config.global_layers)
    return n_global, config.num_layers - n_global


def sliding_tokens(config, context: int) -> int:
    """Tokens a sliding-window layer holds in the offloading modes for a context (0 without any)."""
    return min(config.sliding_window, context) if config.sliding_window is not None else 0


def parameter_count(config) -> int:
    """Approximate parameters of a decoder (embeddings, attention, gated MLP, norms)."""
    d, q, kv = config.d_model, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    mlp = (3 if config.mlp_type in ("swiglu", "geglu") else 2) * d * config.mlp_dim
    per_layer = d * q + 2 * d * kv + q * d + mlp + 2 * d
    embeddings = config.vocab_size * d * (1 if config.tie_embeddings else 2)
    return embeddings + config.num_layers * per_layer + d


def weight_bytes(config, dtype: str | None = None) -> int:
    return parameter_count(config) * dtype_bytes(dtype or config.dtype)


def parse_bytes(text: str) -> int:
    """'80' (GiB), '80GiB', '80GB', '512MiB' -> bytes."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?B)?\s*", str(text), re.IGNORECASE)
    if not match:
        raise ValueError(f"cannot read a memory size from {text!r} (e.g. 80, 80GiB, 80GB, 512MiB)")
    value, unit, suffix = float(match[1]), match[2].upper() or "G", (match[3] or "iB")
    base = 1024 if suffix.lower() == "ib" else 1000
    return int(value * base ** "BKMGT".index(unit if unit else "B"))


def window_for_share(context: int, share: float, sink: int, block_size: int) -> int:
    """GPU window tokens (sinks included) holding `share` of the context, in whole blocks."""
    ring = max(0, int(share * context) - sink)
    return min(context, sink + max(1, ring // block_size) * block_size)


@dataclasses.dataclass
class Budget:
    """All byte counts are totals over layers and KV heads; per-request = one sequence."""

    model: str
    context: int
    batch: int
    gpu_bytes: int
    kv_bytes_per_token: int
    kv_bytes_per_request: int
    weight_bytes: int
    free_gpu_bytes: int
    max_batch_full_on_gpu: int
    fits_fully_on_gpu: bool
    gpu_share: float
    window_tokens: int
    blocks_to_offload_per_layer: int
    blocks_to_offload_total: int
    host_bytes: int              # everything the host store holds for the offloaded blocks
    host_kv_bytes: int           # of which K and V
    gpu_kv_bytes_with_window: int
    max_batch_with_window: int
    max_window_for_batch: int


def kv_budget(name: str, config, context: int, batch: int, gpu_bytes: int, gpu_share: float = 0.25,
              sink: int | None = None, block_size: int | None = None, kv_dtype: str | None = None,
              reserve_bytes: int = 0, host_kv_dtype: str | None = None) -> Budget:
    """The numbers of `jhybrid budget`. reserve_bytes: device memory kept for activations etc.
    host_kv_dtype: the host store's format (OffloadConfig.host_kv_dtype; None: as kv_dtype).
    sink, block_size: None = OffloadConfig's defaults."""
    from jhybrid.hybrid.config import OffloadConfig

    defaults = OffloadConfig()
    sink = defaults.sink if sink is None else sink
    block_size = defaults.block_size if block_size is None else block_size
    if context <= 0 or batch <= 0 or gpu_bytes <= 0:
        raise ValueError("context, batch and gpu memory must be positive")
    if not 0.0 < gpu_share <= 1.0:
        raise ValueError(f"gpu_share={gpu_share}: expected a fraction in (0, 1]")
    per_token = kv_bytes_per_token(config, kv_dtype)
    per_request = per_token * context
    weights = weight_bytes(config)
    free = max(0, gpu_bytes - weights - reserve_bytes)
    window = window_for_share(context, gpu_share, sink, block_size)
    offloaded = context - window
    blocks = math.ceil(offloaded / block_size)
    # Per offloaded block and layer the host store also keeps (host.kv_store): MAW float32 per token
    # and KV head, positions int64 per token.
    hkv, d = config.num_kv_heads, config.head_dim
    n_global, n_sliding = layer_kinds(config)
    per_token_layer = per_token // config.num_layers
    extra_per_block_layer = hkv * block_size * 4 + block_size * 8
    if host_kv_dtype is None:  # the host keeps what the device keeps
        host_per_token = n_global * per_token_layer
    else:
        host_per_token = int(2 * n_global * hkv * d * host_bytes_per_value(config, host_kv_dtype))
    host_kv = batch * blocks * block_size * host_per_token
    # with the window: global layers hold `window` tokens, sliding layers their own window
    sliding_bytes = n_sliding * sliding_tokens(config, context) * per_token_layer
    gpu_per_seq = n_global * window * per_token_layer + sliding_bytes
    largest_window = (free // batch - sliding_bytes) // max(1, n_global * per_token_layer)
    return Budget(
        model=name, context=context, batch=batch, gpu_bytes=gpu_bytes,
        kv_bytes_per_token=per_token, kv_bytes_per_request=per_request, weight_bytes=weights,
        free_gpu_bytes=free, max_batch_full_on_gpu=free // per_request,
        fits_fully_on_gpu=batch * per_request <= free, gpu_share=gpu_share, window_tokens=window,
        blocks_to_offload_per_layer=blocks, blocks_to_offload_total=blocks * batch * n_global,
        host_bytes=host_kv + batch * blocks * n_global * extra_per_block_layer, host_kv_bytes=host_kv,
        gpu_kv_bytes_with_window=batch * gpu_per_seq,
        max_batch_with_window=free // gpu_per_seq,
        max_window_for_batch=max(0, min(context, largest_window)))


def human_bytes(n: int) -> str:
    """1.5 GiB / 12.0 MiB / 512 KiB."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def format_budget(b: Budget) -> list[tuple[str, str]]:
    """(label, value) lines for printing."""
    gib = lambda n: f"{n / 2**30:,.2f} GiB"  # noqa: E731
    return [
        ("model", b.model), ("context x batch", f"{b.context:,} x {b.batch}"),
        ("GPU memory", gib(b.gpu_bytes)), ("weights (approx.)", gib(b.weight_bytes)),
        ("free for KV", gib(b.free_gpu_bytes)),
        ("KV per token", f"{b.kv_bytes_per_token:,} B ({b.kv_bytes_per_token / 1024:.1f} KiB)"),
        ("KV per request", gib(b.kv_bytes_per_request)),
        ("max batch fully on GPU", f"{b.max_batch_full_on_gpu}"),
        ("this batch fits fully on GPU", "yes" if b.fits_fully_on_gpu else "no"),
        (f"window for GPU share {b.gpu_share:g}", f"{b.window_tokens:,} tokens (sinks included)"),
        ("GPU KV with that window", gib(b.gpu_kv_bytes_with_window)),
        ("blocks to offload", f"{b.blocks_to_offload_per_layer:,} per global layer and sequence, "
                              f"{b.blocks_to_offload_total:,} in all"),
        ("host memory needed", f"{gib(b.host_bytes)} (K/V {gib(b.host_kv_bytes)}, + MAW, positions)"),
        ("max batch with that window", f"{b.max_batch_with_window}"),
        ("largest window for this batch", f"{b.max_window_for_batch:,} tokens"),
    ]


def balanced_budget_split(b: Budget, config, mode: str, profile, sink: int | None = None,
                          block_size: int | None = None, workload=None):
    """`jhybrid budget --split balanced`: the balanced split (jhybrid.hybrid.split) of this budget's
    point for an offloading mode, a window fitting when the global layers' window K/V plus the
    sliding layers' fit the memory left for KV. -> (OffloadConfig, SplitReport).
    workload: the attention statistics the mode sizes its CPU work with (None: Workload's
    defaults, e.g. scout's resident share of real text, 0.73, BENCHMARKS.md)."""
    from jhybrid.hybrid.config import OffloadConfig
    from jhybrid.hybrid.modes.base import Workload
    from jhybrid.hybrid.split import balanced_split

    n_global, n_sliding = layer_kinds(config)
    per_token_layer = kv_bytes_per_token(config) // config.num_layers
    sliding = n_sliding * sliding_tokens(config, b.context) * per_token_layer

    def fits(offload) -> bool:
        return b.batch * (n_global * offload.window_tokens * per_token_layer + sliding) <= b.free_gpu_bytes

    base = OffloadConfig(mode=mode, **_given(sink=sink, block_size=block_size))
    return balanced_split(config, base, b.batch, b.context, fits, profile,
                          b.weight_bytes // max(1, config.num_layers), workload=workload or Workload())


def _given(**fields) -> dict:
    """The fields given (not None): the rest keep OffloadConfig's defaults (stated once, there)."""
    return {name: value for name, value in fields.items() if value is not None}


def format_split(offload, report) -> list[tuple[str, str]]:
    """(label, value) lines of a balanced split for printing."""
    lines = [("balanced split", f"{offload.mode}, profile: {report.profile}"),
             ("  GPU window", f"{report.window_tokens:,} tokens (sinks included)"),
             ("  GPU time per layer", f"{report.gpu_ms_per_layer:.3f} ms"),
             ("  CPU may read per layer", f"{human_bytes(report.cpu_bytes_per_layer)} "
                                          f"({report.cpu_tokens_per_seq_head:,} tokens per sequence and KV head"
                                          + (f", {report.cpu_share:.2%} of the offloaded tokens)"
                                             if report.cpu_share is not None else ")"))]
    labels = {"budget": ("  budget", "{:,} tokens per sequence and KV head"),
              "recall_blocks": ("  GPU pool", "{} blocks per sequence and KV head"),
              "max_keep_share": ("  kept share", "at most {:.2%} of the offloaded tokens")}
    for name, value in report.changes.items():
        label, text = labels.get(name, (f"  {name}", "{}"))
        lines.append((label, text.format(value)))
    return lines


def mode_capacity(model_config, offload, context: int, gpu_bytes: int, host_bytes: int | None,
                  weights: int | None = None, reserve: int = 0, host_reserve: int = 0, workload=None) -> PointMemory:
    """How many sequences of `context` tokens a mode holds (`offload`, resolved or not): the memory
    prediction of one sequence against the device and host capacities; its max_batch_device,
    max_batch_host and limited_by say which memory bounds the batch."""
    from jhybrid.hybrid.config import OffloadConfig  # noqa: F401 - the type of `offload`

    return point_memory(model_config, offload.resolved(context), 1, context, context, weights=weights,
                        device_limit=gpu_bytes, host_limit=host_bytes, device_reserve=reserve,
                        host_reserve=host_reserve, workload=workload)


def format_capacity(rows: list[tuple[str, PointMemory]]) -> list[tuple[str, str]]:
    """(label, value) lines: per mode, its bytes per sequence and its largest batch, and which
    memory limits it."""
    lines = [("capacity per mode", "device / host bytes per sequence; largest batch (limited by)")]
    for label, m in rows:
        device_max = m.max_batch_device if m.max_batch_device is not None else "-"
        host_max = m.max_batch_host if m.max_batch_host is not None else "-"
        lines.append((f"  {label}", f"{human_bytes(m.device_per_seq)} / {human_bytes(m.host_per_seq)}; "
                                    f"{m.max_batch if m.max_batch is not None else '-'} sequences "
                                    f"(device {device_max}, host {host_max}: {m.limited_by or 'no limit given'})"))
    return lines


# ---------------------------------------------------------------------------- one sweep point
# The bytes one throughput point needs, from the layouts the code allocates (jhybrid.hybrid.capacity:
# the device cache from the shapes the mode's backend allocates, the host from the store's slot
# layout and the mode; checked against real caches in tests/test_bench_throughput.py), plus per
# sequence the decode step's transient bytes: the logits (float32, twice), the mode's own scratch
# (`OffloadMode.step_scratch_bytes`: full's float32 score rows) and what a step start rebuilds while
# the previous copy lives (recall's upload). Host bytes at max_len: the blocks offloaded by the end
# of the run.

@dataclasses.dataclass
class PointMemory:
    mode: str
    batch: int
    context: int
    max_len: int
    window: int | None
    weight_bytes: int
    device_cache_per_seq: int  # the cache arrays (exact)
    device_activations_per_seq: int  # decode temporaries and upload copies (estimate)
    device_fixed: int
    device_limit: int | None
    host_per_seq: int
    host_fixed: int
    host_limit: int | None
    # Where the decode step's transient bytes come from: "arithmetic" (device_activations_per_seq,
    # an estimate) or "xla" (the compiled step's memory_analysis().temp_size_in_bytes at two
    # batches, as a fixed part in step_temp_fixed plus device_activations_per_seq per sequence).
    temp_source: str = "arithmetic"
    step_temp_fixed: int = 0
    step_temp_measured: int | None = None  # XLA's temp bytes at exactly this batch (when compiled)
    # The largest device batch found by compiling the step at it and at the next one (None: from
    # the linear model above).
    max_batch_device_checked: int | None = None
    # XLA's account (temp_source "xla"): the decode step compiled at this batch, and its compile
    # seconds, reused by the run (None: not compiled here)
    compiled: object = dataclasses.field(default=None, repr=False, compare=False)
    compile_seconds: float | None = None

    @property
    def device_per_seq(self) -> int:
        return self.device_cache_per_seq + self.device_activations_per_seq

    @property
    def step_temp_bytes(self) -> int:
        """The decode step's transient device bytes at this batch (measured where compiled)."""
        if self.step_temp_measured is not None:
            return self.step_temp_measured
        return self.step_temp_fixed + self.batch * self.device_activations_per_seq

    @property
    def device_bytes(self) -> int:
        return self.device_fixed + self.batch * self.device_cache_per_seq + self.step_temp_bytes

    @property
    def host_bytes(self) -> int:
        return self.host_fixed + self.batch * self.host_per_seq

    @property
    def max_batch_device(self) -> int | None:
        if self.device_limit is None:
            return None
        if self.max_batch_device_checked is not None:
            return self.max_batch_device_checked
        return max(0, (self.device_limit - self.device_fixed - self.step_temp_fixed) // self.device_per_seq)

    @property
    def max_batch_host(self) -> int | None:
        if self.host_limit is None or self.host_per_seq == 0:
            return None
        return max(0, (self.host_limit - self.host_fixed) // self.host_per_seq)

    @property
    def max_batch(self) -> int | None:
        bounds = [b for b in (self.max_batch_device, self.max_batch_host) if b is not None]
        return min(bounds) if bounds else None

    @property
    def limited_by(self) -> str | None:
        dev, host = self.max_batch_device, self.max_batch_host
        if dev is None and host is None:
            return None
        if host is None or (dev is not None and dev <= host):
            return "device"
        return "host"

    @property
    def fits_device(self) -> bool:
        return self.device_limit is None or self.device_bytes <= self.device_limit

    @property
    def fits_host(self) -> bool:
        return self.host_limit is None or self.host_bytes <= self.host_limit

    def over_capacity(self) -> str | None:
        """None when the point is predicted to fit, else the reason (what needs how much)."""
        gib = human_bytes
        if self.device_limit is not None and self.device_bytes > self.device_limit:
            return (f"over device capacity (predicted): needs {gib(self.device_bytes)} = weights "
                    f"{gib(self.weight_bytes)} + reserve {gib(self.device_fixed - self.weight_bytes)} + "
                    f"{self.batch} x {gib(self.device_cache_per_seq)} cache per sequence + step "
                    f"temporaries {gib(self.step_temp_bytes)} ({self.temp_source}) ({self.mode}, max_len "
                    f"{self.max_len}); the device has {gib(self.device_limit)}: max batch "
                    f"{self.max_batch_device}")
        if self.host_limit is not None and self.host_bytes > self.host_limit:
            return (f"over host capacity (predicted): needs {gib(self.host_bytes)} = reserve "
                    f"{gib(self.host_fixed)} + {self.batch} x {gib(self.host_per_seq)} per sequence "
                    f"({self.mode}, {self.context - (self.window or 0)} offloaded tokens); the host has "
                    f"{gib(self.host_limit)}: max batch {self.max_batch_host}")
        return None

    def fields(self) -> dict:
        """Row fields: the prediction behind a run or a skip."""
        return {"pred_device_bytes": self.device_bytes, "pred_host_bytes": self.host_bytes,
                "pred_max_batch": self.max_batch, "pred_max_batch_device": self.max_batch_device,
                "pred_max_batch_host": self.max_batch_host, "limited_by": self.limited_by,
                "device_limit_bytes": self.device_limit, "host_limit_bytes": self.host_limit,
                "pred_step_temp_bytes": self.step_temp_bytes, "pred_temp_source": self.temp_source,
                "pred_max_batch_checked": self.max_batch_device_checked is not None}


def point_memory(model_config, offload, batch: int, context: int, max_len: int, weights: int | None = None,
                 device_limit: int | None = None, host_limit: int | None = None, device_reserve: int = 0,
                 host_reserve: int = 0, workload=None) -> PointMemory:
    """Predicted device and host bytes of one throughput point: `offload` a resolved OffloadConfig
    (its window concrete), `batch` sequences of `context` tokens growing to max_len. weights:
    parameter bytes (None: estimated from the shape); workload: the attention statistics that size
    the mode's host state (jhybrid.hybrid.modes.base.Workload; None: its defaults). The limits are
    the capacities to check against."""
    from jhybrid.hybrid import capacity
    from jhybrid.hybrid.modes.base import Workload
    from jhybrid.hybrid.registry import mode_class

    mode = mode_class(offload.mode)(offload)
    per_seq, fixed = capacity.device_bytes(offload, model_config, max_len)
    transient = (2 * model_config.vocab_size * 4 + mode.step_scratch_bytes(model_config, max_len)
                 + capacity.step_rebuilt_bytes(offload, model_config, max_len))
    host = capacity.host_bytes_per_sequence(offload, model_config, max_len, max_len, workload or Workload())
    weights = weight_bytes(model_config) if weights is None else weights
    return PointMemory(mode=offload.mode, batch=batch, context=context, max_len=max_len,
                       window=offload.window_tokens if mode.offloads else None, weight_bytes=weights,
                       device_cache_per_seq=per_seq, device_activations_per_seq=transient,
                       device_fixed=weights + device_reserve + fixed, device_limit=device_limit,
                       host_per_seq=host, host_fixed=host_reserve, host_limit=host_limit)
