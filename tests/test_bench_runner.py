"""`jhybrid bench` end to end on a tiny random model: JSON + CSV + PNG, skipped points with their
reason, keep-everything hgca == full, resume after an interrupted run."""

from __future__ import annotations

import csv
import json

import pytest

from jhybrid import cli
from jhybrid.bench import runner
from jhybrid.config import load_config

CONFIG = """
name: tiny-bench
model: {name: tiny}
offload: {window_tokens: 48, sink: 16, block_size: 16, host_threads: 1}
benchmark: {tokens: 96, scored_tokens: 16, prefill_chunk: 16, context: 64, decode_tokens: 4}
sweep:
  - {offload.mode: [full, hgca]}
  - {offload.mode: hgca, offload.beta: 1.0e-30}
  - {offload.mode: topk, offload.budget: 4096}
  - {benchmark.task: throughput, offload.mode: full}
"""


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench")
    path = folder / "tiny.yaml"
    path.write_text(CONFIG)
    rc = cli.main(["bench", str(path), "--output-dir", str(folder / "results")])
    return folder, path, rc


def test_bench_writes_json_csv_png(first_run):
    folder, _, rc = first_run
    assert rc == 0
    results = folder / "results"
    doc = json.loads((results / "tiny-bench.json").read_text())
    for key in ("name", "device", "date", "versions", "command", "config", "rows"):
        assert key in doc
    assert doc["command"].startswith("jhybrid bench")
    assert len(doc["rows"]) == 5
    with open(results / "tiny-bench.csv") as f:
        assert len(list(csv.DictReader(f))) == 5
    assert (results / "tiny-bench-perplexity.png").stat().st_size > 1000
    assert (results / "tiny-bench-throughput.png").stat().st_size > 1000


def test_rows_keep_all_equals_full_and_skips_have_reasons(first_run):
    folder, _, _ = first_run
    rows = {r["point"]: r for r in json.loads((folder / "results" / "tiny-bench.json").read_text())["rows"]}
    full = rows["offload.mode=full"]
    keep_all = rows["offload.mode=hgca,offload.beta=1e-30"]
    assert set(full) >= {"mode", "text", "tokens", "gpu_ratio", "beta", "budget", "ppl"}
    assert keep_all["ppl"] == pytest.approx(full["ppl"], rel=1e-4)
    assert rows["offload.mode=hgca"]["window"] == 48
    skipped = rows["offload.mode=topk,offload.budget=4096"]
    assert "budget 4096" in skipped["skipped"]
    throughput = rows["benchmark.task=throughput,offload.mode=full"]
    assert throughput["decode_tok_s"] > 0 and throughput["tbt_p99_ms"] >= throughput["tbt_p50_ms"]


def test_rerun_resumes_and_runs_only_missing_points(first_run, monkeypatch):
    folder, path, _ = first_run
    results = folder / "results"
    json_path = results / "tiny-bench.json"
    doc = json.loads(json_path.read_text())
    doc["rows"] = [r for r in doc["rows"] if r["point"] != "offload.mode=hgca"]  # as if interrupted
    json_path.write_text(json.dumps(doc))
    called = []
    real = runner.TASKS["perplexity"]
    monkeypatch.setitem(runner.TASKS, "perplexity",
                        lambda *a, **k: called.append(a[2].key) or real(*a, **k))
    outcome = runner.run_sweep(load_config(str(path)), output_dir=str(results), argv=[],
                               show_progress=False)
    assert called == ["offload.mode=hgca"]
    assert outcome.ran == 1 and outcome.resumed == 4 and not outcome.interrupted
    assert len(json.loads(json_path.read_text())["rows"]) == 5


