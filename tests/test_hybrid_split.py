"""The balanced split (jhybrid.hybrid.split) against its arithmetic, done again here in float64."""

from __future__ import annotations

import numpy as np
import pytest

from jhybrid.bench.shapes import model_config_for
from jhybrid.hybrid.config import OffloadConfig
from jhybrid.hybrid.modes.base import Workload
from jhybrid.hybrid.split import MachineProfile, balanced_split

PROFILE = MachineProfile(hbm_gbps=3000.0, host_attention_gbps=60.0, exchange_us_per_layer=20.0, source="test")


def _case(rng):
    config = model_config_for("llama3-8b")
    batch = int(rng.integers(1, 24))
    context = int(rng.choice([8192, 32768, 65536]))
    per_token_layer = config.num_kv_heads * config.head_dim * 2 * 2  # bf16 K + V
    limit = int(rng.integers(2, 40)) * 2**30
    weight_bytes_per_layer = 436 * 2**20
    return config, batch, context, per_token_layer, limit, weight_bytes_per_layer


@pytest.mark.parametrize("mode", ["hgca", "scout", "topk"])
def test_window_is_the_largest_that_fits_and_the_cpu_share_balances(rng, mode):
    config, batch, context, per_token_layer, limit, wpl = _case(rng)
    fits = lambda offload: batch * offload.window_tokens * per_token_layer * config.num_layers <= limit  # noqa: E731
    base = OffloadConfig(mode=mode)
    try:
        offload, report = balanced_split(config, base, batch, context, fits, PROFILE, wpl,
                                         workload=Workload(resident_share=0.75))
    except ValueError as error:
        smallest = base.resolved(context).window_tokens if mode == "scout" else base.sink + 2 * base.block_size
        assert "not even a window" in str(error) or "does not fit the device" in str(error)
        assert not fits(OffloadConfig(mode=mode, window_tokens=smallest))
        return
    bs, sink, window = base.block_size, base.sink, offload.window_tokens
    assert window == report.window_tokens and (window - sink) % bs == 0 and fits(offload)
    if mode == "scout":  # the paper's regime: the short window stays, the pool holds twice the budget
        assert window == base.resolved(context).window_tokens and offload.effective_budget == 2048
        assert offload.recall_blocks == report.changes["recall_blocks"] == 2 * 2048 // bs
        return
    bigger = window + bs
    assert bigger > context - bs or not fits(OffloadConfig(mode=mode, window_tokens=bigger))
    gpu_s = (wpl + batch * window * per_token_layer) / (PROFILE.hbm_gbps * 1e9)
    cpu_bytes = max(0.0, gpu_s - PROFILE.exchange_us_per_layer * 1e-6) * PROFILE.host_attention_gbps * 1e9
    cpu_tokens = int(cpu_bytes) // (batch * per_token_layer)
    assert report.cpu_tokens_per_seq_head == cpu_tokens
    offloaded = context - window
    if mode == "hgca":
        share = min(1.0, cpu_tokens / offloaded)
        assert report.cpu_share == pytest.approx(share, abs=1e-4)
        if share < 1.0:
            assert offload.max_keep_share == pytest.approx(max(share, 1e-4), abs=1e-4)
        else:
            assert offload.max_keep_share is None
    else:
        want = min(max(bs, cpu_tokens // bs * bs), max(bs, offloaded // bs * bs))
        assert offload.budget == report.changes["budget"] == want and offload.max_keep_share is None


def test_a_tighter_cap_given_in_the_config_is_kept():
    config = model_config_for("llama3-8b")
    fits = lambda offload: offload.window_tokens <= 4096  # noqa: E731
    _, report = balanced_split(config, OffloadConfig(mode="hgca"), 16, 32768, fits, PROFILE, 436 * 2**20)
    assert 0.0 < report.cpu_share < 1.0
    tight = report.cpu_share / 2
    offload, _ = balanced_split(config, OffloadConfig(mode="hgca", max_keep_share=tight), 16, 32768, fits,
                                PROFILE, 436 * 2**20)
    assert offload.max_keep_share == tight


def test_the_host_is_checked_at_the_largest_window_the_device_holds():
    """fits (device) grows false with the window, host_fits grows true: the split takes the largest
    device window and refuses the point when even that offloads too much."""
    config = model_config_for("llama3-8b")
    device = lambda offload: offload.window_tokens <= 8192  # noqa: E731
    offload, _ = balanced_split(config, OffloadConfig(mode="hgca"), 8, 32768, device, PROFILE, 436 * 2**20,
                                host_fits=lambda o: o.window_tokens >= 4096)
    assert 8192 - 16 < offload.window_tokens <= 8192
    with pytest.raises(ValueError, match="offloads more than the host holds"):
        balanced_split(config, OffloadConfig(mode="hgca"), 8, 32768, device, PROFILE, 436 * 2**20,
                       host_fits=lambda o: o.window_tokens >= 9000)


def test_full_is_refused():
    with pytest.raises(ValueError, match="offloading modes"):
        balanced_split(model_config_for("tiny"), OffloadConfig(mode="full"), 1, 1024, lambda o: True, PROFILE, 1)


def test_budget_command_prints_the_balanced_split(capsys):
    from jhybrid.cli import main

    assert main(["budget", "--model", "llama3-8b", "--context", "32768", "--batch", "16", "--gpu-mem", "80",
                 "--reserve", "8", "--split", "balanced", "--mode", "hgca"]) == 0
    out = capsys.readouterr().out
    assert "balanced split" in out and "kept share" in out and "GPU window" in out
    window = int(out.split("GPU window")[1].split("tokens")[0].replace(",", "").strip())
    assert 16 < window < 32768
    assert np.isfinite(float(out.split("GPU time per layer")[1].split("ms")[0]))


def test_a_given_host_rate_replaces_the_probe(monkeypatch):
    """machine_profile(host_attention_gbps=...) uses the given rate and never runs the host probe
    (which reads differently from process to process); a non-positive rate is refused, in the
    function and in a run config."""
    from jhybrid.config.loading import config_from_dict
    from jhybrid.config.schema import ConfigError
    from jhybrid.hybrid import split

    def no_probe(*_):
        raise AssertionError("the host attention probe ran")

    monkeypatch.setattr(split, "_measure_host_attention_gbps", no_probe)
    monkeypatch.setattr(split, "_measure_hbm_gbps", lambda: 1234.5)
    split.machine_profile.cache_clear()
    profile = split.machine_profile(host_attention_gbps=17.5)
    assert profile.host_attention_gbps == 17.5 and profile.hbm_gbps == 1234.5
    assert "host rate given" in profile.source
    with pytest.raises(ValueError, match="host_attention_gbps=0"):
        split.machine_profile(host_attention_gbps=0)
    split.machine_profile.cache_clear()
    with pytest.raises(ConfigError, match="'benchmark.split_host_gbps' = -1"):
        config_from_dict({"name": "x", "benchmark": {"task": "throughput", "split": "balanced", "split_host_gbps": -1}})
