"""Where do a command's threads spend their time? A small sampling profiler for device calls (no
py-spy there): runs `python -m MODULE ARGS...` in this process while a thread reads every thread's
stack (`sys._current_frames`, under the GIL: safe, unlike faulthandler's timed dumps, which crashed
here) every --every seconds, then writes, per thread and bench phase (the phase the bench reported
last: `jhybrid.bench.progress.current_phase`), its innermost project frames (jhybrid/, host/) seen
most often, with the frame above each.

  PYTHONPATH=. python3 benchmarks/stack_sample.py --out $OUT/stacks.txt --every 0.5 -- jhybrid.cli bench CONFIG ...
"""

from __future__ import annotations

import argparse
import collections
import runpy
import sys
import threading
import time

PROJECT = ("/jhybrid/", "/host/")


def _place(frame) -> str | None:
    """The innermost two project frames of a stack, 'file:line function <- file:line function'."""
    places = []
    while frame is not None and len(places) < 2:
        path = frame.f_code.co_filename
        if any(part in path for part in PROJECT):
            short = path[path.rfind("/jhybrid/") + 1:] if "/jhybrid/" in path else path[path.rfind("/host/") + 1:]
            places.append(f"{short}:{frame.f_lineno} {frame.f_code.co_name}")
        frame = frame.f_back
    return " <- ".join(places) if places else None


def _phase() -> str:
    """The phase the bench reported last (jhybrid.bench.progress.current_phase; '' before it loads):
    each sample counts under it, so the load's samples stand apart from the warm-up's."""
    progress = sys.modules.get("jhybrid.bench.progress")
    return getattr(progress, "current_phase", "") if progress is not None else ""


class Sampler(threading.Thread):
    def __init__(self, every: float, phases: tuple[str, ...] = ()):
        super().__init__(name="stack-sampler", daemon=True)
        self.every, self.phases = every, phases
        self.samples = 0
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.stop = threading.Event()

    def run(self) -> None:
        me = threading.get_ident()
        while not self.stop.wait(self.every):
            phase = _phase()
            if self.phases and not any(text in phase for text in self.phases):
                continue  # (a phase not asked for: no stack walked, so the compiles run undisturbed)
            names = {t.ident: t.name for t in threading.enumerate()}
            self.samples += 1
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                place = _place(frame)
                if place is not None:
                    name = names.get(ident, str(ident))
                    self.counts[f"{name} [{phase}]" if phase else name][place] += 1

    def report(self, top: int = 15) -> str:
        lines = [f"{self.samples} samples, every {self.every} s"]
        for thread, counter in sorted(self.counts.items(), key=lambda kv: -sum(kv[1].values())):
            lines.append(f"{thread}: {sum(counter.values())} samples in project code")
            lines += [f"  {n:5d}  {place}" for place, n in counter.most_common(top)]
        return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the summary's file")
    parser.add_argument("--every", type=float, default=0.5)
    parser.add_argument("--top", type=int, default=15, help="places shown per thread (default 15)")
    parser.add_argument("--phase", action="append", default=[], metavar="TEXT",
                        help="sample only while the bench's phase contains TEXT (repeatable; default: always)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- MODULE ARGS...")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    sampler = Sampler(args.every, tuple(args.phase))
    sampler.start()
    sys.argv = [command[0]] + command[1:]
    start = time.perf_counter()
    try:
        runpy.run_module(command[0], run_name="__main__", alter_sys=True)
    finally:
        sampler.stop.set()
        sampler.join(10)
        with open(args.out, "w") as f:
            f.write(f"{time.perf_counter() - start:.0f} s\n{sampler.report(args.top)}\n")


if __name__ == "__main__":
    main()
