"""The sweep runner behind `jhybrid bench CONFIG.yaml`.

For each point of the expanded sweep: skip it if the results JSON already has a row for its key
(resume), else load the model (once per model spec), run the point's task and append its rows;
a point that cannot run (PointSkipped) gets one row {point, skipped: reason, ...}. The JSON and CSV
are rewritten after every point, so Ctrl-C keeps everything measured so far. Plots and the summary
table come at the end (also after an interrupt). `only` (the CLI's --only) runs the points whose
key contains one of its strings; each write merges into the file under a lock, so processes given
disjoint parts of one sweep (e.g. one text each on a 2-core machine) fill one results file.

Wall-clock budget (benchmark.time_budget_s of the base config): once spent, every point left gets a
row {skipped: "time budget: ..."} without running; tasks also get the deadline (a throughput point
shortens its timed steps or skips a host fill it cannot finish). A point that raises any other
error gets a row {error: "Type: message"} (traceback in the log) and the sweep goes on.

Resume: every row carries `config_hash`, the hash of its point's whole configuration (model,
offload and benchmark sections after the sweep's overrides and --set; offload settings the point's
mode never reads count at their defaults, so changing one reruns nothing); the JSON keeps each
hash's configuration under `configs`. Rows are keyed by (point key, config hash): a point is done
only if a row has its key AND its hash and is a measurement (skipped and error rows are tried again
by a rerun: their cause may be gone), a changed setting runs the point again, and the new rows are
added beside those measured with the old settings, never in their place (a rerun with the same
settings replaces its own earlier rows). Rows hashed before ignored settings were left out (their
`legacy_config_hash`) still count as done. Models (their config.json), the texts the points
evaluate on (UTF-8, not empty, long enough for a perplexity point: its tokenizer alone is loaded)
and the output folder are checked before any model loads.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import sys
import time

from jhybrid.bench.niah import run_niah
from jhybrid.bench.offload import PointSkipped
from jhybrid.bench.perplexity import run_perplexity
from jhybrid.bench.progress import PointProgress
from jhybrid.bench.plots import render_plots
from jhybrid.bench.results import (capacity_table, command_line, print_summary, read_results, read_rows,
                                   write_csv, write_json)
from jhybrid.bench.serving import run_serving
from jhybrid.bench.shapes import check_model_spec, load_model, uses_real_weights
from jhybrid.bench.texts import TextError, load_text, text_tokens
from jhybrid.bench.throughput import predict_throughput, run_throughput
from jhybrid.config import RunConfig, config_to_dict, expand_sweep

log = logging.getLogger(__name__)

TASKS = {"perplexity": run_perplexity, "niah": run_niah, "throughput": run_throughput, "serving": run_serving}


@dataclasses.dataclass
class RunOutcome:
    rows: list[dict]
    ran: int
    resumed: int
    skipped: int
    interrupted: bool
    paths: list[str]
    errors: int = 0


def results_stem(run: RunConfig, output_dir: str | None = None) -> str:
    """<output_dir>/<name>: the .json, .csv and -<task>.png files share it."""
    return os.path.join(output_dir or run.benchmark.output_dir, run.name)


TIME_BUDGET = "time budget"


# Settings of how a sweep runs, not of what a point measures: changing them does not rerun points.
RUN_ONLY_SETTINGS = ("time_budget_s", "output_dir")


def _hash(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


def point_config_hash(point) -> str:
    """Hash of a point's whole configuration (what its rows were measured with, point_config)."""
    return _hash(point_config(point))


def legacy_config_hash(point) -> str:
    """The hash earlier versions gave a point: offload settings its mode ignores included."""
    return _hash(point_config(point, legacy=True))


def point_hashes(point) -> set[str]:
    """Every hash under which a row counts as this point's (point_config_hash, legacy_config_hash)."""
    return {point_config_hash(point), legacy_config_hash(point)}


