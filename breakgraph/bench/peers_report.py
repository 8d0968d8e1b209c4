"""``bench peers``'s report: per model and setting a markdown table of each measurement for
breakgraph, the peer and their ratio; both engines' configurations; the JSON of the whole run
and a plot of the ratios."""

from __future__ import annotations

import datetime
import json
import shlex
import statistics
import subprocess
from dataclasses import asdict, dataclass

from breakgraph.bench.peer_engines import EngineRun

SERVING_METRICS = (  # (LevelResult field, label, higher is better)
    ("ttft_p50_ms", "TTFT p50 (ms)", False),
    ("decode_step_p50_ms", "decode step p50 (ms)", False),
    ("tok_s_per_user_p50", "tok/s per user p50", True),
    ("output_tok_s", "output tok/s", True),
)


@dataclass
class Table:
    model: str
    setting: str
    breakgraph: EngineRun
    peer: EngineRun

    def rows(self) -> list[dict]:
        """Each measurement both runs share a key for: metric, both values, ratio (breakgraph
        / peer), and whether higher is better; a value one run lacks is None."""
        bg, peer = metrics(self.breakgraph), metrics(self.peer)
        rows = []
        for key in dict.fromkeys([*bg, *peer]):
            (a, higher), (b, _) = bg.get(key, (None, False)), peer.get(key, (None, False))
            if key in peer:
                higher = peer[key][1]
            ratio = a / b if a is not None and b else None
            rows.append({"metric": key, "breakgraph": a, "peer": b, "ratio": ratio,
                         "higher_is_better": higher})  # fmt: skip
        return rows


def metrics(run: EngineRun) -> dict[str, tuple[float | None, bool]]:
    """A run's measurements by row label: (value, higher is better)."""
    out: dict[str, tuple[float | None, bool]] = {}
    if run.startup_cold_s is not None:
        out["startup to ready, cold compile caches (s)"] = (run.startup_cold_s, False)
    if run.startup_s is not None:
        warm = ", warm caches" if run.startup_cold_s is not None else ""
        out[f"startup to ready{warm} (s)"] = (run.startup_s, False)
    if run.first:
        first, tokens = run.first, run.first["tokens"]
        out[f"first request after ready: TTFT, {tokens} tokens (ms)"] = (first["ttft_ms"], False)
        out[f"later ones (steady): TTFT, {tokens} tokens (ms)"] = (first["steady_ttft_ms"], False)
    for res in run.prefill:
        out[f"{res['label']}: TTFT p50 (ms)"] = (res["ttft_p50_ms"], False)
        if res["concurrency"] > 1:
            out[f"{res['label']}: input tok/s"] = (res["input_tok_s"], True)
    for concurrency in dict.fromkeys(row["concurrency"] for row in run.serving):
        rows = [row for row in run.serving if row["concurrency"] == concurrency]
        for field, label, higher in SERVING_METRICS:
            values = [row[field] for row in rows if row[field] == row[field]]  # not NaN
            value = statistics.median(values) if values else None
            out[f"serving, concurrency {concurrency}: {label}"] = (value, higher)
    return out


def _fmt(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.2f}"


def format_table(table: Table) -> str:
    peer = table.peer.engine
    lines = [
        f"| {table.model}, {table.setting} | breakgraph | {peer} | breakgraph / {peer} |",
        "|---|---:|---:|---:|",
    ]
    for row in table.rows():
        ratio = "—" if row["ratio"] is None else f"{row['ratio']:.2f}x"
        label = row["metric"] + (" ↑" if row["higher_is_better"] else "")
        lines.append(f"| {label} | {_fmt(row['breakgraph'])} | {_fmt(row['peer'])} | {ratio} |")
    return "\n".join(lines)


def format_config(run: EngineRun) -> str:
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(run.env.items()))
    lines = [f"{run.engine} {run.version or '?'} ({run.model}, {run.setting}):",
             f"  {env + ' ' if env else ''}{shlex.join(run.command)}"]  # fmt: skip
    if run.error:
        lines.append("  FAILED: " + run.error.replace("\n", "\n    "))
    lines.append(f"  log: {run.log}")
    return "\n".join(lines)


