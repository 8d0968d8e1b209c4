"""``--plot FILE.png`` of the benches, drawn from their JSON results (matplotlib, imported
lazily); ``breakgraph bench plot`` redraws saved results, several runs in one figure (say,
graphs vs ``--cuda-graph-backend-prefill disabled``)::

    breakgraph bench plot prefill graphs.json eager.json -o prefill.png
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path


def require_matplotlib():
    """matplotlib.pyplot on the Agg backend, or a clear error if it is not installed."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(
            "error: plotting needs matplotlib: pip install matplotlib (or 'breakgraph[bench]')"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def require_plot(path: str | None) -> None:
    """Fail before a run, not after it, when its ``--plot`` cannot be drawn."""
    if path:
        require_matplotlib()


def _save(fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)


def _log2_x(ax, xs) -> None:
    """A log2 x axis ticked at the measured values, labelled as plain numbers."""
    ticks = sorted(set(xs))
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()


def _label(ax, title: str, xlabel: str, ylabel: str, **title_kw) -> None:
    """A panel's title, axis labels, light grid and legend."""
    ax.set_title(title, **title_kw)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def _grid(plt, n: int, w: float = 5.0, h: float = 3.8, max_cols: int = 3):
    cols = min(n, max_cols)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(w * cols, h * rows), squeeze=False)
    flat = axes.ravel().tolist()
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def plot_step(points: list[dict], path: str) -> None:
    """Step ms against N, one line per arm (the floor dashed), one subplot per (model, P)."""
    plt = require_matplotlib()
    panels: dict[tuple, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for pt in points:
        for arm in pt["arms"]:
            if arm["ms"] is not None:
                key = (pt["model"], pt["prefix_tokens"])
                panels[key][arm["arm"]].append((pt["new_tokens"], arm["ms"]))
    fig, axes = _grid(plt, max(len(panels), 1))
    for ax, ((model, prefix), arms) in zip(axes, sorted(panels.items()), strict=False):
        for arm, xy in arms.items():
            xs, ys = zip(*sorted(xy), strict=True)
            style = "--" if arm == "floor" else "-"
            ax.plot(xs, ys, style, marker="o", label=arm)
        _log2_x(ax, [x for xy in arms.values() for x, _ in xy])
        _label(ax, f"{model}, P={prefix}", "N (new tokens)", "step latency (ms)")
    _save(fig, path)


def plot_decode(points: list[dict], path: str) -> None:
    """Decode step ms against batch size, eager vs graph, one subplot per (model, context)."""
    plt = require_matplotlib()
    panels: dict[tuple, list[dict]] = defaultdict(list)
    for pt in points:
        panels[(pt["model"], pt["context"])].append(pt)
    fig, axes = _grid(plt, max(len(panels), 1))
    for ax, ((model, context), pts) in zip(axes, sorted(panels.items()), strict=False):
        pts = sorted(pts, key=lambda p: p["batch_size"])
        for key, label in (("eager_ms", "eager"), ("graph_ms", "graph")):
            xy = [(p["batch_size"], p[key]) for p in pts if p[key] is not None]
            if xy:
                ax.plot(*zip(*xy, strict=True), marker="o", label=label)
        _log2_x(ax, [p["batch_size"] for p in pts])
        _label(ax, f"{model}, context {context}", "batch size", "decode step (ms)")
    _save(fig, path)


SERVING_METRICS = (
    ("decode_step_p50_ms", "decode step p50 (ms)"),
    ("tok_s_per_user_p50", "tok/s per user p50"),
    ("output_tok_s", "output tok/s"),
    ("ttft_p50_ms", "TTFT p50 (ms)"),
)


def plot_serving(results: list[dict], path: str, labels: list[str] | None = None) -> None:
    """Each serving metric against concurrency, one line per (run, round)."""
    plt = require_matplotlib()
    fig, axes = _grid(plt, len(SERVING_METRICS), w=5.0, h=3.6, max_cols=2)
    for i, res in enumerate(results):
        run = labels[i] if labels else (f"run {i + 1}" if len(results) > 1 else "")
        by_round: dict[int, list[dict]] = defaultdict(list)
        for row in res["rows"]:
            by_round[row["round"]].append(row)
        for rnd, rows in sorted(by_round.items()):
            rows = sorted(rows, key=lambda r: r["concurrency"])
            label = f"{run} round {rnd}".strip()
            for ax, (key, _) in zip(axes, SERVING_METRICS, strict=True):
                ax.plot(
                    [r["concurrency"] for r in rows],
                    [r[key] for r in rows],
                    marker="o",
                    label=label,
                )
    title = f"input {results[0]['input_len']}, output {results[0]['output_len']}" if results else ""
    concurrencies = [row["concurrency"] for res in results for row in res["rows"]]
    for ax, (_, ylabel) in zip(axes, SERVING_METRICS, strict=True):
        _log2_x(ax, concurrencies)
        _label(ax, title, "concurrency", ylabel, fontsize="small")
    _save(fig, path)


def plot_prefill(results: list[dict], path: str, labels: list[str] | None = None) -> None:
    """TTFT p50 and p90 bars, one pair per run."""
    plt = require_matplotlib()
    names = [r["label"] for r in results]
    if labels:
        names = [f"{lab}\n{name}" for lab, name in zip(labels, names, strict=True)]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.6 * len(results) + 2), 4))
    width = 0.38
    xs = range(len(results))
    for off, key, name in (
        (-width / 2, "ttft_p50_ms", "TTFT p50"),
        (width / 2, "ttft_p90_ms", "TTFT p90"),
    ):
        bars = ax.bar([x + off for x in xs], [r[key] for r in results], width, label=name)
        ax.bar_label(bars, fmt="%.1f", fontsize="small")
    ax.set_xticks(list(xs), names, fontsize="small")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("prefill TTFT")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize="small")
    _save(fig, path)


def run_plot(args) -> int:
    data = [json.loads(Path(f).read_text()) for f in args.json_files]
    if args.kind in ("step", "decode"):
        points = [pt for d in data for pt in d]
        (plot_step if args.kind == "step" else plot_decode)(points, args.output)
    else:
        labels = [Path(f).stem for f in args.json_files] if len(data) > 1 else None
        (plot_prefill if args.kind == "prefill" else plot_serving)(data, args.output, labels)
    return 0
