"""Reading the user's files with errors that name them: UTF-8 text and JSON (run configs, text files,
results files, config.json). One place, so every reader says the same things the same way."""

from __future__ import annotations

import json


def read_text(path: str, expected: str, error=ValueError) -> str:
    """The whole UTF-8 text of a file; `error` ("{path}: not UTF-8 text (byte ... at offset ...);
    {expected}") when it is not (a binary file). OSErrors (no such file, ...) pass unchanged."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as decode:
        raise error(f"{path}: not UTF-8 text (byte {decode.object[decode.start]:#04x} at offset "
                    f"{decode.start}); {expected}") from None


def read_json(path: str, expected: str, error=ValueError):
    """The parsed JSON document of a file; `error` naming the file, what is wrong (not UTF-8,
    truncated, not valid JSON: where) and `expected`."""
    text = read_text(path, expected, error)
    try:
        return json.loads(text)
    except json.JSONDecodeError as decode:
        what = "truncated JSON" if decode.pos >= len(text.rstrip()) else "not valid JSON"
        raise error(f"{path}: {what} ({decode.msg} at line {decode.lineno} column {decode.colno}); "
                    f"{expected}") from None


__all__ = ["read_json", "read_text"]
