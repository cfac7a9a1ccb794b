"""The balanced split: how much context the GPU keeps and how much work the CPU gets, chosen from
this machine's measured speeds instead of a fixed GPU ratio.

Two rules, per point (model, mode, batch, context):

  GPU window   as large as the device memory left at this batch allows (weights, the runtime's
               reserve and the mode's other device state taken out), rounded down to whole blocks,
               never more than the context: every token the GPU holds is one the CPU does not read.
  CPU share    no more than the host can attend while the GPU runs the layer: per layer and step
               the GPU reads the layer's weights plus the window's KV (at `hbm_gbps`), the CPU reads
               its share of the offloaded KV (at `host_attention_gbps`, the Numba kernels' measured
               rate) after the exchange's fixed cost. scout: the budget (and a recall pool that holds
               the selection's stable part); hgca: the kept share that balances, as a cap on what
               the salience threshold keeps (`OffloadConfig.max_keep_share`: the highest-scoring
               tokens up to that share; a tighter cap given in the base config is kept).

    profile = machine_profile()                     # measured once per process (cached), or defaults
    config, report = balanced_split(model_config, OffloadConfig(mode="scout"), batch, context,
                                    device_free_bytes, profile)
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time

import numpy as np

from jhybrid.hybrid.config import OffloadConfig
from jhybrid.hybrid.modes.base import SplitBudget, Workload
from jhybrid.hybrid.registry import mode_class

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class MachineProfile:
    """Measured speeds: device memory read rate, host attention KV rate, exchange cost per layer."""

    hbm_gbps: float
    host_attention_gbps: float
    exchange_us_per_layer: float
    source: str


def _measure_hbm_gbps() -> float:
    """Bytes read per second by a jitted reduction over a 1 GiB device array (median of 5)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((2**28,), jnp.float32)
    f = jax.jit(lambda a: jnp.sum(a * 1.0001))
    f(x).block_until_ready()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - start)
    return x.nbytes / float(np.median(times)) / 1e9


def _measure_host_attention_gbps(n_threads: int | None) -> float:
    """KV bytes per second of the host attention kernel over a 256 MiB bf16 paged view (median of 3;
    the pages are filled with a cheap pattern: random generation of this size costs seconds)."""
    import numba

    from host.attention import paged_attention
    from host.paged_view import PagedKV

    n_threads = n_threads or max(1, numba.config.NUMBA_NUM_THREADS - 1)
    numba.set_num_threads(n_threads)
    rng = np.random.default_rng(0)
    b, hkv, hq, d, page = 4, 8, 32, 128, 16
    pages_per_unit = 2**28 // (b * hkv * 2 * page * d * 2)
    n = b * hkv * pages_per_unit
    k = np.empty((n, page, d), np.uint16)
    k[:] = (np.arange(page * d, dtype=np.uint32).reshape(page, d) % 251 + 0x3C00).astype(np.uint16)  # ~[1, 2)
    v = k.copy()
    view = PagedKV(k, v, 1, np.arange(b * hkv + 1, dtype=np.int64) * pages_per_unit, np.arange(n, dtype=np.int64),
                   np.full(b * hkv, pages_per_unit * page, np.int64), hkv)
    q = rng.standard_normal((b, 1, hq, d)).astype(np.float32)
    paged_attention(q, view, 0.1)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        paged_attention(q, view, 0.1)
        times.append(time.perf_counter() - start)
    return view.attended_bytes() / float(np.median(times)) / 1e9


# Used where nothing is measured (documented defaults, not this machine): the H100 host's figures.
DEFAULT_PROFILE = MachineProfile(hbm_gbps=3000.0, host_attention_gbps=80.0, exchange_us_per_layer=20.0,
                                 source="defaults (H100 figures in BENCHMARKS.md)")


@functools.lru_cache(maxsize=None)
def machine_profile(measure: bool = True, n_threads: int | None = None,
                    host_attention_gbps: float | None = None) -> MachineProfile:
    """This machine's profile, measured once per process (a few seconds); DEFAULT_PROFILE when
    `measure` is False. host_attention_gbps: use this host rate instead of probing it (the probe
    reads differently from process to process: BENCHMARKS.md; pinning it reproduces a split). The
    exchange cost is the documented per-layer figure (not measured here)."""
    if host_attention_gbps is not None and not host_attention_gbps > 0:
        raise ValueError(f"host_attention_gbps={host_attention_gbps!r}; expected None or a rate > 0 (GB/s)")
    if not measure:
        return DEFAULT_PROFILE
    start = time.perf_counter()
    host = host_attention_gbps or round(_measure_host_attention_gbps(n_threads), 1)
    profile = MachineProfile(hbm_gbps=round(_measure_hbm_gbps(), 1), host_attention_gbps=host,
                             exchange_us_per_layer=DEFAULT_PROFILE.exchange_us_per_layer,
                             source=f"measured ({time.perf_counter() - start:.1f} s)"
                                    + ("; host rate given" if host_attention_gbps else ""))
    log.info("machine profile: %s", profile)
    return profile


