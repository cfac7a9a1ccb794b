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
    assert set(full) >= {"mode", "text", "tokens", "gpu_ratio", "ppl"}
    assert "beta" not in full and "budget" not in full  # a mode's columns only where the mode reads them
    assert rows["offload.mode=hgca,offload.beta=1e-30"]["beta"] == 1e-30
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
    # the missing point, and the skipped one (its cause may be gone); measured points are kept
    assert sorted(called) == ["offload.mode=hgca", "offload.mode=topk,offload.budget=4096"]
    assert outcome.ran == 1 and outcome.skipped == 1 and outcome.resumed == 3 and not outcome.interrupted
    assert len(json.loads(json_path.read_text())["rows"]) == 5


def test_rerun_with_a_changed_setting_runs_again_and_rows_keep_their_config(first_run, monkeypatch, tmp_path):
    folder, path, _ = first_run
    results = tmp_path / "results"
    import shutil
    shutil.copytree(folder / "results", results)
    called = []
    real = runner.TASKS["perplexity"]
    monkeypatch.setitem(runner.TASKS, "perplexity", lambda *a, **k: called.append(a[2].key) or real(*a, **k))
    before = json.loads((results / "tiny-bench.json").read_text())
    run = load_config(str(path), overrides=["benchmark.scored_tokens=24"])
    only_full = runner.run_sweep(run, output_dir=str(results), argv=[], only=["offload.mode=full"],
                                 show_progress=False)
    # same keys, new config: both points whose key contains the filter run again
    assert called == ["offload.mode=full"] and only_full.ran == 2
    doc = json.loads((results / "tiny-bench.json").read_text())
    hashes = {r["point"]: r["config_hash"] for r in doc["rows"]}
    old = {r["point"]: r["config_hash"] for r in before["rows"]}
    assert hashes["offload.mode=full"] != old["offload.mode=full"]
    assert hashes["offload.mode=hgca"] == old["offload.mode=hgca"]  # not rerun: its own config kept
    assert doc["configs"][hashes["offload.mode=full"]]["benchmark"]["scored_tokens"] == 24
    assert doc["configs"][hashes["offload.mode=hgca"]]["benchmark"]["scored_tokens"] != 24
    # the rows measured with the old setting stay beside the new ones (keyed by point and config)
    full = [r["config_hash"] for r in doc["rows"] if r["point"] == "offload.mode=full"]
    assert sorted(full) == sorted([old["offload.mode=full"], hashes["offload.mode=full"]])
    assert len(doc["rows"]) == len(before["rows"]) + 2


