"""The sweep runner behind `jhybrid bench CONFIG.yaml`.

For each point of the expanded sweep: skip it if the results JSON already has a row for its key
(resume), else load the model (once per model spec), run the point's task and append its rows;
a point that cannot run (PointSkipped) gets one row {point, skipped: reason}. The JSON and CSV are
rewritten after every point, so Ctrl-C keeps everything measured so far. Plots and the summary
table come at the end (also after an interrupt).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

from jhybrid.bench.niah import run_niah
from jhybrid.bench.offload import PointSkipped
from jhybrid.bench.perplexity import run_perplexity
from jhybrid.bench.plots import render_plots
from jhybrid.bench.results import command_line, print_summary, read_rows, write_csv, write_json
from jhybrid.bench.shapes import load_model
from jhybrid.bench.throughput import run_throughput
from jhybrid.config import RunConfig, config_to_dict, expand_sweep

log = logging.getLogger(__name__)

TASKS = {"perplexity": run_perplexity, "niah": run_niah, "throughput": run_throughput}


@dataclasses.dataclass
class RunOutcome:
    rows: list[dict]
    ran: int
    resumed: int
    skipped: int
    interrupted: bool
    paths: list[str]


def results_stem(run: RunConfig, output_dir: str | None = None) -> str:
    """<output_dir>/<name>: the .json, .csv and -<task>.png files share it."""
    return os.path.join(output_dir or run.benchmark.output_dir, run.name)


def run_sweep(run: RunConfig, output_dir: str | None = None, argv: list[str] | None = None,
              console=None, show_progress: bool = True) -> RunOutcome:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = console or Console(stderr=True)
    stem = results_stem(run, output_dir)
    json_path, csv_path = stem + ".json", stem + ".csv"
    points = expand_sweep(run)
    rows = read_rows(json_path)
    done = {r.get("point") for r in rows}
    todo = [p for p in points if p.key not in done]
    if len(todo) < len(points):
        console.print(f"resuming {json_path}: {len(points) - len(todo)} of {len(points)} points already there")
    config, command = config_to_dict(run), command_line(argv)
    models: dict = {}
    ran = skipped = 0
    interrupted = False

    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console, disable=not show_progress)
    with progress:
        overall = progress.add_task(run.name, total=len(points), completed=len(points) - len(todo))
        steps = progress.add_task("", total=None, visible=False)
        try:
            for point in todo:
                progress.update(steps, description=point.key[:60], completed=0, total=None, visible=True)
                start = time.perf_counter()
                try:
                    if point.model not in models:
                        models[point.model] = load_model(point.model)
                    model, pretrained = models[point.model]
                    task = TASKS[point.benchmark.task]
                    new = task(model, pretrained, point,
                               on_step=lambda done, total: progress.update(steps, completed=done,
                                                                           total=total or None))
                    ran += 1
                except PointSkipped as reason:
                    log.warning("skipping %s: %s", point.key, reason)
                    console.print(f"[yellow]skipped[/] {point.key}: {reason}")
                    new = [{"task": point.benchmark.task, "mode": point.offload.mode,
                            "skipped": str(reason)}]
                    skipped += 1
                for row in new:
                    row["point"] = point.key
                    row.setdefault("point_seconds", round(time.perf_counter() - start, 2))
                rows.extend(new)
                write_json(json_path, run.name, config, rows, command)
                write_csv(csv_path, rows)
                progress.advance(overall)
        except KeyboardInterrupt:
            interrupted = True
            console.print(f"[red]interrupted[/]: {len(rows)} rows kept in {json_path}; rerun to resume")
    paths = [json_path, csv_path] if rows else []
    if rows:
        write_csv(csv_path, rows)
        paths += render_plots(rows, stem)
        print_summary(rows, console)
    return RunOutcome(rows=rows, ran=ran, resumed=len(points) - len(todo), skipped=skipped,
                      interrupted=interrupted, paths=paths)
