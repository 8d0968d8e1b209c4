"""``bench decode --variants``: decode graphs captured under different kernel tables, timed
against each other in one process.

Separate processes per arm differ by up to 10% at batch 1 from run to run, more than most
table changes. Here one engine per variant (dummy weights) captures its decode graphs with
the variant's tables set (they decide what the graphs launch); then every variant's graph
step is timed in interleaved rounds, so that clock and placement drift fall on all of them
alike. Prints, per batch size, each variant's median over rounds of the median step (ms, a
sync around each step), its ratio to the first variant, and its largest logit difference to
the first; with ``--draft-tokens k`` each variant's verify step (1 + k rows a request).
Variants (``a+b``: both):

- ``base``: the code as it is;
- ``nogemv``: the skinny-GEMM table without its GEMV entries (batch 1 on the tensor-core
  kernel or cuBLAS);
- ``skinny=PATH``: the skinny-GEMM table that ``bench gemm --table-out PATH`` wrote (a sweep's
  table, another GPU's);
- ``moegemv<N>``: MoE steps of up to N tokens on the GEMV path (0: none);
- ``moetable=PATH``: the MoE GEMV table from a JSON file: rows ``[[max M, gate_up, down],
  ...]``, or ``bench moe --gemv-kernels --json``'s output (the model's best per kernel and M).
"""

from __future__ import annotations

import contextlib
import json
import statistics

import torch

from breakgraph.bench.decode_setup import decode_batch, decode_engine, verify_batch
from breakgraph.bench.timing import time_ms


def moe_gemv_table(path: str, model: str) -> tuple:
    """A ``fused_moe.GEMV_TABLE`` from JSON (the two forms of ``moetable=PATH``)."""
    from breakgraph.kernels.fused_moe import MoEGemvConfig

    with open(path) as f:
        data = json.load(f)
    if data and isinstance(data[0], dict):  # bench moe --gemv-kernels --json
        best = {(r["m"], r["kernel"]): tuple(r["top"][0][1]) for r in data if r["model"] == model}
        ms = sorted({m for m, _ in best})
        data = [[m, best[m, "gate_up"], best[m, "down"]] for m in ms]
    return tuple((m, MoEGemvConfig(tuple(g), tuple(d))) for m, g, d in data)


@contextlib.contextmanager
def _attribute(module, attr: str, value):
    """``module.attr`` set to ``value`` inside the block (a table the kernels read at each
    lookup), restored after."""
    saved = getattr(module, attr)
    setattr(module, attr, value)
    try:
        yield
    finally:
        setattr(module, attr, saved)


def switches(name: str, model: str) -> list[contextlib.AbstractContextManager]:
    """What variant ``name`` sets while its engine captures: tables and knobs."""
    from breakgraph.common import envs
    from breakgraph.kernels import fused_moe, skinny_gemm

    if "+" in name:
        return [s for part in name.split("+") for s in switches(part, model)]
    if name == "base":
        return []
    if name == "nogemv":
        table = {
            shape: [(m, cfg) for m, cfg in entries if cfg is None or not cfg.gemv]
            for shape, entries in skinny_gemm.SKINNY_TABLE.items()
        }
        return [_attribute(skinny_gemm, "SKINNY_TABLE", table)]
    if name.startswith("skinny="):
        return [envs.SKINNY.override(name[len("skinny=") :])]
    if name.startswith("moegemv") and name[len("moegemv") :].isdigit():
        return [envs.MOE_GEMV.override(int(name[len("moegemv") :]))]
    if name.startswith("moetable="):
        table = moe_gemv_table(name[len("moetable=") :], model)
        return [_attribute(fused_moe, "GEMV_TABLE", table)]
    raise SystemExit(f"error: unknown decode variant {name!r} (bench decode --help)")


@contextlib.contextmanager
def variant(name: str, model: str):
    """The variant's tables and knobs set inside the block, the former ones back after."""
    with contextlib.ExitStack() as stack:
        for switch in switches(name, model):
            stack.enter_context(switch)
        yield


def run_variants(args) -> list[dict]:
    if not torch.cuda.is_available():
        raise SystemExit("error: bench decode --variants needs a CUDA device")
    max_bs = max(args.batch_sizes)
    k = args.draft_tokens  # > 0: each variant's verify step (1 + k rows a request) instead
    results = []
    for model in args.models:
        engines = {}
        for name in args.variants:
            with variant(name, model):
                engines[name] = decode_engine(
                    model, "cuda", max_bs, args.context, draft_tokens=k, tp_size=args.tp_size,
                    disable_custom_all_reduce=args.disable_custom_all_reduce,
                )  # fmt: skip
        for bs in args.batch_sizes:
            samples: dict[str, list[float]] = {name: [] for name in engines}
            calls = {}
            for name, (eng, rows, slots) in engines.items():
                if k:
                    batch = verify_batch(eng, rows, slots, bs, args.context, k)
                else:
                    batch = decode_batch(eng, rows, slots, bs, args.context)
                calls[name] = lambda r=eng.runner, b=batch: r.forward(b)
            for _ in range(args.rounds):
                for name, call in calls.items():
                    samples[name].append(time_ms(call, args.reps))
            logits = {name: call().float() for name, call in calls.items()}
            first = args.variants[0]
            base = statistics.median(samples[first])
            line = f"{model:<14} bs={bs:<3} C={args.context:<6}" + (f" k={k}" if k else "")
            for name in engines:
                ms = statistics.median(samples[name])
                diff = (logits[name] - logits[first]).abs().max().item()
                results.append(
                    dict(model=model, batch_size=bs, context=args.context, draft_tokens=k,
                         variant=name, ms=ms,
                         ratio=ms / base, samples=samples[name], max_logit_diff=diff)
                )  # fmt: skip
                line += f"  {name} {ms:.3f} ({ms / base:.3f}x, dlogit {diff:.2g})"
            print(line, flush=True)
        for eng, _, _ in engines.values():
            eng.shutdown()
        del engines, calls
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results