def device_name() -> str:
    """The GPU's name as nvidia-smi gives it, else ``cpu``."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "cpu"
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout else "cpu"


def result(args, peer: str, commit: str | None, runs: list[EngineRun], tables: list[Table]):
    import breakgraph

    return {
        "bench": "peers",
        "date": datetime.date.today().isoformat(),
        "device": device_name(),
        "breakgraph_version": breakgraph.__version__,
        "breakgraph_commit": commit,
        "peer": peer,
        "args": {k: v for k, v in vars(args).items() if k not in ("func", "parser")},
        "runs": [asdict(run) for run in runs],
        "tables": [{"model": t.model, "setting": t.setting, "rows": t.rows()} for t in tables],
    }


def format_report(res: dict, tables: list[Table]) -> str:
    head = (f"\nbench peers, {res['date']}, {res['device']}; breakgraph "
            f"{res['breakgraph_version']} ({res['breakgraph_commit'] or 'no git'}) against "
            f"{res['peer']}. Ratios are breakgraph / {res['peer']}: below 1 breakgraph's time "
            "is shorter; on a ↑ row (throughput) above 1 breakgraph is ahead.")  # fmt: skip
    seen, configs = set(), []
    for t in tables:
        for run in (t.breakgraph, t.peer):
            if id(run) not in seen:
                seen.add(id(run))
                configs.append(format_config(run))
    return "\n\n".join([head, "\n".join(configs), *(format_table(t) for t in tables),
                        *(p for t in tables if (p := format_profile(t, res)))])  # fmt: skip


def format_profile(t: Table, res: dict) -> str:
    """``--profile``: both engines' profiled wave, side by side (peer_profile.py)."""
    from breakgraph.bench.peer_profile import format_profiles

    runs = [r for r in (t.breakgraph, t.peer) if r.profile]
    if not runs:
        return ""
    title = f"{res['args'].get('profile')} ({t.model}, {t.setting})"
    return "\n".join(format_profiles(title, {r.engine: r.profile for r in runs}))


def save(res: dict, json_path: str | None, plot_path: str | None) -> None:
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res, f, indent=1)
    if plot_path:
        plot_ratios(res["tables"], res["peer"], plot_path)


def plot_ratios(tables: list[dict], peer: str, path: str) -> None:
    """One panel per model and setting: each row's breakgraph / peer ratio as a bar (a
    throughput row inverted, so that below 1 is breakgraph ahead on every bar)."""
    from breakgraph.bench.plot import require_matplotlib

    plt = require_matplotlib()
    panels = [(t, [r for r in t["rows"] if r["ratio"]]) for t in tables]
    panels = [(t, rows) for t, rows in panels if rows]
    if not panels:
        return
    height = max(len(rows) for _, rows in panels) * 0.32 + 1.2
    fig, axes = plt.subplots(1, len(panels), figsize=(7.5 * len(panels), height), squeeze=False)
    for ax, (t, rows) in zip(axes[0], panels, strict=True):
        ratios = [1 / r["ratio"] if r["higher_is_better"] else r["ratio"] for r in rows]
        colors = ["tab:green" if x <= 1 else "tab:red" for x in ratios]
        ys = list(range(len(rows)))
        # each bar from parity (1) to its ratio, labelled: its length is the gap
        ax.barh(ys, [x - 1 for x in ratios], left=1.0, color=colors)
        for y, x in zip(ys, ratios, strict=True):
            ax.annotate(f"{x:.2f}", (x, y), xytext=(3 if x > 1 else -3, 0),
                        textcoords="offset points", va="center", fontsize="xx-small",
                        ha="left" if x > 1 else "right")  # fmt: skip
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_xscale("log", base=2)
        lo, hi = min(ratios + [1.0]), max(ratios + [1.0])
        ax.set_xlim(lo / 1.35, hi * 1.35)  # room for the labels
        ax.set_yticks(ys, [r["metric"].strip() for r in rows], fontsize="x-small")
        ax.invert_yaxis()
        ax.set_xlabel(f"breakgraph / {peer} (time; throughput inverted): below 1 is faster")
        ax.set_title(f"{t['model']}, {t['setting']}", fontsize="small")
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
