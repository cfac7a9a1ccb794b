"""What a running point reports to the sweep's progress display: its phase (predicting memory,
measuring the machine, writing the host context, compiling) and its decode steps. The runner gives
each task one `PointProgress`; tasks call it with (done, total) per step and `.phase(text)` before
anything long that has no steps to count."""

from __future__ import annotations

import logging
from typing import Callable

log = logging.getLogger("jhybrid.bench")


class PointProgress:
    """update(description=..., completed=..., total=...) is the display's own update (rich's
    `Progress.update` bound to the point's task)."""

    def __init__(self, update: Callable[..., None], key: str):
        self._update, self.key = update, key

    def __call__(self, done: int, total: int | None) -> None:
        """Decode / scored steps: `done` of `total` (None: unknown)."""
        self._update(description=self.key[:60], completed=done, total=total or None)

    def phase(self, text: str) -> None:
        """A long stretch without steps ('compiling the decode step'): shown in place of the key."""
        log.info("%s: %s", self.key, text)
        self._update(description=f"{self.key[:36]}: {text}"[:72], completed=0, total=None)


# The phase a task reported last (`report_phase`), for tools that sample the process from inside it
# (benchmarks/stack_sample.py counts each sample under the phase it fell in).
current_phase = ""


def report_phase(progress: PointProgress | None, text: str) -> None:
    global current_phase
    current_phase = text
    if progress is not None:
        progress.phase(text)


__all__ = ["PointProgress", "report_phase"]
