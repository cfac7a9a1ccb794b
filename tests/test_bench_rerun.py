"""`jhybrid bench` reruns and inputs (issue 33): a rerun with another setting adds rows beside those
measured with the old one and reruns only the points whose configuration changed; a --set on a key
the sweep sets is refused; damaged results files, unusable texts and config.json files are one-line
errors before any model loads; Ctrl-C stops a point at its next step and exits 130."""

from __future__ import annotations

import json
import os
import signal

import pytest

from jhybrid import cli
from jhybrid.bench import runner
from jhybrid.config import ConfigError, load_config

CONFIG = """
name: rerun
model: {name: tiny}
offload: {window_tokens: 48, sink: 16, block_size: 16, host_threads: 1}
benchmark: {tokens: 96, scored_tokens: 16, prefill_chunk: 16}
sweep:
  - {offload.mode: [full, hgca, topk]}
"""


def row(point) -> dict:
    """A perplexity row of a point, as the task would write it (nothing measured)."""
    return {"task": "perplexity", "mode": point.offload.mode, "text": "random", "tokens": 96, "window": 48,
            "gpu_ratio": None, "beta": point.offload.beta, "ppl": 1.0}


def fake_task(calls):
    """A perplexity task that records the points it runs and measures nothing."""
    def task(model, pretrained, point, on_step=None, deadline=None):
        calls.append(point.key)
        return [row(point)]
    return task


@pytest.fixture
def sweep(tmp_path, monkeypatch):
    """(config path, results folder, list of the point keys each run ran); no model is built."""
    path = tmp_path / "rerun.yaml"
    path.write_text(CONFIG)
    calls: list = []
    monkeypatch.setattr(runner, "load_model", lambda spec, tp=1: (None, None))
    monkeypatch.setitem(runner.TASKS, "perplexity", fake_task(calls))
    return str(path), str(tmp_path / "out"), calls


def rows_of(folder):
    return json.loads(open(os.path.join(folder, "rerun.json")).read())["rows"]


def run(path, out, overrides=()):
    return runner.run_sweep(load_config(path, list(overrides)), output_dir=out, argv=[], show_progress=False)


def test_rerun_with_another_setting_keeps_both_and_reruns_only_points_that_read_it(sweep):
    path, out, calls = sweep
    run(path, out)
    assert calls == ["offload.mode=full", "offload.mode=hgca", "offload.mode=topk"]
    calls.clear()
    outcome = run(path, out, ["offload.beta=0.5"])
    assert calls == ["offload.mode=hgca"]  # full and topk never read beta: their rows stand
    assert outcome.resumed == 2 and outcome.ran == 1
    rows = rows_of(out)
    hgca = [r for r in rows if r["point"] == "offload.mode=hgca"]
    assert sorted(r["beta"] for r in hgca) == [0.5, 1.0]  # both kept, each under its own configuration
    doc = json.loads(open(os.path.join(out, "rerun.json")).read())
    assert {doc["configs"][r["config_hash"]]["offload"]["beta"] for r in hgca} == {0.5, 1.0}
    calls.clear()
    run(path, out, ["offload.beta=0.5"])  # the same settings again: nothing to run
    run(path, out)
    assert calls == [] and len(rows_of(out)) == 4


def test_a_rerun_of_the_same_settings_replaces_its_own_error_rows(sweep, monkeypatch):
    path, out, calls = sweep

    def broken(model, pretrained, point, on_step=None, deadline=None):
        raise RuntimeError("flaky")

    monkeypatch.setitem(runner.TASKS, "perplexity", broken)
    run(path, out)
    assert all("error" in r for r in rows_of(out))
    monkeypatch.setitem(runner.TASKS, "perplexity", fake_task(calls))
    run(path, out)
    assert len(calls) == 3 and not any("error" in r for r in rows_of(out)) and len(rows_of(out)) == 3


def test_rows_hashed_with_ignored_settings_still_count_as_done(sweep):
    """Results written before ignored settings were left out of the hash resume as before."""
    path, out, calls = sweep
    run(path, out)
    doc = json.loads(open(os.path.join(out, "rerun.json")).read())
    points = {p.key: p for p in runner.expand_sweep(load_config(path))}
    for row in doc["rows"]:
        row["config_hash"] = runner.legacy_config_hash(points[row["point"]])
    assert runner.legacy_config_hash(points["offload.mode=full"]) != runner.point_config_hash(points["offload.mode=full"])
    open(os.path.join(out, "rerun.json"), "w").write(json.dumps(doc))
    calls.clear()
    assert run(path, out).resumed == 3 and calls == []


def test_set_on_a_swept_key_is_refused_naming_it(sweep, capsys):
    path, _, _ = sweep
    with pytest.raises(ConfigError, match="--set offload.mode: the sweep sets offload.mode"):
        load_config(path, ["offload.mode=hgca"])
    assert cli.main(["bench", path, "--list", "--set", "offload.mode=hgca"]) == 2
    assert "--set offload.mode" in capsys.readouterr().err


