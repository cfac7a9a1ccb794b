"""NIAH prompts in RULER's styles (single, multikey, multivalue) on SmolLM2's tokenizer, and a run
through the hybrid path that scores what the answer holds."""

from __future__ import annotations

import numpy as np
import pytest

from jhybrid.bench.niah import KEYS, build_prompt, make_needles, run_niah
from jhybrid.bench.offload import PointSkipped
from jhybrid.config import ConfigError, expand_sweep
from jhybrid.config.loading import config_from_dict


def _find(prompt: list[int], part: list[int]) -> list[int]:
    return [i for i in range(len(prompt) - len(part) + 1) if prompt[i:i + len(part)] == part]


@pytest.mark.parametrize("style", ["single", "multikey", "multivalue"])
@pytest.mark.parametrize("length,depth", [(512, 0.0), (700, 0.25), (1024, 1.0)])
def test_prompt_holds_each_needle_once_in_depth_order(smollm2, style, length, depth):
    prompt, spec = build_prompt(smollm2, "paul_graham", length, depth, style, needles=3)
    assert len(prompt) == length
    starts = []
    for sentence in spec.sentences:
        at = _find(prompt, smollm2.tokenizer.encode(sentence).ids)
        assert len(at) == 1, sentence
        starts.append(at[0])
    order = np.argsort(spec.depths, kind="stable")
    assert list(np.array(starts)[order]) == sorted(starts)  # deeper needles come later
    assert len(_find(prompt, smollm2.tokenizer.encode(spec.question).ids)) == 1
    assert prompt[-len(smollm2.tokenizer.encode(spec.question).ids):] == smollm2.tokenizer.encode(spec.question).ids
    if depth == 0.0:
        assert starts[0] <= 1  # the very start (after BOS, if any)


def test_styles_ask_the_right_numbers():
    single = make_needles("single", 2048, 0.5)
    # the single needle's number is the one of the earlier single-style rows (seed: length, depth)
    assert single.expected == [int(np.random.default_rng([2048, 500]).integers(1_000_000, 10_000_000))]
    multikey = make_needles("multikey", 2048, 0.5, needles=4)
    asked = multikey.question.split(" for ")[1].split(" mentioned")[0]
    assert asked in KEYS and asked in multikey.sentences[0] and str(multikey.expected[0]) in multikey.sentences[0]
    assert len(multikey.expected) == 1 and len({s.split(" for ")[1].split(" is")[0] for s in multikey.sentences}) == 4
    multivalue = make_needles("multivalue", 2048, 0.5, needles=4)
    assert len(set(multivalue.expected)) == 4
    assert all(str(n) in s for n, s in zip(multivalue.expected, multivalue.sentences))
    assert make_needles("multikey", 2048, 0.5, 4) == multikey  # every mode sees the same prompt


def test_bad_styles_and_counts_are_clear_errors(smollm2):
    with pytest.raises(ValueError, match="niah_style 'many'"):
        make_needles("many", 1024, 0.5)
    with pytest.raises(ValueError, match="niah_needles = 1"):
        make_needles("multivalue", 1024, 0.5, needles=1)
    with pytest.raises(PointSkipped, match="no room for a haystack"):
        build_prompt(smollm2, "paul_graham", 60, 0.5, "multivalue", needles=4)
    with pytest.raises(ConfigError, match="niah_style"):
        config_from_dict({"name": "x", "benchmark": {"task": "niah", "niah_style": "multi"}})


def test_multivalue_run_scores_the_share_of_numbers_found(smollm2):
    """Full attention over a short multivalue prompt: the row's `found` is the share of the asked
    numbers the decoded answer holds, and `retrieved` is all of them."""
    run = config_from_dict({"name": "t", "model": {"name": "smollm2"}, "offload": {"mode": "full"},
                            "benchmark": {"task": "niah", "niah_length": 384, "niah_depth": 0.3,
                                          "niah_style": "multivalue", "niah_needles": 2,
                                          "answer_tokens": 24, "prefill_chunk": 128}})
    row = run_niah(smollm2.model, smollm2, expand_sweep(run)[0])[0]
    digits = row["answer"].replace(" ", "").replace(",", "")
    found = [str(n) in digits for n in row["numbers"]]
    assert row["style"] == "multivalue" and row["needles"] == 2 and len(row["numbers"]) == 2
    assert row["found"] == sum(found) / 2 and row["retrieved"] == all(found)