def test_bench_list_and_bad_config_exit_code(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\noffload: {mode: warp}\n")
    assert cli.main(["bench", str(bad)]) == 2
    assert "offload.mode" in capsys.readouterr().err
    good = tmp_path / "good.yaml"
    good.write_text(CONFIG)
    assert cli.main(["bench", str(good), "--list", "--set", "offload.sink=0"]) == 0
    assert "offload.mode=full" in capsys.readouterr().out


def test_interrupt_keeps_rows_and_rerun_resumes(tmp_path, monkeypatch):
    path = tmp_path / "tiny.yaml"
    path.write_text(CONFIG)
    run = load_config(str(path))
    real = runner.TASKS["perplexity"]

    def interrupted_after_full(model, pretrained, point, on_step=None, deadline=None):
        if point.offload.mode != "full":
            raise KeyboardInterrupt
        return real(model, pretrained, point, on_step)

    monkeypatch.setitem(runner.TASKS, "perplexity", interrupted_after_full)
    outcome = runner.run_sweep(run, output_dir=str(tmp_path), argv=[], show_progress=False)
    assert outcome.interrupted and [r["point"] for r in outcome.rows] == ["offload.mode=full"]
    saved = json.loads((tmp_path / "tiny-bench.json").read_text())["rows"]
    assert [r["point"] for r in saved] == ["offload.mode=full"]
    monkeypatch.setitem(runner.TASKS, "perplexity", lambda *a, **k: [{"task": "perplexity", "mode": "x"}])
    monkeypatch.setitem(runner.TASKS, "throughput", lambda *a, **k: [{"task": "throughput", "mode": "x"}])
    again = runner.run_sweep(run, output_dir=str(tmp_path), argv=[], show_progress=False)
    assert again.resumed == 1 and again.ran == 4 and len(again.rows) == 5  # the stubs never skip


def test_only_runs_a_part_and_parallel_parts_share_one_file(tmp_path, monkeypatch):
    """--only picks points by key; rows another process writes meanwhile are kept (merge on write)."""
    path = tmp_path / "tiny.yaml"
    path.write_text(CONFIG)
    run = load_config(str(path))
    json_path = tmp_path / "tiny-bench.json"

    def row(mode, ppl):
        return {"task": "perplexity", "mode": mode, "text": "random", "tokens": 96, "gpu_ratio": None,
                "window": 48, "beta": 1.0, "budget": None, "ppl": ppl}

    def other_process_writes(model, pretrained, point, on_step=None, deadline=None):
        # Another process finishes the full point while this one is busy with its own point.
        runner._publish(str(json_path), str(tmp_path / "tiny-bench.csv"), "tiny-bench", {}, "other",
                        [{**row("full", 1.0), "point": "offload.mode=full"}])
        return [row(point.offload.mode, 2.0)]

    monkeypatch.setitem(runner.TASKS, "perplexity", other_process_writes)
    outcome = runner.run_sweep(run, output_dir=str(tmp_path), argv=[], show_progress=False,
                               only=["offload.mode=hgca,offload.beta"])
    assert outcome.ran == 1
    saved = {r["point"]: r for r in json.loads(json_path.read_text())["rows"]}
    assert set(saved) == {"offload.mode=full", "offload.mode=hgca,offload.beta=1e-30"}
    assert saved["offload.mode=full"]["ppl"] == 1.0
    # A later run of the whole sweep resumes both parts and runs only the rest.
    called = []
    monkeypatch.setitem(runner.TASKS, "perplexity",
                        lambda model, pretrained, point, **k: called.append(point.key) or [row("x", 3.0)])
    monkeypatch.setitem(runner.TASKS, "throughput", lambda *a, **k: [{"mode": "x"}])
    again = runner.run_sweep(run, output_dir=str(tmp_path), argv=[], show_progress=False)
    assert again.resumed == 2 and "offload.mode=full" not in called
    assert len(json.loads(json_path.read_text())["rows"]) == 5


def test_only_that_matches_nothing_is_an_error(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(CONFIG)
    with pytest.raises(SystemExit, match="matches none"):
        cli.main(["bench", str(path), "--only", "offload.mode=warp"])


def test_hgca_rows_report_the_kept_share(first_run):
    folder, _, _ = first_run
    rows = {r["point"]: r for r in json.loads((folder / "results" / "tiny-bench.json").read_text())["rows"]}
    assert 0.0 <= rows["offload.mode=hgca"]["kept_share"] <= 1.0
    assert rows["offload.mode=hgca,offload.beta=1e-30"]["kept_share"] == 1.0  # keep-everything
    assert "kept_share" not in rows["offload.mode=full"]