@pytest.mark.parametrize("content, message", [
    ("[1, 2]", "holds a JSON list, not an object with 'rows'"),
    ('{"rows": [{"point": "x"}, ', "truncated JSON (Expecting value at line 1 column"),
    ('{"rows": 3}', "'rows' is not a list of objects"),
])
def test_damaged_results_file_is_an_error_before_any_point(sweep, content, message, capsys):
    path, out, calls = sweep
    os.makedirs(out)
    with open(os.path.join(out, "rerun.json"), "w") as f:
        f.write(content)
    assert cli.main(["bench", path, "--output-dir", out]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {out}/rerun.json: ") and message in err
    assert len(err.strip().splitlines()) == 1 and calls == []


def test_ignored_yaml_setting_is_refused_like_the_cli_flag(tmp_path, capsys):
    path = tmp_path / "scout.yaml"
    path.write_text("name: x\nmodel: tiny\noffload: {mode: scout, beta: 0.5}\n")
    with pytest.raises(ConfigError, match=r"'offload.beta' = 0.5 is not read by offload.mode scout"):
        load_config(str(path))
    swept = tmp_path / "swept.yaml"  # a group's value no point of the group reads: a warning only
    swept.write_text("name: x\nmodel: tiny\nsweep: [{offload.mode: [full, hgca], offload.budget: 64}]\n")
    load_config(str(swept))


def test_model_string_and_binary_yaml(tmp_path):
    short = tmp_path / "short.yaml"
    short.write_text("name: x\nmodel: tiny\n")
    assert load_config(str(short)).model.name == "tiny"
    binary = tmp_path / "blob.yaml"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    with pytest.raises(ConfigError, match=f"{binary}: not UTF-8 text .*expected a YAML run config"):
        load_config(str(binary))
    listed = tmp_path / "list.yaml"
    listed.write_text("name: x\noffload: [hgca]\n")
    with pytest.raises(ConfigError, match=r"'offload' = \['hgca'\]: expected a mapping"):
        load_config(str(listed))


@pytest.mark.parametrize("content, message", [
    ('{"model_type": "llama", "hidden_size": 64}', "field 'vocab_size' is missing"),
    ('{"model_type": ', "truncated JSON"),
    ('{"model_type": llama}', "not valid JSON"),
    ("[1]", "holds a JSON list, not an object"),
])
def test_bad_config_json_model_is_found_before_any_point(tmp_path, monkeypatch, content, message, capsys):
    model = tmp_path / "config.json"
    model.write_text(content)
    path = tmp_path / "shape.yaml"
    path.write_text(CONFIG.replace("model: {name: tiny}", f"model: {{name: {model}}}"))
    monkeypatch.setattr(runner, "load_model", lambda spec, tp=1: pytest.fail("loaded before checking"))
    assert cli.main(["bench", str(path), "--output-dir", str(tmp_path / "out")]) == 2
    assert f"error: {model}: {message}" in capsys.readouterr().err


def test_unusable_own_text_is_found_before_the_model_loads(tmp_path, monkeypatch, capsys):
    pytest.importorskip("gguf")
    monkeypatch.setattr(runner, "load_model", lambda spec, tp=1: pytest.fail("loaded before checking"))
    short = tmp_path / "short.txt"
    short.write_text("Only a few words.")
    binary = tmp_path / "latin1.txt"
    binary.write_bytes("caf\xe9 au lait ".encode("latin-1") * 50)
    for text, message in ((short, f"text '{short}' has only"), (binary, f"{binary}: not UTF-8 text (byte 0xe9 at offset 3)")):
        path = tmp_path / "own.yaml"
        path.write_text(f"name: own\nmodel: smollm2\nbenchmark: {{text: {text}, tokens: 256, scored_tokens: 16}}\n")
        assert cli.main(["bench", str(path), "--output-dir", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: point base: ") and message in err and len(err.splitlines()) == 1


def test_ctrl_c_stops_a_point_at_its_next_step_and_exits_130(sweep, monkeypatch, capsys, sigint_raises):
    """SIGINT arrives in the middle of a point's steps: the point stops at its next step (not inside
    one), the rows measured so far stay, and the command exits 130 with nothing after the summary."""
    path, out, calls = sweep
    steps = []

    def stepping(model, pretrained, point, on_step=None, deadline=None):
        calls.append(point.key)
        for step in range(50):
            if point.offload.mode == "hgca" and step == 3:
                os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, as the terminal sends it
            steps.append((point.key, step))
            on_step(step + 1, 50)
        return [row(point)]

    monkeypatch.setitem(runner.TASKS, "perplexity", stepping)
    assert cli.main(["bench", path, "--output-dir", out]) == 130
    err = capsys.readouterr().err
    assert steps[-1] == ("offload.mode=hgca", 3)  # stopped at the step after the interrupt
    assert calls == ["offload.mode=full", "offload.mode=hgca"]
    assert [r["point"] for r in rows_of(out)] == ["offload.mode=full"]
    assert "interrupted" in err and "Traceback" not in err and "error" not in err.lower()
    assert err.rstrip().splitlines()[-1].startswith("1 points run")  # the last line is the summary
