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


def test_generate_streams_text_and_speeds(capsys, smollm2_cli):
    assert main(["generate", "--max-tokens", "12", "What is the capital of France?"]) == 0
    captured = capsys.readouterr()
    assert "Paris" in captured.out
    assert "prefill" in captured.err and "decode" in captured.err and "tok/s" in captured.err


def test_lengths_are_checked_against_the_model_context(capsys, short_smollm2_cli):
    assert main(["generate", "--max-tokens", "9000", "hello"]) == 2
    err = capsys.readouterr().err
    assert "--max-tokens 9000" in err and "context of 8192" in err and "Traceback" not in err
    assert main(["generate", "--mode", "hgca", "--window-tokens", "9232", "--max-tokens", "4", "hello"]) == 2
    assert "--window-tokens 9232; expected at most the model's context of 8192" in capsys.readouterr().err


def test_ctrl_c_in_generate_prints_what_was_made(capsys, monkeypatch, short_smollm2_cli):
    """(SmolLM2 cut to 2 layers: its tokenizer streams the text; the weights are never run.)"""
    import numpy as np

    from jhybrid import generation

    def interrupted(self, prompts, max_new_tokens=64, sampling=None, stop_tokens=(), on_tokens=None):
        for token in (504, 3575):  # two tokens stream, then the user presses Ctrl-C
            on_tokens(np.array([token]), np.array([True]))
        raise KeyboardInterrupt

    monkeypatch.setattr(generation.Generator, "generate", interrupted)
    assert main(["generate", "--max-tokens", "8", "hello"]) == 130
    captured = capsys.readouterr()
    assert "[interrupted: 2 tokens in" in captured.err and "Traceback" not in captured.err
    assert captured.out  # the streamed text stays


def test_convert_onto_an_existing_path_is_refused_before_loading(tmp_path, capsys, monkeypatch):
    from jhybrid import cli

    monkeypatch.setattr(cli, "_load_with_progress", lambda *a: pytest.fail("loaded before checking"))
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "file").write_text("x")
    assert main(["convert", "smollm2", str(taken)]) == 2
    assert f"output '{taken}' exists; expected a new or empty folder" in capsys.readouterr().err
    assert (taken / "file").read_text() == "x"


def test_out_of_vocabulary_prompt_ids_are_an_error():
    from jhybrid.generation import Generator
    from jhybrid.models import create_model
    from tests.hybrid_support import TINY

    generator = Generator(create_model(TINY, seed=0))
    with pytest.raises(ValueError, match=rf"prompt 1 token 2 is id {TINY.vocab_size}; expected ids in \[0, {TINY.vocab_size}\)"):
        generator.generate([[1, 2, 3], [4, 5, TINY.vocab_size]], max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt 0 token 0 is id -1"):
        generator.generate([[-1, 2]], max_new_tokens=2)


def test_generator_closes_the_backend_it_opened():
    """`with Generator(...)` closes its backend's host side however the block ends; the backend
    object opens again for a later generate."""
    from jhybrid.generation import Generator
    from jhybrid.hybrid import make_backend
    from jhybrid.models import create_model
    from tests.hybrid_support import KEEP_ALL, TINY

    model, backend = create_model(TINY, seed=0), make_backend("hgca", **KEEP_ALL)
    prompt = [list(range(1, 61))]
    with Generator(model, backend, prefill_chunk=16) as generator:
        first = generator.generate(prompt, max_new_tokens=3).tokens
        assert backend.runtime is not None  # left open for its counters until the block ends
    assert backend.runtime is None
    with pytest.raises(ZeroDivisionError):
        with Generator(model, backend, prefill_chunk=16) as generator:
            assert generator.generate(prompt, max_new_tokens=3).tokens == first
            1 / 0
    assert backend.runtime is None
    generator.close()  # twice: a no-op


def test_ctrl_c_in_hgca_generate_stops_cleanly(capsys, caplog, monkeypatch, sigint_raises, short_smollm2_cli):
    """SIGINT in the middle of an hgca decode: the step in flight finishes, the command stops at the
    next step, closes the backend (no "host exchange failed"), prints one line and exits 130 (SmolLM2
    cut to 2 layers: the 30 real ones only add compile time)."""
    import os
    import signal

    from jhybrid import generation, hybrid

    backends = []
    real_make, real_before = hybrid.make_backend, generation.Generator._before_step
    monkeypatch.setattr(hybrid, "make_backend", lambda *a, **k: backends.append(real_make(*a, **k)) or backends[-1])
    steps = []

    def before_step(self, cache, positions):
        steps.append(positions.shape[1])
        if len(steps) == 3:  # the second decode step is about to start: the user presses Ctrl-C
            os.kill(os.getpid(), signal.SIGINT)
        return real_before(self, cache, positions)

    monkeypatch.setattr(generation.Generator, "_before_step", before_step)
    with caplog.at_level("WARNING"):
        rc = main(["generate", "--mode", "hgca", "--window-tokens", "48", "--sink", "16", "--block-size", "16",
                   "--max-tokens", "40", "hello"])
    err = capsys.readouterr().err
    assert rc == 130 and len(steps) == 3  # no step started after the interrupt
    assert "[interrupted: 2 tokens in" in err and "Traceback" not in err
    assert "host exchange failed" not in err + caplog.text
    assert backends and backends[0].runtime is None  # closed