def test_bench_exits_non_zero_when_a_point_fails_and_checks_models_first(tmp_path, monkeypatch, capsys):
    path = tmp_path / "tiny.yaml"
    path.write_text(CONFIG)

    def boom(model, pretrained, point, on_step=None, deadline=None):
        raise RuntimeError("the kernel fell over")

    monkeypatch.setitem(runner.TASKS, "perplexity", boom)
    assert cli.main(["bench", str(path), "--output-dir", str(tmp_path / "out"), "--only", "offload.mode=full"]) == 1
    err = capsys.readouterr().err
    assert "1 failed" in err and "offload.mode=full: RuntimeError: the kernel fell over" in err
    monkeypatch.undo()
    bad = tmp_path / "bad-model.yaml"
    bad.write_text(CONFIG.replace("model: {name: tiny}", "model: {name: no-such-model}"))
    calls = []
    monkeypatch.setattr(runner, "load_model", lambda spec, tp=1: calls.append(spec))
    assert cli.main(["bench", str(bad), "--output-dir", str(tmp_path / "out2")]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err and not calls
    blocked = tmp_path / "file-not-folder"
    blocked.write_text("x")
    assert cli.main(["bench", str(path), "--output-dir", str(blocked / "sub")]) == 2
    assert "is not writable" in capsys.readouterr().err


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
        full = next(p for p in runner.expand_sweep(run) if p.key == "offload.mode=full")
        runner._publish(str(json_path), str(tmp_path / "tiny-bench.csv"), "tiny-bench", {}, "other",
                        [{**row("full", 1.0), "point": full.key,
                          "config_hash": runner.point_config_hash(full)}],
                        {runner.point_config_hash(full): runner.point_config(full)})
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


def test_summary_fits_100_columns_and_leaves_out_empty_columns():
    """A 32-layer throughput sweep's rows (every field the runner writes) print without truncation
    at 100 columns; columns empty in every row (CPU: no GPU idle share) are left out."""
    import io

    from rich.console import Console

    from jhybrid.bench.results import print_summary

    path = "benchmarks/results/throughput-h100-l32-int8.json"
    rows = [r for r in json.loads(open(path).read())["rows"]]
    assert any(not r.get("skipped") for r in rows) and len(rows[0]) > 30
    for r in rows:
        r.pop("gpu_idle_frac", None)
    out = io.StringIO()
    print_summary(rows, Console(file=out, width=100, force_terminal=False))
    text = out.getvalue()
    assert max(len(line) for line in text.splitlines()) <= 100
    assert "…" not in text  # nothing cut (long points and reasons wrap)
    assert "GPU idle" not in text and "tok/s" in text and "host kv" in text and "int8" in text


def test_perplexity_plot_puts_only_hgca_beta_sweeps_on_a_beta_axis(tmp_path):
    from jhybrid.bench.plots import _beta_sweeps, plot_perplexity

    def row(mode, ppl, beta=None, ratio=0.25):
        return {"task": "perplexity", "text": "t", "tokens": 64, "mode": mode, "ppl": ppl, "beta": beta,
                "gpu_ratio": ratio, "window": 16, "point": f"offload.mode={mode}"}

    rows = [row("full", 10.0, ratio=None), row("scout", 11.0), row("hgca", 12.0, beta=1.0)]
    assert _beta_sweeps(rows) == {}  # one beta is no sweep: every row is a labelled bar only
    swept = rows + [row("hgca", 11.5, beta=0.5), row("hgca", 13.0, beta=1.0, ratio=0.5)]
    assert {k: [r["beta"] for r in g] for k, g in _beta_sweeps(swept).items()} == {"hgca ratio 0.25": [0.5, 1.0]}
    assert plot_perplexity(swept, str(tmp_path / "p.png")) and (tmp_path / "p.png").stat().st_size > 1000


def test_a_run_killed_during_a_point_leaves_a_trace_the_next_run_reports(tmp_path):
    """kill -9 (as the kernel's OOM killer does) in the middle of a point: no row could be written,
    so the next run names the point it died in, records an error row, and runs it again."""
    import subprocess
    import sys
    import textwrap

    path = tmp_path / "tiny.yaml"
    path.write_text(CONFIG)
    script = textwrap.dedent(f"""
        import os, signal
        from jhybrid.bench import runner
        from jhybrid.config import load_config
        runner.load_model = lambda spec, tp=1: (None, None)
        def die(*a, **k):
            os.kill(os.getpid(), signal.SIGKILL)
        runner.TASKS["perplexity"] = die
        runner.run_sweep(load_config({str(path)!r}), output_dir={str(tmp_path)!r}, argv=[],
                         show_progress=False, only=["offload.mode=full"])
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=".", capture_output=True, text=True, timeout=300)
    assert done.returncode == -9, done.stderr[-2000:]
    markers = list(tmp_path.glob("tiny-bench.running.*.json"))
    assert len(markers) == 1 and json.loads(markers[0].read_text())["point"] == "offload.mode=full"

    import io

    from rich.console import Console

    out = io.StringIO()
    seen = []
    real = runner.TASKS["perplexity"]
    try:
        runner.TASKS["perplexity"] = lambda model, pretrained, point, **k: seen.append(point.key) or [
            {"task": "perplexity", "mode": point.offload.mode, "text": "random", "tokens": 96, "ppl": 1.0}]
        runner.load_model, old_load = (lambda spec, tp=1: (None, None)), runner.load_model
        outcome = runner.run_sweep(load_config(str(path)), output_dir=str(tmp_path), argv=[], show_progress=False,
                                   only=["offload.mode=hgca,offload.beta"], console=Console(file=out, width=200))
    finally:
        runner.TASKS["perplexity"] = real
        runner.load_model = old_load
    text = out.getvalue()
    assert "the previous run died during offload.mode=full" in text and "died during this point" in text
    assert seen == ["offload.mode=hgca,offload.beta=1e-30"] and outcome.ran == 1
    rows = {r["point"]: r for r in json.loads((tmp_path / "tiny-bench.json").read_text())["rows"]}
    assert "killed from outside" in rows["offload.mode=full"]["error"]  # the trace stays until it reruns
    assert not list(tmp_path.glob("tiny-bench.running.*"))


def test_summary_shortens_long_niah_answers_to_fit_100_columns():
    """A 40-token NIAH answer is cut in the printed summary (the CSV / JSON keep it whole)."""
    import io

    from rich.console import Console

    from jhybrid.bench.results import print_summary

    answer = "9410201, 9410202, 9410203, 9410204, 9410205, 9410206, 9410207\n\nQuestion: what else"
    rows = [{"task": "niah", "mode": mode, "style": "multivalue", "length": 32768, "depth": 0.25,
             "window": 8192, "retrieved": False, "answer": answer} for mode in ("full", "hgca")]
    out = io.StringIO()
    print_summary(rows, Console(file=out, width=100, force_terminal=False))
    lines = out.getvalue().splitlines()
    assert max(len(line) for line in lines) <= 100
    assert sum("9410201, 9410202" in line and "…" in line for line in lines) == 2


def test_niah_heat_maps_wrap_into_rows_and_show_found_shares(tmp_path):
    """One depth x length panel per configuration and style, at most 6 per row; multivalue cells show
    the share of the numbers found."""
    import matplotlib.image

    from jhybrid.bench.plots import plot_niah

    rows = [{"task": "niah", "mode": mode, "style": style, "length": n, "depth": d, "retrieved": False,
             "found": 0.5 if style == "multivalue" else 0.0, "point": f"offload.mode={mode}"}
            for mode in ("full", "hgca", "scout", "topk") for style in ("multikey", "multivalue")
            for n in (4096, 8192) for d in (0.25, 0.75)]
    path = plot_niah(rows, str(tmp_path / "niah.png"))
    height, width, _ = matplotlib.image.imread(path).shape
    assert height > 0.3 * width  # 8 panels: two rows of 6 and 2, not one strip


def test_niah_panels_keep_each_kept_share_cap_apart():
    """Rows that differ only in hgca's kept-share cap get their own heat-map panel (they were merged,
    the last cap's cells drawn over the others')."""
    from jhybrid.bench.plots import _tag

    base = {"task": "niah", "mode": "hgca", "style": "multikey", "gpu_ratio": 0.25, "beta": 1.0,
            "point": "offload.mode=hgca"}
    tags = {_tag({**base, "max_keep_share": cap}) for cap in (None, 0.1, 0.03, 0.0125)}
    assert len(tags) == 4
    assert "cap0.03" in _tag({**base, "max_keep_share": 0.03})


def test_throughput_lines_keep_hgca_spans_apart():
    """hgca rows with keep_after spans are their own line (the point string carries the setting)."""
    from jhybrid.bench.plots import _variant

    assert _variant({"mode": "hgca", "point": "offload.mode=hgca,offload.keep_after=8"}) == "hgca span8"
    assert _variant({"mode": "hgca", "point": "offload.mode=hgca,offload.keep_after=0"}) == "hgca"
    assert _variant({"mode": "scout", "point": "offload.mode=scout", "keep_after": None}) == "scout"
