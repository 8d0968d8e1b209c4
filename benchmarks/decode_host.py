"""Host time of a decode step outside the forward, per stage, at large batches (issue 14's
host path at high concurrency), on the CPU: the engine's scheduler with a real model, the
forward itself excluded from every stage. A decode step at batch 256 pays its per-request
Python once per step; under overlap scheduling that time is hidden only while it stays
below the GPU's step.

``--prefill N`` measures a cold prompt of N tokens instead, one request at a time into an
empty prefix cache (``bench prefill cold N 1``'s engine side): the schedule stage and the launch's host time before and
around the forward, which a TTFT waits for (the step's read-back wait excluded), and the
radix insert after the launch. ``--device cuda --model llama-3.1-8b`` runs it on a GPU with a
built-in config's dummy weights.

Each arm is a subprocess importing breakgraph from a tree: this one, and with ``--ref
COMMIT`` that commit's (``git archive``), interleaved over ``--rounds`` (every other round
in reverse order); the ratio is this tree's median over the reference's.

Usage: python benchmarks/decode_host.py [--batch 1 64 256] [--ref COMMIT] [--rounds 3]
       python benchmarks/decode_host.py --prefill 256 [--device cuda --model NAME] [--ref COMMIT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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


def measure(model_dir: str, batch: int, steps: int) -> dict[str, float]:
    """Median µs per decode step of each host stage (runs inside an arm's process)."""
    import torch

    from breakgraph.engine.args import EngineArgs
    from breakgraph.engine.engine import Engine
    from breakgraph.engine.request import SamplingParams

    torch.set_num_threads(1)
    args = EngineArgs(model_path=model_dir, load_format="dummy", device="cpu",
                      dtype="float32", max_total_tokens=batch * 256 + 4096,
                      max_running_requests=max(batch, 8))  # fmt: skip
    engine = Engine(args)
    sch = engine.scheduler
    spent, _ = _timed_steps(sch)
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(max_new_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(torch.randint(3, 1000, (64,), generator=g).tolist(), sp)
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
    spent, timed = _timed_steps(sch)
    timed(sch.prefill, "cache_computed", "cache")
    if device != "cpu":  # the read-back's wait outside the stage: the step's end first
        sch.process_outputs = _after(torch.cuda.synchronize, sch.process_outputs, spent)
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


def _after(sync, inner, spent: dict[str, float]):
    """``inner`` run after ``sync()`` (the device's work done), whose seconds add to
    ``spent["sync"]``."""

    def call(*a, **kw):
        t = time.perf_counter()
        sync()
        spent["sync"] += time.perf_counter() - t
        return inner(*a, **kw)

    return call


def _timed_steps(sch):
    """``(spent, timed)``: ``timed(obj, name, key)`` makes ``obj.name``'s calls add their
    seconds to ``spent[key]``, and the scheduler's forward, schedule, launch and
    process_outputs are timed so under their own names."""
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


def wire(model_dir: str, batch: int, reps: int = 200) -> None:
    """A decode step's outputs on their way to the API process, this tree's path (plain
    tokens as two columns) against the former one (a TokenDelta map per request), in the
    same process: the engine loop's packing and encoding, and the API side's decoding and
    per-request deltas."""
    import socket

    from host_path import best_ms  # benchmarks/ is the script's path

    from breakgraph.engine.args import EngineArgs
    from breakgraph.engine.engine import Engine
    from breakgraph.engine.request import SamplingParams
    from breakgraph.server.client import _InFlight
    from breakgraph.server.engine_process import EngineLoop, token_delta
    from breakgraph.server.ipc import EngineSocket
    from breakgraph.server.messages import StepResult, decode, encode

    args = EngineArgs(model_path=model_dir, load_format="dummy", device="cpu", dtype="float32",
                      max_total_tokens=batch * 256 + 4096, max_running_requests=batch)  # fmt: skip
    engine = Engine(args)
    sp = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request([3 + i % 900] * 8, sp)
    outs: list = []
    while not outs or any(o.timeline is not None for o in outs):  # past the first tokens
        outs = engine.step()
    assert len(outs) == batch
    ends = socket.socketpair()
    loop = EngineLoop(engine, EngineSocket(ends[0]))
    entries = {o.rid: _InFlight(None, 0.0, 0.0, 0.0) for o in outs}

    def old_engine() -> bytes:
        return encode(StepResult(1.0, [token_delta(o) for o in outs], []))

    def new_engine() -> bytes:
        loop._add_outputs(outs)
        msg = StepResult(1.0, loop._outputs, [], token_rids=loop._token_rids,
                         token_ids=loop._token_ids)  # fmt: skip
        data = encode(msg)  # what _send_step sends
        loop._outputs, loop._token_rids, loop._token_ids, loop._delta_rids = [], [], [], set()
        return data

    old_bytes, new_bytes = old_engine(), new_engine()

    def old_api() -> list:
        return [(entries[o.rid], o) for o in decode(old_bytes).outputs]

    def new_api() -> list:
        msg = decode(new_bytes)
        return [(entries[r], entries[r].plain(r, t)) for r, t in msg.plain_tokens()]

    assert [d.token_ids for _, d in old_api()] == [d.token_ids for _, d in new_api()]

    for side, old, new in (("engine", old_engine, new_engine), ("api", old_api, new_api)):
        o, n = best_ms(old, reps) * 1e3, best_ms(new, reps) * 1e3
        print(f"batch {batch:4d} wire {side:6s}: former {o:8.1f} µs  this {n:8.1f} µs  "
              f"({n / o:.3f}x)  bytes {len(old_bytes)} -> {len(new_bytes)}")  # fmt: skip
    engine.shutdown()
    for end in ends:
        end.close()


def trees(ref: str | None, tmp: Path) -> dict[str, Path]:
    """The arms' trees: this one, after ``ref``'s (``git archive`` into ``tmp``) if given."""
    if ref is None:
        return {"this": ROOT}
    dest = tmp / "ref"
    dest.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref],
                             check=True, capture_output=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return {"ref": dest, "this": ROOT}


def in_turn(arms: dict[str, Path], rnd: int) -> list[tuple[str, Path]]:
    """The arms in round ``rnd``'s order: odd rounds reversed (the second of two runs in a
    row measured up to 13% faster on the CPU box, the same code in both)."""
    order = list(arms.items())
    return order[::-1] if rnd % 2 else order


def run_arm(tree: Path, call: str) -> dict[str, float]:
    """``call`` (this module's ``measure(...)`` or ``measure_prefill(...)``) in a process
    importing breakgraph from ``tree``."""
    code = (f"import json, sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); "
            f"from decode_host import measure, measure_prefill; "
            f"print(json.dumps({call}))")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tree, check=True,
                         capture_output=True, text=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--steps", type=int, default=24, help="decode steps per run")
    ap.add_argument(
        "--prefill",
        type=int,
        nargs="+",
        metavar="N",
        help="cold prompts of N tokens, one at a time, instead of decode steps",
    )
    ap.add_argument("--requests", type=int, default=100, help="--prefill: prompts per run")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", help="a model directory or built-in config (default: a tiny "
                    "Qwen3 layout)")  # fmt: skip
    ap.add_argument("--ref", help="a commit to measure against (git archive of it)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-wire", action="store_true", help="skip the outputs' wire stage")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp, "model")
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(TINY))
        model = a.model or str(model_dir)
        arms = trees(a.ref, Path(tmp))
        if a.prefill:
            runs = [(f"prefill {n:5d}", PREFILL_STAGES, 1,
                     f"measure_prefill({model!r}, {n}, {a.requests}, {a.device!r})")
                    for n in a.prefill]  # fmt: skip
        else:
            runs = [(f"batch {b:4d}", STAGES, b, f"measure({model!r}, {b}, {a.steps})")
                    for b in a.batch]  # fmt: skip
        for label, stages, batch, call in runs:
            got: dict[str, list[dict[str, float]]] = defaultdict(list)
            for rnd in range(a.rounds):
                for name, tree in in_turn(arms, rnd):
                    got[name].append(run_arm(tree, call))
            for name in arms:
                med = {k: statistics.median(r[k] for r in got[name]) for k in stages}
                cells = "  ".join(f"{k} {med[k]:8.1f}" for k in stages)
                per = f"  ({med['host'] / batch:.2f} µs per request)" if batch > 1 else ""
                print(f"{label} {name:5s} µs/step: {cells}{per}", flush=True)
            if not a.prefill and not a.no_wire:
                wire(model, batch)
            if a.ref:
                ratios = {
                    k: statistics.median(r[k] for r in got["this"])
                    / statistics.median(r[k] for r in got["ref"])
                    for k in stages
                }
                print(f"{label} this/ref: "
                      + "  ".join(f"{k} {v:.3f}x" for k, v in ratios.items()), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
