"""PNG plots of a results file's rows (matplotlib, Agg backend: no display needed).

perplexity: every configuration's ppl as a labelled bar, full attention as a dashed line, and where
hgca was swept over beta a panel of ppl vs beta (hgca only). niah: one retrieved/not heat map (depth x length) per mode.
throughput: decode tokens/s vs context (one line per mode and batch) and vs batch, per model;
breakdown: each throughput point's mean decode step split into its parts.
serving: per point, TTFT p50 / p99, token gaps (p50, p99, p99 while another prompt prefills) and
tokens/s (served at saturation against the fixed batches).
"""

from __future__ import annotations

import logging
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from jhybrid.hybrid.registry import reference_mode  # noqa: E402

REFERENCE = reference_mode()  # the mode every other is measured against (drawn in black)

log = logging.getLogger(__name__)


MEASURE = {"perplexity": "ppl", "niah": "retrieved", "throughput": "decode_tok_s", "serving": "ttft_p50_s"}


def _ok(rows, task):
    """The task's measured rows (skipped points and rows without the measurement left out)."""
    return [r for r in rows if r.get("task") == task and not r.get("skipped") and MEASURE[task] in r]


def plot_perplexity(rows: list[dict], path: str) -> str | None:
    """Per text: every configuration's perplexity as a labelled bar (a categorical axis: modes are not
    placed on a beta axis they do not have), full attention as a dashed line; where hgca was swept
    over beta, a second panel with ppl vs beta (log axis) for the hgca rows only."""
    rows = _ok(rows, "perplexity")
    if not rows:
        return None
    texts = sorted({(r["text"], r["tokens"]) for r in rows})
    sweeps = {key: _beta_sweeps([r for r in rows if (r["text"], r["tokens"]) == key]) for key in texts}
    columns = 2 if any(sweeps.values()) else 1
    fig, axes = plt.subplots(len(texts), columns, figsize=(7 * columns, 0.8 + 0.32 * max(
        sum(1 for r in rows if (r["text"], r["tokens"]) == key) for key in texts) + 1.5 * (columns - 1)
        + 1.5), squeeze=False)
    for row_axes, (text, tokens) in zip(axes, texts):
        sel = sorted((r for r in rows if r["text"] == text and r["tokens"] == tokens), key=lambda r: r["ppl"])
        full = [r["ppl"] for r in sel if r["mode"] == REFERENCE]
        ax = row_axes[0]
        labels = [_tag(r) for r in sel]
        ax.barh(range(len(sel)), [r["ppl"] for r in sel], color=["black" if r["mode"] == REFERENCE else "C0"
                                                                  for r in sel])
        ax.set_yticks(range(len(sel)), labels, fontsize=7)
        for i, r in enumerate(sel):
            ax.text(r["ppl"], i, f" {r['ppl']:.3f}", va="center", fontsize=7)
        if full:
            ax.axvline(full[0], color="black", ls="--", lw=0.8, label=f"full {full[0]:.3f}")
            ax.legend(fontsize=7, loc="lower right")
        lo = min(r["ppl"] for r in sel)
        ax.set_xlim(lo * 0.95, max(r["ppl"] for r in sel) * 1.08)
        ax.set_xlabel("perplexity (lower is better)")
        ax.set_title(f"{text}, {tokens} tokens")
        if columns == 2:
            ax = row_axes[1]
            for label, group in sweeps[(text, tokens)].items():
                ax.plot([r["beta"] for r in group], [r["ppl"] for r in group], "o-", label=label)
            if full:
                ax.axhline(full[0], color="black", ls="--", label=f"full {full[0]:.3f}")
            if sweeps[(text, tokens)]:
                ax.set_xscale("log")
                ax.set_xlabel("beta (hgca's threshold: larger keeps fewer tokens)")
                ax.set_ylabel("perplexity")
                ax.set_title("hgca over beta")
                ax.legend(fontsize=7)
            else:
                ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _beta_sweeps(rows: list[dict]) -> dict[str, list[dict]]:
    """hgca rows swept over beta (>= 2 values > 0 at one GPU share and keep_after), by label."""
    groups = defaultdict(list)
    for r in rows:
        if r.get("beta") is not None and r["beta"] > 0:  # a mode with a salience threshold (hgca)
            ratio = r["gpu_ratio"] if r.get("gpu_ratio") is not None else f"w{r.get('window')}"
            label = f"{r['mode']} ratio {ratio}" + (f" keep_after {r['keep_after']}" if r.get("keep_after") else "")
            label += f" host {r['host_kv_dtype']}" if r.get("host_kv_dtype") not in (None, "model") else ""
            groups[label].append(r)
    return {k: sorted(g, key=lambda r: r["beta"]) for k, g in groups.items()
            if len({r["beta"] for r in g}) >= 2}


