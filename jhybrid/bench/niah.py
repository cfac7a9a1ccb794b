"""Needle in a haystack in RULER's styles. A needle "The special magic number for <key> is N." is
spliced into essay text (snapped to just after a sentence end), followed by a question; greedy
decoding must produce the asked number(s).

- single: one needle at `depth` (0 = start, 1 = end), no key: "The special magic number is N."
- multikey: `needles` needles under different keys, the asked one at `depth`, the others at depths
  drawn from the (length, depth) seed: the model must pick the right key's number.
- multivalue: `needles` numbers under one key, the first at `depth`, the others drawn as above; the
  answer must contain all of them (retrieved) and the row gives the share found.

Row: mode, style, length, depth, retrieved, found (+ numbers, answer, window, gpu_ratio, beta, budget).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jhybrid.bench.offload import PointSkipped, backend_for
from jhybrid.bench.texts import calibration_tokens, text_tokens
from jhybrid.config.schema import NIAH_STYLES
from jhybrid.generation import Generator

QUESTION = ("\n\nQuestion: What is the special magic number mentioned in the text above?\n"
            "Answer: The special magic number is")
KEYS = ("amber-falcon", "quiet-harbor", "silver-orchard", "northern-lantern", "velvet-canyon",
        "copper-meadow", "hidden-glacier", "scarlet-compass", "marble-river", "golden-thistle")


@dataclasses.dataclass(frozen=True)
class Needles:
    """What a NIAH prompt hides and asks: needle sentences with their depths, the question, and the
    numbers the answer must contain."""

    sentences: list[str]   # in the order of `depths`
    depths: list[float]    # 0..1, the first is the point's depth
    question: str
    expected: list[int]    # numbers the answer must contain


def needle_number(length: int, depth: float, index: int = 0) -> int:
    """A 7-digit number fixed by (length, depth, index): every mode sees the same prompt."""
    seed = [length, int(depth * 1000)] + ([index] if index else [])  # index 0: the single-needle seed
    return int(np.random.default_rng(seed).integers(1_000_000, 10_000_000))


def make_needles(style: str, length: int, depth: float, needles: int = 4) -> Needles:
    if style == "single":
        number = needle_number(length, depth)
        return Needles([f" The special magic number is {number}."], [depth], QUESTION, [number])
    if style not in NIAH_STYLES:
        raise ValueError(f"niah_style {style!r}: expected one of {', '.join(map(repr, NIAH_STYLES))}")
    if not 2 <= needles <= len(KEYS):
        raise ValueError(f"niah_needles = {needles}: expected 2..{len(KEYS)} for style {style!r}")
    rng = np.random.default_rng([length, int(depth * 1000), 7])
    depths = [depth] + [float(d) for d in rng.uniform(0.0, 1.0, needles - 1).round(3)]
    numbers = [needle_number(length, depth, i) for i in range(needles)]
    if style == "multikey":
        keys = [KEYS[i] for i in rng.permutation(len(KEYS))[:needles]]
        sentences = [f" The special magic number for {k} is {n}." for k, n in zip(keys, numbers)]
        question = (f"\n\nQuestion: What is the special magic number for {keys[0]} mentioned in the text "
                    f"above?\nAnswer: The special magic number for {keys[0]} is")
        return Needles(sentences, depths, question, numbers[:1])
    key = KEYS[int(rng.integers(len(KEYS)))]
    sentences = [f" One of the special magic numbers for {key} is {n}." for n in numbers]
    question = (f"\n\nQuestion: What are all the special magic numbers for {key} mentioned in the text "
                f"above?\nAnswer: The special magic numbers for {key} are")
    return Needles(sentences, depths, question, numbers)


def build_prompt(pretrained, text: str, length: int, depth: float, style: str = "single",
                 needles: int = 4) -> tuple[list[int], Needles]:
    """(prompt ids of exactly `length` tokens, what it hides and asks)."""
    spec = make_needles(style, length, depth, needles)
    encoded = [pretrained.tokenizer.encode(sentence).ids for sentence in spec.sentences]  # no BOS
    question = pretrained.tokenizer.encode(spec.question).ids
    room = length - sum(len(e) for e in encoded) - len(question)
    if room < 16 * len(encoded):
        raise PointSkipped(f"niah_length {length} leaves no room for a haystack around {len(encoded)} needle(s)")
    hay = text_tokens(pretrained, text, room).tolist()
    first = 1 if pretrained.bos_token_id is not None and hay[0] == pretrained.bos_token_id else 0

    def sentence_end(at: int) -> int:
        at = max(at, first)  # a needle never goes before BOS
        while 0 < at < room and "." not in pretrained.tokenizer.id_to_token(hay[at - 1]):
            at += 1  # just after a sentence end (depth 0: the very start)
        return at

    cuts = sorted((sentence_end(int(d * room)), i) for i, d in enumerate(spec.depths))
    prompt, last = [], 0
    for at, i in cuts:
        prompt += hay[last:at] + encoded[i]
        last = at
    return prompt + hay[last:] + question, spec


def run_niah(model, pretrained, point, on_step=None, deadline=None) -> list[dict]:
    bench, offload = point.benchmark, point.offload
    if pretrained is None:
        raise PointSkipped("niah needs a model with a tokenizer (real weights)")
    prompt, spec = build_prompt(pretrained, bench.text, bench.niah_length, bench.niah_depth,
                                bench.niah_style, bench.niah_needles)
    backend, window = backend_for(offload, len(prompt) + bench.answer_tokens, model, calibration_tokens(pretrained))
    with Generator(model, backend, prefill_chunk=bench.prefill_chunk,
                   max_len=len(prompt) + bench.answer_tokens) as generator:
        result = generator.generate([prompt], max_new_tokens=bench.answer_tokens,
                                    on_tokens=(lambda *_: on_step(0, 0)) if on_step else None)
        fields = backend.row_fields()
    answer = pretrained.tokenizer.decode(result.tokens[0])
    digits = answer.replace(" ", "").replace(",", "")
    found = [str(n) in digits for n in spec.expected]
    return [{"task": "niah", "mode": offload.mode, "style": bench.niah_style, "length": bench.niah_length,
             "depth": bench.niah_depth, "retrieved": all(found), "found": round(sum(found) / len(found), 4),
             "number": spec.expected[0], "numbers": spec.expected, "needles": len(spec.sentences),
             "answer": answer.strip(), "window": window,
             "gpu_ratio": offload.gpu_ratio if window else None, **fields}]
