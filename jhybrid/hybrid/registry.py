"""The mode registry: mode name -> its `OffloadMode` class.

This module imports nothing of jhybrid, so both the config (which validates a mode's name and its
settings) and the modes (which register themselves in `jhybrid.hybrid.modes`, one line each) can
import it without a cycle. Importing any `jhybrid.hybrid` module runs `jhybrid/hybrid/__init__.py`
first, which imports the modes, so the registry is complete before any config is built.
"""

from __future__ import annotations

_MODES: dict[str, type] = {}


def register(mode_class: type) -> type:
    """Add a mode class (a subclass of `jhybrid.hybrid.modes.base.OffloadMode`) under its `name`."""
    name = mode_class.name
    if name in _MODES and _MODES[name] is not mode_class:
        raise ValueError(f"mode {name!r} is registered twice ({_MODES[name].__name__}, {mode_class.__name__})")
    _MODES[name] = mode_class
    return mode_class


def mode_names() -> tuple[str, ...]:
    """Every registered mode name, in registration order ('full' first)."""
    return tuple(_MODES)


def mode_class(name: str) -> type:
    """The class of mode `name`; ValueError naming the known modes when there is none."""
    try:
        return _MODES[name]
    except KeyError:
        raise ValueError(f"mode={name!r}: expected one of {', '.join(_MODES)}") from None


def reference_mode() -> str:
    """The name of the mode every other is measured against (the class with `reference = True`)."""
    return next(name for name, cls in _MODES.items() if cls.reference)


__all__ = ["register", "mode_names", "mode_class", "reference_mode"]