def point_config(point, legacy: bool = False) -> dict:
    """A point's configuration as a plain dict: model, offload and benchmark (less the settings of
    how the sweep runs, RUN_ONLY_SETTINGS). Offload settings the point's mode never reads are
    recorded at their defaults (legacy=True: as given), so a setting of other modes (a --set
    offload.beta for a full point) changes neither the configuration nor the hash."""
    bench = {k: v for k, v in dataclasses.asdict(point.benchmark).items() if k not in RUN_ONLY_SETTINGS}
    offload = dataclasses.asdict(point.offload)
    if not legacy:
        defaults = {f.name: f.default for f in dataclasses.fields(point.offload)}
        offload.update({name: defaults[name] for name in point.offload.ignored_settings()})
    config = {"model": dataclasses.asdict(point.model), "offload": offload, "benchmark": bench}
    if point.parallel.tp != 1:  # one device: the configuration (and hash) of rows made before `parallel`
        config["parallel"] = dataclasses.asdict(point.parallel)
    return config


def _read_configs(json_path: str) -> dict:
    configs = read_results(json_path).get("configs", {})
    return configs if isinstance(configs, dict) else {}


def _publish(json_path, csv_path, name, config, command, mine: list[dict], configs: dict,
             same: dict | None = None) -> list[dict]:
    """Merge this process's rows into the results file (under an exclusive lock: another process
    may be running other points of the same sweep) and return every row now in it. Rows are keyed
    by (point, config hash): this process's rows replace older rows of the same point measured with
    the same configuration (`same`: point key -> the hashes that count as its configuration, default
    the row's own), and rows of that point measured with other settings stay beside them."""
    import fcntl

    same = same or {}
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    with open(json_path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        ours = {(r.get("point"), h) for r in mine for h in same.get(r.get("point"), {r.get("config_hash")})}
        rows = [r for r in read_rows(json_path) if (r.get("point"), r.get("config_hash")) not in ours] + mine
        known = {**_read_configs(json_path), **configs}
        kept = {r.get("config_hash") for r in rows}
        write_json(json_path, name, config, rows, command,
                   {**_extra(rows), "configs": {h: c for h, c in known.items() if h in kept}})
        write_csv(csv_path, rows)
    return rows


# While a point runs, <stem>.running.<pid>.json names it: a run killed from outside (the kernel's
# OOM killer, kill -9) cannot write a row, so the next run finds the marker of a dead pid and
# records an error row for that point (and runs it again).

def _marker(stem: str, pid: int) -> str:
    return f"{stem}.running.{pid}.json"


def _mark_running(stem: str, point_key: str | None) -> None:
    path = _marker(stem, os.getpid())
    if point_key is None:
        if os.path.exists(path):
            os.remove(path)
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"pid": os.getpid(), "point": point_key, "started": time.time()}, f)
    os.replace(tmp, path)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _rows_of_dead_runs(stem: str, hashes: dict) -> list[dict]:
    """Error rows for the points that runs of this sweep were in when they died (markers removed)."""
    import glob

    rows = []
    for path in glob.glob(_marker(stem, 0).replace(".0.json", ".*.json")):
        try:
            with open(path) as f:
                marker = json.load(f)
            pid, key = int(marker["pid"]), str(marker["point"])
        except (OSError, ValueError, KeyError, TypeError):
            log.warning("unreadable run marker %s removed", path)
            os.remove(path)
            continue
        if _pid_alive(pid):
            continue  # a parallel run (--only) still at work
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(marker.get("started", 0)))
        rows.append({"point": key, "config_hash": hashes.get(key),
                     "error": f"the run (pid {pid}) died during this point, started {started}, without "
                              "writing a row: killed from outside (out of host memory? the kernel log "
                              "says) -- a rerun tries it again"})
        os.remove(path)
    return rows


def is_done(row: dict) -> bool:
    """A measured row (skipped and error rows are tried again by a rerun)."""
    return "skipped" not in row and "error" not in row