@dataclasses.dataclass(frozen=True)
class SplitReport:
    """What the balanced split chose, and why (per layer and decode step)."""

    window_tokens: int
    gpu_ms_per_layer: float
    cpu_bytes_per_layer: int          # what the CPU may read per layer without making the GPU wait
    cpu_tokens_per_seq_head: int      # the same in tokens per (sequence, KV head)
    cpu_share: float | None           # the share of the offloaded tokens that is (None: nothing offloaded)
    changes: dict                     # the mode's part (`OffloadMode.balanced`): e.g. budget, recall_blocks,
                                      # max_keep_share
    profile: str

    def fields(self) -> dict:
        return {"split": "balanced", "split_gpu_ms_per_layer": round(self.gpu_ms_per_layer, 4),
                "split_cpu_tokens": self.cpu_tokens_per_seq_head, "split_cpu_share": self.cpu_share,
                "split_profile": self.profile}


def balanced_split(model_config, base: OffloadConfig, batch: int, context: int, fits, profile: MachineProfile,
                   weight_bytes_per_layer: int, workload: Workload = Workload(),
                   host_fits=None) -> tuple[OffloadConfig, SplitReport]:
    """The config of `base` (an offloading mode) with its window, and its mode's part of the split
    (`OffloadMode.balanced`: scout / topk a budget and pool, hgca a kept-share cap), chosen by the
    balanced split (module docstring). fits(config) -> bool: does the point fit the device with this
    config (the caller's memory prediction, weights and reserves included)? host_fits(config) ->
    bool (None: always): does the offloaded part fit the host? A smaller window offloads more, so
    the largest window the device holds is also the host's best case. workload: the attention
    statistics the mode sizes its CPU work with (jhybrid.bench.selection_stats). ValueError when
    not even the smallest window fits the device, or the largest that does leaves more than the
    host holds."""
    mode_cls = mode_class(base.mode)
    if not mode_cls.offloads:
        raise ValueError(f"the balanced split is for the offloading modes (mode {base.mode!r} keeps everything "
                         "on the device)")
    bs, sink = base.block_size, base.sink
    it = np.dtype(model_config.dtype).itemsize
    per_unit_token = model_config.head_dim * 2 * it  # K + V of one (token, KV head)
    kv_token_layer = model_config.num_kv_heads * per_unit_token

    def choose(window: int):
        offloaded = max(0, context - window)
        gpu_s = (weight_bytes_per_layer + batch * window * kv_token_layer) / (profile.hbm_gbps * 1e9)
        cpu_bytes = int(max(0.0, gpu_s - profile.exchange_us_per_layer * 1e-6) * profile.host_attention_gbps * 1e9)
        cpu_tokens = cpu_bytes // max(1, batch * model_config.num_kv_heads * per_unit_token)
        sized = dataclasses.replace(base.with_defaults(), window_tokens=window, gpu_ratio=None)
        changes = mode_cls(sized).balanced(SplitBudget(int(cpu_tokens), offloaded, workload))
        config = dataclasses.replace(sized, **changes)
        share = round(min(1.0, cpu_tokens / offloaded), 4) if offloaded else None
        report = SplitReport(window, gpu_s * 1e3, cpu_bytes, int(cpu_tokens), share, changes,
                             f"{profile.source}: HBM {profile.hbm_gbps:g} GB/s, host attention "
                             f"{profile.host_attention_gbps:g} GB/s, exchange {profile.exchange_us_per_layer:g} us/layer")
        return config, report

    if not mode_cls.grows_window:  # the window stays the config's (scout): only the mode's part is sized
        window = base.resolved(context).window_tokens
        chosen = choose(window)
        if not fits(chosen[0]):
            raise ValueError(f"balanced split: the {base.mode} window of {window} tokens does not fit the device at "
                             f"batch {batch}")
        if host_fits is not None and not host_fits(chosen[0]):
            raise ValueError(f"balanced split: batch {batch} offloads more than the host holds")
        return chosen
    lo, hi = 2, max(2, (context - sink) // bs - 1)  # ring blocks of the window
    if not fits(choose(sink + lo * bs)[0]):
        raise ValueError(f"balanced split: not even a window of {sink + lo * bs} tokens fits the device at batch {batch}")
    while lo < hi:  # the largest window (in ring blocks) that fits
        mid = (lo + hi + 1) // 2
        if fits(choose(sink + mid * bs)[0]):
            lo = mid
        else:
            hi = mid - 1
    chosen = choose(sink + lo * bs)
    if host_fits is not None and not host_fits(chosen[0]):
        raise ValueError(f"balanced split: the largest window the device holds at batch {batch} "
                         f"({chosen[1].window_tokens} tokens) offloads more than the host holds")
    return chosen


__all__ = ["MachineProfile", "DEFAULT_PROFILE", "machine_profile", "SplitReport", "balanced_split"]
