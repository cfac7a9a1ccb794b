"""scout in the paper's regime: its defaults, a recall schedule that does not depend on timing, and
capacity bounded by host memory (not by the GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from jhybrid.bench.budget import mode_capacity, weight_bytes
from jhybrid.bench.shapes import model_config_for
from jhybrid.generation import make_step
from jhybrid.hybrid import OffloadConfig, make_backend
from jhybrid.models import create_model
from tests.hybrid_support import TINY

GIB = 2**30


def test_defaults_are_a_short_window_and_a_pool_of_twice_the_budget():
    cfg = OffloadConfig(mode="scout").resolved()
    assert (cfg.window_tokens, cfg.effective_budget, cfg.topk_blocks, cfg.recall_blocks) == (272, 2048, 128, 256)
    assert OffloadConfig(mode="scout", budget=512, block_size=32).resolved().recall_blocks == 2 * 16
    assert OffloadConfig(mode="scout", budget=None).resolved().recall_blocks == 8  # every block selected
    assert OffloadConfig(mode="scout", recall_blocks=5).resolved().recall_blocks == 5  # given: kept
    assert OffloadConfig(mode="topk").resolved().topk_blocks is None  # topk's default: every block
    assert OffloadConfig(mode="quest").resolved().topk_blocks == 128


def _decode(model, backend, prompt, steps):
    """Prefill `prompt` [B, P] in chunks of 16, then `steps` greedy-free forced steps (token 1); no
    wait for background recalls anywhere. -> (logits [B, steps, V], recall log)."""
    batch, length = prompt.shape
    step, params = make_step(model, backend)
    backend.open(model.config, batch, length + steps)
    cache = model.init_cache(batch, length + steps, backend)
    for s in range(0, length, 16):
        pos = np.broadcast_to(np.arange(s, s + 16, dtype=np.int32), (batch, 16))
        cache = backend.before_step(cache, pos)
        _, cache = step(params, prompt[:, s:s + 16], pos, cache)
    out = []
    for i in range(steps):
        pos = np.full((batch, 1), length + i, np.int32)
        cache = backend.before_step(cache, pos)
        logits, cache = step(params, np.ones((batch, 1), np.int32), pos, cache)
        out.append(np.asarray(logits[:, 0]))
    log = [(e["layer"], e["trigger_step"], e["apply_step"], e["rows"]) for e in backend.runtime.mode_host.recall_log]
    backend.close()
    return np.stack(out, 1), log


def test_a_fixed_recall_lag_makes_two_runs_identical(rng):
    model = create_model(TINY, seed=0)
    prompt = rng.integers(0, TINY.vocab_size, (2, 96)).astype(np.int32)
    config = dict(mode="scout", window_tokens=40, sink=8, block_size=16, budget=32, recall_blocks=2,
                  recall_threshold=0.0, recall_min_interval=2, recall_lag_steps=1, predict_query=False,
                  host_threads=1)
    first = _decode(model, make_backend(**config), prompt, 24)
    second = _decode(model, make_backend(**config), prompt, 24)
    assert first[1], "no recall was applied: the schedule was not exercised"
    assert all(apply - trigger == 1 for _, trigger, apply, _ in first[1])  # applied one step after its trigger
    assert first[1] == second[1]
    np.testing.assert_array_equal(first[0], second[0])


@pytest.mark.parametrize("context", [32768, 65536])
def test_host_memory_bounds_scout_and_int8_doubles_it(context):
    """32-layer Llama-3-8B on an 80 GiB GPU with 128 GiB of host memory: full attention is bound by
    the device, scout by the host (its GPU keeps window + pool + digests), and an 8-bit host store
    about doubles scout's batch."""
    config = model_config_for("llama3-8b")
    kw = dict(gpu_bytes=78 * GIB, host_bytes=128 * GIB, weights=weight_bytes(config), reserve=2 * GIB,
              host_reserve=16 * GIB)
    full = mode_capacity(config, OffloadConfig(mode="full"), context, **kw)
    bf16 = mode_capacity(config, OffloadConfig(mode="scout"), context, **kw)
    int8 = mode_capacity(config, OffloadConfig(mode="scout", host_kv_dtype="int8"), context, **kw)
    assert full.limited_by == "device" and bf16.limited_by == "host" and int8.limited_by == "host"
    assert bf16.max_batch > full.max_batch and bf16.max_batch_device > 4 * full.max_batch
    assert 1.8 * bf16.max_batch <= int8.max_batch <= 2.1 * bf16.max_batch


def test_budget_command_sizes_every_mode_and_names_the_limit(capsys):
    from jhybrid.cli import main

    assert main(["budget", "--model", "llama3-8b", "--context", "32768", "--gpu-mem", "80GiB",
                 "--host-mem", "128GiB"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines()[out.splitlines().index(
        next(l for l in out.splitlines() if l.startswith("capacity per mode"))) + 1:]}
    assert "device)" in lines["full"] and "host)" in lines["scout"] and "quest" in lines
    # two devices: per-device memory doubles what fits, the host is shared (one process)
    assert main(["budget", "--model", "llama3-70b", "--context", "32768", "--gpu-mem", "80GiB", "--tp", "2",
                 "--host-mem", "256GiB"]) == 0
    assert "tensor parallel" in capsys.readouterr().out
    assert main(["budget", "--model", "llama3-8b", "--context", "32768", "--gpu-mem", "80GiB", "--tp", "3"]) == 2
    assert "--tp 3 does not divide the 8 KV heads" in capsys.readouterr().err


@pytest.mark.parametrize("overlap,drift", [(0.82, 2.15), (0.876, 1.7), (0.6, 3.0)])
def test_calibrated_tiers_reproduce_the_overlap_and_the_drift(rng, overlap, drift):
    """Simulate the calibrated fill's selection (every step: the hot blocks and a random k - hot of
    the warm ones): its step-to-step overlap and its distinct blocks over many steps match the
    statistics the tiers were chosen for."""
    from jhybrid.bench.synthetic import calibrated_tiers

    k = 128
    hot, warm = calibrated_tiers(k, overlap, drift)
    previous, overlaps, seen = None, [], set()
    for _ in range(400):
        chosen = set(range(hot)) | set((hot + rng.choice(warm, size=k - hot, replace=False)).tolist())
        if previous is not None:
            overlaps.append(len(chosen & previous) / k)
        seen |= chosen
        previous = chosen
    assert abs(np.mean(overlaps) - overlap) < 0.02
    assert abs(len(seen) / k - drift) < 0.05
