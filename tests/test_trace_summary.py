"""benchmarks/trace_summary.py: per-thread totals of a Perfetto JSON trace (device calls' diagnosis)."""

import gzip
import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _module():
    spec = importlib.util.spec_from_file_location("trace_summary", os.path.join(ROOT, "benchmarks", "trace_summary.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_totals_per_thread_and_name_from_a_trace_directory(tmp_path, rng):
    durations = rng.integers(1, 5000, size=(2, 3))  # [stream, kernel] microseconds
    events = [{"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}}]
    events += [{"ph": "M", "name": "thread_name", "pid": 7, "tid": s, "args": {"name": f"Stream #{s}"}} for s in range(2)]
    ts = 100
    for s in range(2):
        for k in range(3):
            for _ in range(2):  # each kernel twice
                events.append({"ph": "X", "name": f"kernel_{k}", "pid": 7, "tid": s, "ts": ts, "dur": int(durations[s, k])})
                ts += 10_000
    events.append({"ph": "i", "name": "instant", "pid": 7, "tid": 0, "ts": 5})  # not a complete event: ignored
    run = tmp_path / "plugins" / "profile" / "run1"
    run.mkdir(parents=True)
    with gzip.open(run / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)

    ts_mod = _module()
    summary = ts_mod.summarize(*ts_mod.load_events(str(tmp_path)), top=10)

    assert set(summary) == {"/device:GPU:0 / Stream #0", "/device:GPU:0 / Stream #1"}
    for s in range(2):
        entry = summary[f"/device:GPU:0 / Stream #{s}"]
        assert entry["busy_ms"] == pytest.approx(2 * durations[s].sum() / 1e3, abs=0.2)
        names = {name: (ms, n) for name, ms, n in entry["names"]}
        for k in range(3):
            assert names[f"kernel_{k}"] == (pytest.approx(2 * durations[s, k] / 1e3, abs=0.01), 2)
        assert [n for n, _, _ in entry["names"]] == sorted(names, key=lambda n: -names[n][0])


def test_a_directory_without_a_trace_is_reported(tmp_path):
    with pytest.raises(SystemExit, match="no perfetto_trace.json.gz under"):
        _module().load_events(str(tmp_path))
