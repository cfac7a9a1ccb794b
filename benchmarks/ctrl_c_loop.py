"""Ctrl-C as a user presses it: SIGINT to `jhybrid generate` once tokens stream, or to `jhybrid bench`
while a point runs, N times per mode; records the exit code and whether stderr shows a traceback, a
crash, a hang or a spurious host error (issue 33's "20 of 20 exit 130 without a crash").

    .venv/bin/python benchmarks/ctrl_c_loop.py --what bench --modes full hgca scout --runs 20 \
        --json benchmarks/results/ctrl-c-bench-cpu.json

SmolLM2 (the embedded default) on this machine's CPU. The interrupt point varies from run to run
(bench: 8-36 s after the start, the model loaded by then; generate: after 40-160 characters of output).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

BAD = ("Traceback", "Segmentation", "host exchange failed", "HUNG", "Exception ignored", "core dumped")
BENCH_CONFIG = """name: ctrl-c-{mode}
model: {{name: smollm2}}
offload: {{mode: {mode}{settings}}}
benchmark: {{task: perplexity, text: paul_graham, tokens: 4096, scored_tokens: 1024, prefill_chunk: 256}}
"""


def command(what: str, mode: str, run: int, folder: str) -> list[str]:
    jhybrid = os.path.join(os.path.dirname(sys.executable), "jhybrid")
    if what == "generate":
        return [jhybrid, "generate", "--mode", mode, "--max-tokens", "400", "--temperature", "0.8",
                "--seed", str(run), "Tell me a long story about a lighthouse."]
    config = os.path.join(folder, f"ctrl-c-{mode}.yaml")
    with open(config, "w") as f:
        settings = "" if mode == "full" else ", sink: 16, block_size: 16, host_threads: 1"
        f.write(BENCH_CONFIG.format(mode=mode, settings=settings))
    return [jhybrid, "bench", config, "--output-dir", os.path.join(folder, f"out-{run}")]


def interrupt_once_running(proc: subprocess.Popen, what: str, run: int, limit_s: float) -> bytes:
    """Sends SIGINT once the run is underway: generate after 40-160 characters of streamed text, bench
    8-36 s after the start (model load, then the point). Returns the stderr read so far."""
    os.set_blocking(proc.stdout.fileno(), False)
    os.set_blocking(proc.stderr.fileno(), False)
    seen, err, begin = b"", b"", time.monotonic()
    deadline = begin + limit_s
    bench_at_s = 8 + (run % 8) * 4  # the bench prints no progress off a terminal: a varying moment
    while time.monotonic() < deadline and proc.poll() is None:
        seen += proc.stdout.read() or b""
        err += proc.stderr.read() or b""
        if what == "generate" and len(seen) > 40 + (run % 5) * 30:
            break
        if what == "bench" and time.monotonic() - begin >= bench_at_s:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    return err


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--what", choices=("bench", "generate"), required=True)
    parser.add_argument("--modes", nargs="+", default=["full", "hgca", "scout"])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--json", default=None)
    parser.add_argument("--exit-wait-s", type=float, default=300.0,
                        help="how long an interrupted run may take to exit before it counts as hung")
    args = parser.parse_args()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "100", "PYTHONFAULTHANDLER": "1"}
    results = []
    with tempfile.TemporaryDirectory() as folder:
        for mode in args.modes:
            for run in range(args.runs):
                # SIGINT back to the default in the child: a shell starts background jobs (this loop,
                # under nohup) with SIGINT ignored, and the child would inherit that
                proc = subprocess.Popen(command(args.what, mode, run, folder), stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, env=env,
                                        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
                early = interrupt_once_running(proc, args.what, run, limit_s=300)
                os.set_blocking(proc.stderr.fileno(), True)
                os.set_blocking(proc.stdout.fileno(), True)
                try:
                    _, err = proc.communicate(timeout=args.exit_wait_s)  # bound the wait, not the run
                except subprocess.TimeoutExpired:  # where it is: faulthandler dumps every thread on SIGABRT
                    proc.send_signal(signal.SIGABRT)
                    try:
                        _, err = proc.communicate(timeout=30)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        _, err = proc.communicate()
                    err = (err or b"") + b"\n[HUNG]"
                text = (early + (err or b"")).decode(errors="replace")
                bad = [word for word in BAD if word in text]
                results.append({"what": args.what, "mode": mode, "run": run, "rc": proc.returncode, "bad": bad,
                                "stderr_tail": text.strip().splitlines()[-40 if "HUNG" in bad else -2:]})
                print(mode, run, proc.returncode, bad, text.strip().splitlines()[-1:], flush=True)
    summary = {}
    for mode in args.modes:
        mine = [r for r in results if r["mode"] == mode]
        summary[mode] = sum(r["rc"] == 130 and not r["bad"] for r in mine)
        print(f"{args.what} {mode}: {summary[mode]} of {len(mine)} clean (exit 130, nothing bad on stderr)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"what": args.what, "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"),
                       "clean": summary, "runs": results}, f, indent=1)


if __name__ == "__main__":
    main()
