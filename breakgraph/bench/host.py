"""``breakgraph bench host decode | prefill | api``: host time outside the forward.

``decode``: a decode step's host stages at large batches (the engine's scheduler with a real
model, on the CPU by default, the forward itself excluded from every stage): schedule, the
launch around the forward, processing the outputs, and the step's whole host time. A decode
step at batch 256 pays its per-request Python once per step; under overlap scheduling that
time is hidden only while it stays below the GPU's step. ``prefill``: a cold prompt of N
tokens, one request at a time into an empty prefix cache (``bench prefill cold N 1``'s engine
side): the schedule stage, the launch's host time around the forward, the radix insert after
the launch, which a TTFT waits for (the step's read-back wait excluded). ``--device cuda
--model-path llama-3.1-8b`` runs either on a GPU with a built-in config's dummy weights.
``api``: the API process's CPU time per streamed output token (host_api.py).

Each arm is a subprocess importing breakgraph from a tree: this one, and with ``--ref
COMMIT`` that commit's (``git archive``), interleaved over ``--rounds`` (every other round in
reverse order); the ratio is this tree's median over the reference's. Their measurements
run inside those subprocesses by path (host_engine.py).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the tree this file's breakgraph is imported from
# Qwen3-0.6B's layout at two layers and hidden 128, a 1K vocabulary (the sampling of a 152K
# vocabulary on the CPU would be most of the host time measured)
TINY = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1024,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
    "tie_word_embeddings": True, "eos_token_id": 1,
}  # fmt: skip
STAGES = ("schedule", "launch", "process_outputs", "host")
PREFILL_STAGES = ("schedule", "launch", "cache", "process_outputs", "host")


def trees(ref: str | None, tmp: Path) -> dict[str, Path]:
    """The arms' trees: this one, after ``ref``'s (``git archive`` into ``tmp``) if given."""
    if ref is None:
        return {"this": ROOT}
    dest = tmp / "ref"
    dest.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], capture_output=True)
    if archive.returncode != 0:
        raise SystemExit(f"error: --ref {ref}: {archive.stderr.decode().strip()} (in {ROOT})")
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return {"ref": dest, "this": ROOT}


def in_turn(arms: dict[str, Path], rnd: int) -> list[tuple[str, Path]]:
    """The arms in round ``rnd``'s order: odd rounds reversed (the second of two runs in a
    row measured up to 13% faster on a CPU box, the same code in both)."""
    order = list(arms.items())
    return order[::-1] if rnd % 2 else order


ENGINE_SIDE = Path(__file__).with_name("host_engine.py")


def run_arm(tree: Path, fn: str, fn_args: tuple) -> dict[str, float]:
    """host_engine.py's ``fn(*fn_args)`` in a process importing breakgraph from ``tree``."""
    code = (f"import json, runpy; m = runpy.run_path({str(ENGINE_SIDE)!r}); "
            f"print(json.dumps(m[{fn!r}](*{fn_args!r})))")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tree, capture_output=True,
                         text=True)  # fmt: skip
    if out.returncode != 0:
        raise SystemExit(f"error: the {tree} arm failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _model_dir(args, tmp: str) -> str:
    """``--model-path``, else the tiny config (``TINY``) written under ``tmp``."""
    if args.model_path is not None:
        return args.model_path
    model = Path(tmp, "model")
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY))
    return str(model)


def run_host_bench(args) -> dict:
    if args.what == "api":
        return run_api(args)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = _model_dir(args, tmp)
        arms = trees(args.ref, Path(tmp))
        if args.what == "prefill":
            requests = args.requests or 100
            runs = [(f"prefill {n:5d}", PREFILL_STAGES, 1, "measure_prefill",
                     (model, n, requests, args.device)) for n in args.tokens]  # fmt: skip
        else:
            spec = (args.speculative, args.draft_tokens) if args.speculative else ()
            runs = [(f"batch {b:4d}", STAGES, b, "measure_decode",
                     (model, b, args.steps, args.device, *spec)) for b in args.batch]  # fmt: skip
        for label, stages, batch, fn, fn_args in runs:
            got: dict[str, list[dict[str, float]]] = defaultdict(list)
            for rnd in range(args.rounds):
                for name, tree in in_turn(arms, rnd):
                    got[name].append(run_arm(tree, fn, fn_args))
            med = {
                name: {k: statistics.median(r[k] for r in got[name]) for k in stages}
                for name in arms
            }
            for name, m in med.items():
                cells = "  ".join(f"{k} {m[k]:8.1f}" for k in stages)
                per = f"  ({m['host'] / batch:.2f} µs per request)" if batch > 1 else ""
                print(f"{label} {name:5s} µs/step: {cells}{per}", flush=True)
            if args.ref:
                ratios = "  ".join(f"{k} {med['this'][k] / med['ref'][k]:.3f}x" for k in stages)
                print(f"{label} this/ref: {ratios}", flush=True)
            results[" ".join(label.split())] = med
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


def run_api(args) -> dict:
    """``bench host api``: the API process's CPU per output token, per arm (host_api.py)."""
    from breakgraph.bench.host_api import measure as api_cpu

    with tempfile.TemporaryDirectory() as tmp:
        model = _model_dir(args, tmp)
        arms = trees(args.ref, Path(tmp))
        got: dict[str, list[dict[str, float]]] = {name: [] for name in arms}
        for rnd in range(args.rounds):
            for name, tree in in_turn(arms, rnd):
                flags = args.flags if name == "this" else args.ref_flags
                got[name].append(api_cpu(tree, args, model, flags))
                print(name, json.dumps({k: round(v, 2) for k, v in got[name][-1].items()}),
                      flush=True)  # fmt: skip
    med = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in got.items()}
    for name, m in med.items():
        print(f"{name:5s} concurrency {args.concurrency}: API {m['api_us_per_token']:.1f} µs "
              f"CPU per output token (busy {m['api_share']:.0%}), engine "
              f"{m['engine_us_per_token']:.1f} µs, {m['output_tok_s']:.0f} tok/s")  # fmt: skip
    if args.ref:
        ratio = med["this"]["api_us_per_token"] / med["ref"]["api_us_per_token"]
        print(f"API CPU per output token, this/ref: {ratio:.3f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(med, f, indent=1)
    return med