def check_output_dir(json_path: str) -> None:
    """The results folder exists (or can be made) and takes a file: found before any point runs."""
    folder = os.path.dirname(os.path.abspath(json_path))
    try:
        os.makedirs(folder, exist_ok=True)
        probe = os.path.join(folder, f".jhybrid-write-test-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as err:
        raise OSError(f"output folder {folder} is not writable: {err.strerror or err}") from None


def check_inputs(points) -> None:
    """Finds, before any model loads, what would fail every point using it (ValueError naming the
    file or text and the point): a Hugging Face config.json that does not read (missing fields,
    not JSON), and a text a point evaluates on with real weights that is not UTF-8, is empty, or is
    shorter than a perplexity point's `benchmark.tokens` (counted with the model's tokenizer, loaded
    on its own). niah's haystack length depends on its needles: a text too short for it is one
    point's error row, without a traceback."""
    from jhybrid.loading.hf import hf_config_path, read_hf_config
    from jhybrid.loading.pretrained import load_pretrained

    for point in points:
        check_parallel(point)
    for spec in {p.model for p in points}:
        path = hf_config_path(spec.name)
        if path is not None:
            read_hf_config(path)
    tokenizers: dict = {}
    for point in points:
        bench = point.benchmark
        if bench.task not in ("perplexity", "niah") or bench.predict_only or not uses_real_weights(point.model):
            continue
        try:
            load_text(bench.text)
            if bench.task == "perplexity":
                if point.model.name not in tokenizers:
                    tokenizers[point.model.name] = load_pretrained(point.model.name, weights=False)
                text_tokens(tokenizers[point.model.name], bench.text, bench.tokens, "benchmark.tokens")
        except TextError as error:
            raise TextError(f"point {point.key}: {error}") from None


def check_parallel(point) -> None:
    """ValueError naming `parallel.tp` unless the point can run at its tensor-parallel degree: a
    throughput point with a real prefill, and no more devices than this process sees (the KV-head
    divisibility is checked by jhybrid.parallel.tensor_mesh once the model's shape is known)."""
    tp = point.parallel.tp
    if tp == 1:
        return
    bench = point.benchmark
    if bench.task != "throughput" or bench.fill != "prefill":
        raise ValueError(f"point {point.key}: parallel.tp = {tp} runs throughput points with fill: prefill "
                         f"only (this point: task {bench.task}, fill {bench.fill})")
    if bench.split == "balanced":
        raise ValueError(f"point {point.key}: parallel.tp = {tp} with benchmark.split: balanced is not supported "
                         "(the split measures one device); expected split: fixed")
    if bench.predict_only:
        return
    import jax

    devices = jax.devices()
    if tp > len(devices):
        raise ValueError(f"point {point.key}: parallel.tp = {tp} but only {len(devices)} {devices[0].platform} "
                         f"device(s) are visible (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count={tp})")


def point_fields(point) -> dict:
    """The identifying fields of a point, for rows that say why it did not run."""
    b = point.benchmark
    return {"task": b.task, "model": point.model.name, "mode": point.offload.mode,
            "host_kv_dtype": point.offload.host_kv_dtype or "model", "tp": point.parallel.tp,
            **({"batch_spec": str(b.batch), "context": b.context, "fill": b.fill} if b.task == "throughput" else {})}


def _extra(rows: list[dict]) -> dict:
    """Top-level JSON keys derived from the rows (throughput: the capacity table)."""
    capacity = capacity_table(rows)
    return {"capacity": capacity} if capacity else {}


def _stopping(update, stop):
    """The progress update of a point, calling stop() first (every step and phase of the point)."""
    if stop is None:
        return update

    def checked(*args, **kwargs):
        stop()
        return update(*args, **kwargs)

    return checked


def run_sweep(run: RunConfig, output_dir: str | None = None, argv: list[str] | None = None,
              console=None, show_progress: bool = True, only: list[str] | None = None,
              stop=None) -> RunOutcome:
    """Run the sweep's points not yet in the results file (only those whose key contains one of
    `only`, when given). Rows are merged into the file under a lock after every point, so processes
    running disjoint parts of one sweep share its results file. stop: called before every point and
    at every step of one (its progress callback); it raises KeyboardInterrupt to end the sweep
    there, as an interrupt (the CLI's: Ctrl-C stops at the next step, not inside one)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = console or Console(stderr=True, width=None if sys.stderr.isatty() else 200)
    stem = results_stem(run, output_dir)
    json_path, csv_path = stem + ".json", stem + ".csv"
    points = expand_sweep(run)
    if only:
        points = [p for p in points if any(text in p.key for text in only)]
    check_output_dir(json_path)
    read_rows(json_path)  # a damaged results file is an error now, not after the first point
    for spec in {p.model for p in points}:
        check_model_spec(spec)
    check_inputs(points)
    hashes = {p.key: point_config_hash(p) for p in points}
    same = {p.key: point_hashes(p) for p in points}
    configs = {hashes[p.key]: point_config(p) for p in points}
    died = _rows_of_dead_runs(stem, hashes)
    if died:
        for row in died:
            console.print(f"[red]the previous run died[/] during {row['point']}: {row['error']}",
                          highlight=False)
        _publish(json_path, csv_path, run.name, config_to_dict(run), command_line(argv), died, configs, same)
    rows = [r for r in read_rows(json_path) if is_done(r)]
    done = {(r.get("point"), r.get("config_hash")) for r in rows}
    todo = [p for p in points if not any((p.key, h) in done for h in same[p.key])]
    mine: list[dict] = []  # the rows this process produced
    if len(todo) < len(points):
        console.print(f"resuming {json_path}: {len(points) - len(todo)} of {len(points)} points already there")
    config, command = config_to_dict(run), command_line(argv)
    models: dict = {}
    ran = skipped = errors = 0
    interrupted = False
    budget = run.benchmark.time_budget_s
    deadline = None if budget is None else time.perf_counter() + budget

    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console, disable=not show_progress)
    with progress:
        overall = progress.add_task(run.name, total=len(points), completed=len(points) - len(todo))
        steps = progress.add_task("", total=None, visible=False)
        try:
            for point in todo:
                if stop is not None:
                    stop()
                progress.update(steps, description=point.key[:60], completed=0, total=None, visible=True)
                _mark_running(stem, point.key)
                start = time.perf_counter()
                try:
                    if deadline is not None and start >= deadline:
                        raise PointSkipped(f"{TIME_BUDGET}: the sweep's {budget:g} s were spent before "
                                           "this point (rerun to resume)")
                    if point.benchmark.task == "throughput" and point.benchmark.predict_only:
                        predict_throughput(point)  # raises PointSkipped with the prediction
                    held = (point.model, point.parallel.tp if not uses_real_weights(point.model) else 1)
                    if held not in models:
                        if held[1] > 1:  # a model over several devices (a 70B shape) leaves no room for another
                            models.clear()
                        models[held] = load_model(point.model, tp=held[1])
                    model, pretrained = models[held]
                    task = TASKS[point.benchmark.task]
                    new = task(model, pretrained, point, deadline=deadline,
                               on_step=PointProgress(_stopping(functools.partial(progress.update, steps), stop),
                                                     point.key))
                    ran += 1
                except PointSkipped as reason:
                    log.info("skipping %s: %s", point.key, reason)
                    if not str(reason).startswith("prediction only"):
                        console.print(f"[yellow]skipped[/] {point.key}: {reason}")
                    new = [{**point_fields(point), **reason.fields, "skipped": str(reason)}]
                    skipped += 1
                except Exception as error:  # noqa: BLE001 - one failing point must not lose the sweep
                    if isinstance(error, TextError):  # the user's input, said in one line: no traceback
                        log.info("point %s: %s", point.key, error)
                    else:
                        log.exception("point %s failed", point.key)
                    message = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:400] if str(error).strip() else ''}"
                    console.print(f"[red]error[/] {point.key}: {message}")
                    new = [{**point_fields(point), "error": message}]
                    errors += 1
                for row in new:
                    row["point"] = point.key
                    row["config_hash"] = hashes[point.key]
                    row.setdefault("point_seconds", round(time.perf_counter() - start, 2))
                    if not row.get("skipped") and not row.get("error"):
                        measure = ", ".join(f"{k} {row[k]}" for k in ("ppl", "retrieved", "decode_tok_s",
                                                                       "tbt_p99_ms", "ttft_s")
                                            if row.get(k) is not None)
                        console.print(f"[green]done[/] {point.key}: {measure} ({row['point_seconds']} s)")
                mine.extend(new)
                rows = _publish(json_path, csv_path, run.name, config, command, mine, configs, same)
                progress.advance(overall)
        except KeyboardInterrupt:
            interrupted = True
            console.print(f"[red]interrupted[/]: {len(rows)} rows kept in {json_path}; rerun to resume")
        finally:
            _mark_running(stem, None)
    if mine or read_rows(json_path):
        rows = _publish(json_path, csv_path, run.name, config, command, mine, configs, same)
    paths = [json_path, csv_path] if rows else []
    if rows:
        paths += render_plots(rows, stem)
        print_summary(rows, console)
    if errors:
        console.print(f"[red]{errors} point(s) failed[/] (a rerun tries them again):")
        for row in mine:
            if "error" in row:
                console.print(f"  {row['point']}: {row['error']}", highlight=False, markup=False)
    return RunOutcome(rows=rows, ran=ran, resumed=len(points) - len(todo), skipped=skipped,
                      interrupted=interrupted, paths=paths, errors=errors)
