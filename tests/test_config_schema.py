"""Run-config schema: YAML loading, validation errors that name the key, overrides, sweeps."""

from __future__ import annotations

import glob
import os

import pytest

from jhybrid.config import ConfigError, expand_sweep, load_config, parse_override
from jhybrid.config.loading import config_from_dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


def test_minimal_config_defaults(tmp_path):
    run = load_config(write(tmp_path, "name: x\n"))
    assert run.offload.mode == "full" and run.benchmark.task == "perplexity"
    assert [p.key for p in expand_sweep(run)] == ["base"]


@pytest.mark.parametrize("text, names", [
    ("name: x\noffload: {windw: 3}\n", ["offload.windw", "window_tokens", "gpu_ratio"]),
    ("name: x\nmodle: {name: tiny}\n", ["modle", "model", "offload", "sweep"]),
    ("name: x\nsweep: [{offload.bogus: [1, 2]}]\n", ["offload.bogus", "offload.mode"]),
    ("name: x\nsweep: [{nosection: [1]}]\n", ["nosection", "benchmark.task"]),
])
def test_unknown_keys_are_errors_that_list_allowed_keys(tmp_path, text, names):
    with pytest.raises(ConfigError) as error:
        load_config(write(tmp_path, text))
    for name in names:
        assert name in str(error.value)


@pytest.mark.parametrize("text, names", [
    ("name: x\noffload: {mode: fast}\n", ["offload.mode", "'fast'", "hgca", "scout"]),
    ("name: x\noffload: {sink: many}\n", ["offload.sink", "int"]),
    ("name: x\noffload: {gpu_ratio: 1.5}\n", ["offload.gpu_ratio", "(0, 1]"]),
    ("name: x\noffload: {gpu_ratio: 0.5, window_tokens: 64}\n", ["window_tokens", "gpu_ratio", "exclusive"]),
    ("name: x\noffload: {keep_after: -2}\n", ["offload.keep_after", ">= 0"]),
    ("name: x\noffload: {prefill_offloaded: gpu}\n", ["offload.prefill_offloaded", "'gpu'", "device", "host"]),
    ("name: x\nbenchmark: {prefill_repeats: 0}\n", ["benchmark.prefill_repeats", "positive"]),
    ("name: x\nbenchmark: {task: speed}\n", ["benchmark.task", "perplexity", "niah", "throughput"]),
    ("name: x\nbenchmark: {tokens: -4}\n", ["benchmark.tokens", "positive"]),
    ("name: x\nsweep: [{offload.beta: [0.5, -1]}]\n", ["offload.beta", "-1"]),  # a bad sweep value
    ("name: x\nsweep: [{offload.mode: []}]\n", ["offload.mode", "empty"]),
    ("offload: {mode: hgca}\n", ["'name' is required"]),
    ("- just\n- a list\n", ["mapping"]),
])
def test_bad_values_name_the_key_and_allowed_values(tmp_path, text, names):
    with pytest.raises(ConfigError) as error:
        load_config(write(tmp_path, text))
    for name in names:
        assert name in str(error.value)


def test_invalid_yaml_says_so_with_the_file(tmp_path):
    path = write(tmp_path, "name: x\noffload: {mode: hgca\n")
    with pytest.raises(ConfigError, match="invalid YAML") as error:
        load_config(path)
    assert path in str(error.value)


def test_overrides_are_yaml_values():
    assert parse_override("offload.beta=0.5") == ("offload.beta", 0.5)
    assert parse_override("offload.budget=null") == ("offload.budget", None)
    run = config_from_dict({"name": "x"}, ["offload.mode=hgca", "offload.gpu_ratio=0.5"])
    assert run.offload.mode == "hgca" and run.offload.gpu_ratio == 0.5
    with pytest.raises(ConfigError, match="offload.nope"):
        config_from_dict({"name": "x"}, ["offload.nope=1"])
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_override("offload.beta")


def test_sweep_groups_are_cartesian_products_run_in_order():
    run = config_from_dict({"name": "x", "offload": {"gpu_ratio": 0.25}, "sweep": [
        {"offload.mode": "full"},
        {"offload.mode": "hgca", "offload.gpu_ratio": [0.25, 0.5], "offload.beta": [0.5, 1.0]},
        {"offload.mode": "full"},  # duplicate: kept once
    ]})
    points = expand_sweep(run)
    assert [p.key for p in points] == [
        "offload.mode=full",
        "offload.mode=hgca,offload.gpu_ratio=0.25,offload.beta=0.5",
        "offload.mode=hgca,offload.gpu_ratio=0.25,offload.beta=1.0",
        "offload.mode=hgca,offload.gpu_ratio=0.5,offload.beta=0.5",
        "offload.mode=hgca,offload.gpu_ratio=0.5,offload.beta=1.0",
    ]
    assert points[4].offload.gpu_ratio == 0.5 and points[4].offload.beta == 1.0
    assert points[0].offload.gpu_ratio == 0.25  # the base value where the group does not say
    single = config_from_dict({"name": "x", "sweep": {"benchmark.batch": [1, 2, 4]}})
    assert [p.benchmark.batch for p in expand_sweep(single)] == [1, 2, 4]


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))))
def test_shipped_configs_load(path):
    assert expand_sweep(load_config(path))


def test_text_is_a_builtin_name_or_the_users_own_file(tmp_path):
    from types import SimpleNamespace

    from jhybrid.bench.texts import load_text, text_tokens

    mine = tmp_path / "notes.txt"
    mine.write_text("my own words, " * 50, encoding="utf-8")
    run = load_config(write(tmp_path, f"name: x\nbenchmark: {{text: {mine}}}\n"))
    assert run.benchmark.text == str(mine)
    chars = SimpleNamespace(encode=lambda s: [ord(c) for c in s])
    assert text_tokens(chars, str(mine), 20).tolist() == [ord(c) for c in ("my own words, " * 2)[:20]]
    with pytest.raises(ValueError, match="has only 700 tokens; expected at least 5000"):
        text_tokens(chars, str(mine), 5000)
    with pytest.raises(ConfigError, match=r"'benchmark.text' = 'nope.txt': expected one of paul_graham, squad "
                                          r"or the path of a UTF-8 text file \(no such file\)"):
        load_config(write(tmp_path, "name: x\nbenchmark: {text: nope.txt}\n"))
    binary = tmp_path / "blob.txt"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ValueError, match="blob.txt: not UTF-8 text .*expected a UTF-8 plain-text file"):
        load_text(str(binary))
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(ValueError, match="is empty"):
        load_text(str(empty))