def _tag(r):
    tag = r["mode"] if r.get("style", "single") == "single" else f"{r['style']} {r['mode']}"
    if r.get("gpu_ratio"):
        tag += f" r{r['gpu_ratio']}"
    if r.get("beta") is not None:
        tag += f" b{r['beta']:g}"
    if r.get("keep_after"):
        tag += f" span{r['keep_after']}"
    if r.get("max_keep_share"):
        tag += f" cap{r['max_keep_share']:g}"
    if r.get("budget"):
        tag += f" k{r['budget']}"
    if "predict_query=False" in r.get("point", ""):
        tag += " exact-q"
    if r.get("host_kv_dtype") not in (None, "model") or "host_kv_dtype=" in r.get("point", ""):
        kv = r.get("host_kv_dtype") or r["point"].split("host_kv_dtype=")[1].split(",")[0]
        tag += f" host-{kv}"
    return tag


def plot_niah(rows: list[dict], path: str) -> str | None:
    rows = _ok(rows, "niah")
    if not rows:
        return None
    tags = list(dict.fromkeys(_tag(r) for r in rows))
    lengths = sorted({r["length"] for r in rows})
    depths = sorted({r["depth"] for r in rows})
    cols = min(6, len(tags))  # rows of at most 6 panels
    nrows = -(-len(tags) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(2.2 + 1.1 * max(2, len(lengths)) * cols, 3.2 * nrows),
                             squeeze=False)
    for ax in axes.flat[len(tags):]:
        ax.axis("off")
    for ax, tag in zip(axes.flat, tags):
        grid = np.full((len(depths), len(lengths)), np.nan)
        for r in rows:
            if _tag(r) == tag:  # multivalue: the share of the numbers found
                grid[depths.index(r["depth"]), lengths.index(r["length"])] = float(r.get("found", r["retrieved"]))
        ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
        ax.set_xlabel("length (tokens)")
        ax.set_ylabel("needle depth")
        ax.set_title(tag, fontsize=8)
        for (i, j), v in np.ndenumerate(grid):
            if not np.isnan(v):
                ax.text(j, i, "yes" if v == 1 else "no" if v == 0 else f"{v:.0%}", ha="center", va="center", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _ctx(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def _model_tag(r) -> str:
    return f"{r.get('model', '?')} ({r['layers']} layers)" if r.get("layers") else str(r.get("model", "?"))


def _variant(r) -> str:
    """The mode, with hgca's spans when set (rows of one mode that differ in them are not one line)."""
    after = r.get("keep_after")
    if after is None and "keep_after=" in r.get("point", ""):
        after = int(r["point"].split("keep_after=")[1].split(",")[0])
    return r["mode"] + (f" span{after}" if after else "")


def plot_throughput(rows: list[dict], path: str) -> str | None:
    """Decode tokens/s vs context (one line per mode and batch) and vs batch (per mode and context),
    one row of panels per model. Batches written as 'max' are drawn at their resolved value."""
    rows = [r for r in _ok(rows, "throughput") if r.get("decode_tok_s") is not None
            and r.get("context") is not None and r.get("batch") is not None]
    if not rows:
        return None
    models = list(dict.fromkeys(_model_tag(r) for r in rows))
    modes = list(dict.fromkeys(_variant(r) for r in rows))
    colors = {m: f"C{i % 10}" for i, m in enumerate(modes)}  # one colour per mode
    markers = "osD^vP*Xh<>"
    fig, axes = plt.subplots(len(models), 2, figsize=(12, 4.4 * len(models)), squeeze=False)
    for (by_context, by_batch), model in zip(axes, models):
        sel_model = [r for r in rows if _model_tag(r) == model]
        batches = sorted({r["batch"] for r in sel_model})
        contexts = sorted({r["context"] for r in sel_model})
        for (mode, fill) in dict.fromkeys((_variant(r), r.get("fill")) for r in sel_model):
            sel = [r for r in sel_model if _variant(r) == mode and r.get("fill") == fill]
            style = "--" if fill == "prefill" else "-"  # a real prefill's decode: dashed
            name = mode + (" (prefill)" if fill == "prefill" else "")
            for batch in sorted({r["batch"] for r in sel}):
                pts = sorted((r["context"], r["decode_tok_s"]) for r in sel if r["batch"] == batch)
                by_context.plot(*zip(*pts), style, color=colors[mode],
                                marker=markers[batches.index(batch) % len(markers)], label=f"{name} B={batch}")
            for context in sorted({r["context"] for r in sel}):
                pts = sorted((r["batch"], r["decode_tok_s"]) for r in sel if r["context"] == context)
                by_batch.plot(*zip(*pts), style, color=colors[mode],
                              marker=markers[contexts.index(context) % len(markers)],
                              label=f"{name} ctx {_ctx(context)}")
        by_context.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="decode tokens/s",
                       title=f"{model}: throughput vs context")
        by_batch.set(xscale="log", yscale="log", xlabel="batch", ylabel="decode tokens/s",
                     title=f"{model}: throughput vs batch")
        by_context.legend(fontsize=6, ncol=2)
        by_batch.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


BREAKDOWN = [("between_steps_ms", "between steps (evict / recall / upload)", "tab:orange"),
             ("callback_ms", "in host callbacks (GPU stalled)", "tab:red"),
             ("compute_ms", "rest of the step (GPU compute + dispatch)", "tab:blue")]


def plot_breakdown(rows: list[dict], path: str) -> str | None:
    """Per measured throughput point, the mean decode step as shares: time between steps (the
    manager's eviction / recall / uploads), time inside host callbacks (the GPU stalled), and the
    rest (GPU compute + dispatch); the CPU attention worker time (overlapping the step) as a black
    tick, and the step's mean time in ms at the right."""
    rows = [r for r in _ok(rows, "throughput") if r.get("step_ms")
            and r.get("context") is not None and r.get("batch") is not None]
    if not rows:
        return None
    rows = sorted(rows, key=lambda r: (_model_tag(r), r["context"], r["batch"], r["mode"]))
    labels = [f"{r.get('model', '')} {_ctx(r['context'])} B={r['batch']} {r['mode']}" for r in rows]
    fig, ax = plt.subplots(figsize=(10, 0.26 * len(rows) + 1.8))
    y = np.arange(len(rows))
    step = np.array([r["step_ms"] for r in rows])
    left = np.zeros(len(rows))
    for key, label, color in BREAKDOWN:
        share = np.array([r.get(key) or 0.0 for r in rows]) / step
        ax.barh(y, share, left=left, color=color, label=label)
        left += share
    cpu = np.minimum(np.array([r.get("cpu_attn_ms") or 0.0 for r in rows]) / step, 1.0)
    ax.plot(cpu, y, "k|", markersize=9, label="CPU attention worker time / step (overlaps)")
    for yi, ms in zip(y, step):
        ax.text(1.01, yi, f"{ms:.3g} ms", va="center", fontsize=6)
    ax.set_yticks(y, labels, fontsize=6)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.12)
    ax.set_xlabel("share of the mean decode step")
    ax.set_title("per-step time breakdown")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.06 - 1.0 / len(rows)), ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _serving_label(row: dict) -> str:
    """A serving row's bar label: its mode, step budget (and the budget while requests decode, when
    smaller) and whether the prefix cache had a host tier."""
    label = f"{row['mode']}\nbudget {row.get('step_tokens')}"
    decoding = row.get("decoding_step_tokens")
    if decoding is not None and decoding != row.get("step_tokens"):
        label += f"\n({decoding} decoding)"
        if row.get("decoding_max_backlog") is not None:
            label += f"\n(backlog <= {row['decoding_max_backlog']})"
    if (row.get("prefix_bytes") or {}).get("host"):
        label += "\n+ host tier"
    return label


