"""The interpreter's thread switch interval while the engine serves (`switch_interval`).

The engine thread's host work before each call (an offloading backend's recalls, evictions and
device copies: many small dispatches, each giving up the GIL) competes with the backend's Python
worker threads (scout's recall stager, the eviction writer, the prefix-cache store). When the
engine thread gives up the GIL and a worker takes it, CPython hands it back only after the worker
has held it for the switch interval (`sys.getswitchinterval()`, 5 ms by default) or released it
itself; a step's host work that gives it up dozens of times can wait tens of milliseconds. A
shorter interval bounds each such wait, at the cost of more switches in the workers.

The interval is the process's, not the engine's: `switch_interval` sets it for its body and puts
the former value back after.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
from collections.abc import Iterator

log = logging.getLogger(__name__)


def check_switch_interval(seconds: float | None, name: str = "switch interval") -> None:
    """ValueError naming `name` unless seconds is None (the interpreter's) or a finite number > 0."""
    if seconds is None:
        return
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (math.isfinite(seconds)
                                                                                 and seconds > 0):
        raise ValueError(f"{name} {seconds!r}; expected a number of seconds > 0 (or None: the interpreter's, "
                         f"{sys.getswitchinterval() * 1e3:g} ms now)")


@contextlib.contextmanager
def switch_interval(seconds: float | None) -> Iterator[float]:
    """The body runs with the thread switch interval `seconds` (None: unchanged); the former value is
    restored after it, also on an error. Yields the interval in force."""
    check_switch_interval(seconds)
    before = sys.getswitchinterval()
    if seconds is None:
        yield before
        return
    sys.setswitchinterval(seconds)
    log.info("thread switch interval %g ms (was %g ms)", sys.getswitchinterval() * 1e3, before * 1e3)
    try:
        yield sys.getswitchinterval()
    finally:
        sys.setswitchinterval(before)


__all__ = ["switch_interval", "check_switch_interval"]
