"""Needle in a haystack (RULER-style single needle): "The special magic number is N." is spliced
into essay text at a depth (0 = start, 1 = end, snapped to the next sentence end), followed by a
question; greedy decoding must produce N.

Row: mode, length, depth, retrieved (+ number, answer, window, gpu_ratio, beta, budget).
"""

from __future__ import annotations

import numpy as np

from jhybrid.bench.offload import PointSkipped, backend_for, exact_layers_of
from jhybrid.bench.texts import calibration_tokens, text_tokens
from jhybrid.generation import Generator

QUESTION = ("\n\nQuestion: What is the special magic number mentioned in the text above?\n"
            "Answer: The special magic number is")


def needle_number(length: int, depth: float) -> int:
    """A 7-digit number fixed by (length, depth): every mode sees the same prompt."""
    return int(np.random.default_rng([length, int(depth * 1000)]).integers(1_000_000, 10_000_000))


def build_prompt(pretrained, text: str, length: int, depth: float) -> tuple[list[int], int]:
    """(prompt ids of exactly `length` tokens, the number)."""
    number = needle_number(length, depth)
    needle = pretrained.tokenizer.encode(f" The special magic number is {number}.").ids  # no BOS
    question = pretrained.tokenizer.encode(QUESTION).ids
    room = length - len(needle) - len(question)
    if room < 16:
        raise PointSkipped(f"niah_length {length} leaves no room for a haystack")
    hay = text_tokens(pretrained, text, room).tolist()
    at = int(depth * room)
    if pretrained.bos_token_id is not None and hay[0] == pretrained.bos_token_id:
        at = max(at, 1)  # the needle never goes before BOS
    while 0 < at < room and "." not in pretrained.tokenizer.id_to_token(hay[at - 1]):
        at += 1  # just after a sentence end (depth 0: the very start)
    return hay[:at] + needle + hay[at:] + question, number


def run_niah(model, pretrained, point, on_step=None, deadline=None) -> list[dict]:
    bench, offload = point.benchmark, point.offload
    if pretrained is None:
        raise PointSkipped("niah needs a model with a tokenizer (real weights)")
    prompt, number = build_prompt(pretrained, bench.text, bench.niah_length, bench.niah_depth)
    backend, window = backend_for(offload, len(prompt) + bench.answer_tokens, model, calibration_tokens(pretrained))
    generator = Generator(model, backend, prefill_chunk=bench.prefill_chunk,
                          max_len=len(prompt) + bench.answer_tokens)
    result = generator.generate([prompt], max_new_tokens=bench.answer_tokens,
                                on_tokens=(lambda *_: on_step(0, 0)) if on_step else None)
    answer = pretrained.tokenizer.decode(result.tokens[0])
    return [{"task": "niah", "mode": offload.mode, "length": bench.niah_length,
             "depth": bench.niah_depth, "retrieved": str(number) in answer.replace(" ", ""),
             "number": number, "answer": answer.strip(), "window": window,
             "gpu_ratio": offload.gpu_ratio if window else None,
             "beta": offload.beta if offload.mode == "hgca" else None,
             **({"keep_after": offload.keep_after} if offload.mode == "hgca" and offload.keep_after else {}),
             "budget": offload.budget if offload.mode in ("scout", "topk") else None,
             "predict_query": offload.predict_query if offload.mode == "scout" else None,
             "scout_exact_layers": exact_layers_of(offload),
             **({"exact_layers_used": exact_layers_of(backend.config)} if offload.mode == "scout" else {})}]
