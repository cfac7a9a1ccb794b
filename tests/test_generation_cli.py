"""The `jhybrid generate` command (README command 1) on the embedded SmolLM2."""

from __future__ import annotations

import pytest

from jhybrid.cli import main


def test_invalid_sampling_parameter_is_reported(capsys):
    assert main(["generate", "--top-p", "0", "hello"]) == 2
    assert "top_p" in capsys.readouterr().err


def test_unknown_model_is_reported(capsys):
    assert main(["generate", "--model", "/no/such/model", "hello"]) == 2
    assert "/no/such/model" in capsys.readouterr().err


def test_generate_streams_text_and_speeds(capsys):
    pytest.importorskip("gguf")
    assert main(["generate", "--max-tokens", "12", "What is the capital of France?"]) == 0
    captured = capsys.readouterr()
    assert "Paris" in captured.out
    assert "prefill" in captured.err and "decode" in captured.err and "tok/s" in captured.err
