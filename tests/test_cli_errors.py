"""Bad input to the `jhybrid` commands is one line naming the value and what was expected, exit
code 2, and, for `generate`, found before the model loads (issue 33)."""

from __future__ import annotations

import pytest

from jhybrid import cli
from jhybrid.cli import main


@pytest.fixture
def no_load(monkeypatch):
    """Loading a model fails the test: every error here must come before it."""
    monkeypatch.setattr(cli, "_load_with_progress", lambda *a: pytest.fail("the model loaded before the check"))


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: ")
    return err.strip()


@pytest.mark.parametrize("args, message", [
    (["--dtype", "float17"], "--dtype 'float17': unknown; expected one of float32, bfloat16, float16"),
    (["--dtype", "int8"], "--dtype 'int8': not a floating-point dtype; expected one of float32"),
    (["--max-tokens", "0"], "--max-tokens 0; expected >= 1"),
    (["--prefill-chunk", "0"], "--prefill-chunk 0; expected >= 1"),
    (["--mode", "scout", "--beta", "0.5"], "--beta does not apply to --mode scout"),
])
def test_generate_flags_are_checked_before_loading(no_load, capsys, args, message):
    assert main(["generate", *args, "hello"]) == 2
    assert message in one_error_line(capsys)


def test_non_utf8_prompt_bytes_are_one_error(no_load, capsys):
    prompt = b"caf\xe9".decode("utf-8", "surrogateescape")  # what the shell hands Python for Latin-1 bytes
    assert main(["generate", prompt]) == 2
    assert "the prompt is not UTF-8 text (byte 0xe9 at character 3)" in one_error_line(capsys)


@pytest.mark.parametrize("args, message", [
    (["--block-size", "0"], "--block-size 0; expected an integer >= 1"),
    (["--block-size", "-16"], "--block-size -16; expected an integer >= 1"),
    (["--sink", "-3"], "--sink -3; expected an integer >= 0"),
    (["--context", "0"], "--context 0; expected an integer >= 1"),
    (["--batch", "-1"], "--batch -1; expected an integer >= 1"),
    (["--gpu-share", "0"], "--gpu-share 0.0; expected a fraction in (0, 1]"),
    (["--kv-dtype", "int4"], "--kv-dtype int4; expected one of"),
    (["--gpu-mem", "lots"], "--gpu-mem lots: cannot read a memory size"),
    (["--gpu-mem", "1GiB"], "--gpu-mem 1GiB: the weights of llama3-8b (~15.0 GiB) do not fit in 1.0 GiB"),
    (["--gpu-mem", "16GiB", "--reserve", "2GiB"], "the weights of llama3-8b (~15.0 GiB) + --reserve 2.0 GiB do not fit"),
])
def test_budget_flags_are_one_line_errors(capsys, args, message):
    base = {"--model": "llama3-8b", "--context": "8192", "--gpu-mem": "80GiB"}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    assert main(["budget", *[x for kv in base.items() for x in kv]]) == 2
    assert message in one_error_line(capsys)


def test_budget_still_prints_a_sound_request(capsys):
    assert main(["budget", "--model", "llama3-8b", "--context", "8192", "--gpu-mem", "80GiB", "--sink", "0"]) == 0
    assert "window for GPU share" in capsys.readouterr().out


@pytest.mark.parametrize("content, message", [
    ('{"model_type": "llama", "hidden_size": 64}', "field 'vocab_size' is missing (model_type 'llama' needs it)"),
    ('{"model_type": ', "truncated JSON (Expecting value"),
    ("[1]", "holds a JSON list, not an object; expected a Hugging Face config.json"),
    ('{"model_type": "llama", "vocab_size": 10, "hidden_size": "big", "num_hidden_layers": 1, '
     '"num_attention_heads": 2, "max_position_embeddings": 8, "intermediate_size": 8}', "wrong type or range"),
])
def test_budget_of_a_bad_config_json_names_the_file(tmp_path, capsys, content, message):
    path = tmp_path / "config.json"
    path.write_text(content)
    assert main(["budget", "--model", str(path), "--context", "1024", "--gpu-mem", "80GiB"]) == 2
    err = one_error_line(capsys)
    assert err.startswith(f"error: {path}: ") and message in err


def test_load_pretrained_checks_the_dtype_first(tmp_path):
    from jhybrid.loading.pretrained import load_pretrained

    with pytest.raises(ValueError, match="dtype 'int8': not a floating-point dtype"):
        load_pretrained(str(tmp_path / "nothing-here"), dtype="int8")
