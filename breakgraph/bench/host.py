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
reverse order); the ratio is this tree's median over the reference's. This file runs inside
those subprocesses by path, so it imports breakgraph only inside its functions.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
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


def timed_steps(sch):
    """``(spent, timed)``: ``timed(obj, name, key)`` makes ``obj.name``'s calls add their
    seconds to ``spent[key]``; the scheduler's forward, schedule, launch and process_outputs
    are timed so under their own names."""
    spent: dict[str, float] = defaultdict(float)

    def timed(obj, name: str, key: str) -> None:
        inner = getattr(obj, name)

        def call(*a, **kw):
            t = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                spent[key] += time.perf_counter() - t

        setattr(obj, name, call)

    for name in ("forward", "schedule", "launch", "process_outputs"):
        timed(sch, name, name)
    return spent, timed


def measure_decode(model: str, batch: int, steps: int, device: str) -> dict[str, float]:
    """Median µs per decode step of each host stage (runs inside an arm's process)."""
    import torch

    from breakgraph.engine.args import EngineArgs
    from breakgraph.engine.engine import Engine
    from breakgraph.engine.request import SamplingParams

    if device == "cpu":
        torch.set_num_threads(1)
    args = EngineArgs(model_path=model, load_format="dummy", device=device,
                      dtype="float32" if device == "cpu" else "auto",
                      max_total_tokens=batch * 256 + 4096,
                      max_running_requests=max(batch, 8))  # fmt: skip
    engine = Engine(args)
    sch = engine.scheduler
    spent, _ = timed_steps(sch)
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(max_new_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    low = min(3, engine.vocab_size // 2)
    for _ in range(batch):
        engine.add_request(
            torch.randint(low, min(1000, engine.vocab_size), (64,), generator=g).tolist(), sp
        )
    rows: dict[str, list[float]] = defaultdict(list)
    decodes = 0
    while engine.has_work:
        spent.clear()
        t = time.perf_counter()
        engine.step()
        total = time.perf_counter() - t
        if sch.last_step_tokens != batch or sch.prefill.waiting:
            continue  # prefill steps
        decodes += 1
        if decodes <= 3:
            continue  # the first decodes (buffers grow)
        rows["schedule"].append(spent["schedule"])
        rows["launch"].append(spent["launch"] - spent["forward"])
        rows["process_outputs"].append(spent["process_outputs"])
        rows["host"].append(total - spent["forward"])
    engine.shutdown()
    return {k: statistics.median(v) * 1e6 for k, v in rows.items()}


def measure_prefill(model: str, tokens: int, requests: int, device: str) -> dict[str, float]:
    """Median µs per cold prompt of ``tokens`` tokens, one request at a time, of the schedule
    stage, the launch outside the forward's own host time, the radix insert after the launch
    and the read-back's host time (its wait for the device excluded); ``host``: the steps
    until its token is out, outside the forward and that wait (an arm's process)."""
    import torch

    from breakgraph.engine.args import EngineArgs
    from breakgraph.engine.engine import Engine
    from breakgraph.engine.request import SamplingParams

    if device == "cpu":
        torch.set_num_threads(1)
    args = EngineArgs(model_path=model, load_format="dummy", device=device,
                      dtype="float32" if device == "cpu" else "auto",
                      max_total_tokens=tokens * 4 + 4096, chunked_prefill_size=max(tokens, 256),
                      context_length=max(tokens + 64, 4096))  # fmt: skip
    engine = Engine(args)
    engine.release_finished(defer=True)  # as the server's loop: after the outputs are sent
    sch = engine.scheduler
    spent, timed = timed_steps(sch)
    timed(sch.prefill, "cache_computed", "cache")
    if device != "cpu":  # the read-back's wait outside the stage: the step's end first
        inner = sch.process_outputs

        def synced(*a, **kw):
            t = time.perf_counter()
            torch.cuda.synchronize()
            spent["sync"] += time.perf_counter() - t
            return inner(*a, **kw)

        sch.process_outputs = synced
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    low = min(1000, engine.vocab_size // 2)
    rows: dict[str, list[float]] = defaultdict(list)
    for i in range(requests + 5):
        engine.flush_cache()  # as bench prefill flushes before each wave: nothing to evict
        engine.add_request(
            torch.randint(low, engine.vocab_size - 1, (tokens,), generator=g).tolist(), sp
        )
        spent.clear()
        t = time.perf_counter()
        outs = engine.step()
        while not outs:  # overlap scheduling: the next step reads this one back
            outs = engine.step()
        total = time.perf_counter() - t
        assert len(outs) == 1 and outs[0].finished, "one cold prompt, one token"
        engine.release_finished()
        if i < 5:
            continue  # compiles, buffers
        rows["schedule"].append(spent["schedule"])
        rows["launch"].append(spent["launch"] - spent["forward"])
        rows["cache"].append(spent["cache"])
        rows["process_outputs"].append(spent["process_outputs"])
        rows["host"].append(total - spent["forward"] - spent["sync"])
    engine.shutdown()
    return {k: statistics.median(v) * 1e6 for k, v in rows.items()}


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


def run_arm(tree: Path, fn: str, fn_args: tuple) -> dict[str, float]:
    """This file's ``fn(*fn_args)`` in a process importing breakgraph from ``tree``."""
    code = (f"import json, runpy; m = runpy.run_path({__file__!r}); "
            f"print(json.dumps(m[{fn!r}](*{fn_args!r})))")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tree, capture_output=True,
                         text=True)  # fmt: skip
    if out.returncode != 0:
        raise SystemExit(f"error: the {tree} arm failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_host_bench(args) -> dict:
    if args.what == "api":
        from breakgraph.bench.host_api import run_api

        return run_api(args)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model_path
        if model is None:
            model = str(Path(tmp, "model"))
            Path(model).mkdir()
            Path(model, "config.json").write_text(json.dumps(TINY))
        arms = trees(args.ref, Path(tmp))
        if args.what == "prefill":
            requests = args.requests or 100
            runs = [(f"prefill {n:5d}", PREFILL_STAGES, 1, "measure_prefill",
                     (model, n, requests, args.device)) for n in args.tokens]  # fmt: skip
        else:
            runs = [(f"batch {b:4d}", STAGES, b, "measure_decode",
                     (model, b, args.steps, args.device)) for b in args.batch]  # fmt: skip
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