def plot_serving(rows: list[dict], path: str) -> str | None:
    """Three panels, one bar group per serving point (mode, step budget): TTFT p50 / p99 (s), token
    gaps p50 / p99 / p99 while another prompt prefills (ms), saturated vs fixed-batch tokens/s."""
    rows = [r for r in _ok(rows, "serving") if r.get("ttft_p50_s") is not None]
    if not rows:
        return None
    labels = [_serving_label(r) for r in rows]
    x = np.arange(len(rows))
    panels = [("time to first token (s)", [("ttft_p50_s", "p50"), ("ttft_p99_s", "p99")]),
              ("token gaps (ms)", [("tbt_p50_ms", "p50"), ("tbt_p99_ms", "p99"),
                                   ("tbt_prefill_p99_ms", "p99 while another prompt prefills")]),
              ("tokens/s, all requests at once", [("saturated_tok_s", "engine"), ("fixed_tok_s", "fixed batches")])]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, (title, keys) in zip(axes, panels):
        width = 0.8 / len(keys)
        for i, (key, label) in enumerate(keys):
            ax.bar(x + (i - (len(keys) - 1) / 2) * width, [r.get(key) or 0.0 for r in rows], width, label=label)
        ax.set_xticks(x, labels, fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    first = rows[0]
    fig.suptitle(f"serving: {first.get('model', '')} ({first.get('layers', '?')} layers), {first.get('requests')} "
                 f"requests at {first.get('rate')}/s, {first.get('slots')} slots", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


PLOTS = {"perplexity": plot_perplexity, "niah": plot_niah, "throughput": plot_throughput,
         "breakdown": plot_breakdown, "serving": plot_serving}


def render_plots(rows: list[dict], stem: str) -> list[str]:
    """Every plot the rows allow, as <stem>-<task>.png; returns the paths written."""
    written = []
    for task, plot in PLOTS.items():
        path = plot(rows, f"{stem}-{task}.png")
        if path:
            written.append(path)
    return written
