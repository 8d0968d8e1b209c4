"""Decode-graph variants against each other in one process (issue 19).

One engine per model (dummy weights); the decode graphs captured once per variant, a variant
being kernel-module switches set while it captures (they decide what the graph launches);
then every variant's graph step timed in interleaved rounds, so that clock and placement
drift fall on all of them alike. Separate processes per arm (h200_decode.sh) differ by up to
10% run to run at batch 1, more than the changes measured here. Prints, per batch size, each
variant's median over rounds of the median step (ms, a sync around each step) and its ratio
to the first variant.

    python benchmarks/decode_ab.py --models qwen3-0.6b --batch-sizes 1 2 4 8 \\
        --context 1024 --variants base merge nogemv --rounds 7 [--profile] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics

import torch

from breakgraph.bench.decode import decode_batch, decode_engine, profile_calls
from breakgraph.bench.step import time_ms
from breakgraph.engine.cuda_graphs import DecodeGraphs
from breakgraph.kernels import decode_attention, fused_moe, pdl, skinny_gemm


def _gemv_table(
    model: str, block_n: int, block_k: int, num_stages: int = 2, max_m: int = 8,
    only: set[str] | None = None, warps: int = 4,
) -> dict:  # fmt: skip
    """The table with every projection of ``model`` (or those named in ``only``: qkv, o,
    gate_up, down, lm_head, a family's others) on the GEMV kernel up to ``max_m`` rows
    (gate/up with half the K chunk: it holds its up rows too), the table's entries above that;
    shapes the table lacks (another family's) too."""
    from breakgraph.bench.gemm import projection_shapes

    c = skinny_gemm.SkinnyConfig
    table = dict(skinny_gemm.SKINNY_TABLE)
    for name, shape in projection_shapes(model):
        if only is not None and name not in only:
            continue
        bk = block_k // 2 if name == "gate_up" else block_k
        gemv = c(block_n, bk, 1, warps, num_stages, fuse_norm=False, gemv=True)
        above = [(m, cfg) for m, cfg in table.get(shape, ()) if m > max_m]
        table[shape] = [(max_m, gemv)] + above
    return table


def _swept_table(path: str) -> dict:
    """The table with each shape's batch-1 GEMV config replaced by the best one that
    ``benchmarks/gemv_sweep.py --json PATH`` measured for it."""
    with open(path) as f:
        swept = {(r["n"], r["k"]): skinny_gemm.SkinnyConfig(**r["best"]) for r in json.load(f)}
    table = dict(skinny_gemm.SKINNY_TABLE)
    for shape, cfg in swept.items():
        table[shape] = [(1, cfg)] + [(m, c) for m, c in table.get(shape, ()) if m > 1]
    return table


def _no_gemv_table() -> dict:
    """The table without its GEMV entries (batch 1 back on the tensor-core kernel or cuBLAS)."""
    return {
        shape: [(m, cfg) for m, cfg in entries if cfg is None or not cfg.gemv]
        for shape, entries in skinny_gemm.SKINNY_TABLE.items()
    }


def _moe_gemv_table(path: str, model: str) -> tuple:
    """A ``fused_moe.GEMV_TABLE`` from JSON: its rows ``[[max M, gate_up, down], ...]``, or
    benchmarks/moe_gemv_kernels.py's output (``model``'s best config per kernel and M)."""
    with open(path) as f:
        data = json.load(f)
    if data and isinstance(data[0], dict):  # moe_gemv_kernels.py --json
        best = {(r["m"], r["kernel"]): tuple(r["top"][0][1]) for r in data if r["model"] == model}
        ms = sorted({m for m, _ in best})
        data = [[m, best[m, "gate_up"], best[m, "down"]] for m in ms]
    return tuple((m, fused_moe.MoEGemvConfig(tuple(g), tuple(d))) for m, g, d in data)


# name -> [(module, attribute, value)] set while the variant captures
VARIANTS = {
    "base": [],
    "nopdl": [(pdl, "MODE", "0")],
    "merge": [(decode_attention, "MERGE_IN_SPLIT", True)],
    "nogemv": [(skinny_gemm, "SKINNY_TABLE", "nogemv")],
    # each shape's batch-1 GEMV config from benchmarks/gemv_sweep.py's JSON ($GEMV_SWEEP)
    "swept": [(skinny_gemm, "SKINNY_TABLE", "swept")],
    # the MoE grouped path's kernels under PDL too (fused_moe.GROUPED_PDL)
    "moepdl": [(fused_moe, "GROUPED_PDL", True)],
}


def variant(name: str) -> list:
    """VARIANTS' entry; ``a+b``: both; ``splits<N>`` / ``bn<N>``: decode attention's
    split count / keys per iteration fixed at N; ``onepass<N>``: decode attention in one pass (no
    split, no merge) from N (request, kv head) programs; or for ``gemv<BN>[k<BK>][w<warps>][s<stages>]
    [-<projection>...][@<max M>]`` (gemv8, gemv16k512, gemv4-qkv-o@1, gemv2k512w2@1): those
    projections (default all) on the GEMV kernel with BLOCK_N = BN (BLOCK_K 1024, 4 warps, 2
    stages unless given) up to max M rows (8)."""
    if "+" in name:  # several switches at once: splits16+bn64
        return [switch for part in name.split("+") for switch in variant(part)]
    if name in VARIANTS:
        return VARIANTS[name]
    found = re.fullmatch(r"(splits|bn)(\d+)", name)
    if found:  # decode attention's split count, or its keys per iteration, fixed
        attr = "default_num_kv_splits" if found.group(1) == "splits" else "_decode_block_n"
        return [(decode_attention, attr, lambda *_, v=int(found.group(2)): v)]
    if name.startswith("moegemv"):  # moegemv<N>: MoE steps of up to N tokens on the GEMV path
        gemv = [(fused_moe, "GEMV_MAX_TOKENS", int(name[len("moegemv") :]))]
        if os.environ.get("MOE_GEMV_SWEEP"):  # bench.moe --gemv-json's config at the least M
            with open(os.environ["MOE_GEMV_SWEEP"]) as f:
                cfg = {k: tuple(v) for k, v in json.load(f)["rows"][0]["config"].items()}
            gemv.append((fused_moe, "GEMV_CONFIG", fused_moe.MoEGemvConfig(**cfg)))
        return gemv
    if name.startswith("moetable="):  # moetable=PATH: fused_moe.GEMV_TABLE from a JSON file
        return [(fused_moe, "GEMV_TABLE", ("moetable", name[len("moetable=") :]))]
    if name.startswith("onepass"):  # onepass<N>: one-pass decode attention from N programs
        return [(decode_attention, "ONE_PASS_PROGRAMS", int(name[len("onepass") :]))]
    spec, _, max_m = name.partition("@")
    head, *projections = spec.split("-")
    found = re.fullmatch(r"gemv(\d+)(?:k(\d+))?(?:w(\d+))?(?:s(\d+))?", head)
    assert found, f"unknown variant {name!r}"
    block_n, block_k, warps, stages = (int(g) if g else None for g in found.groups())
    only = set(projections) if projections else None
    table = ("gemv", block_n, block_k or 1024, stages or 2, int(max_m or 8), only, warps or 4)
    return [(skinny_gemm, "SKINNY_TABLE", table)]


@contextlib.contextmanager
def switches(name: str, model: str):
    """The variant's switches set (for ``model``: a GEMV variant covers its projections)."""
    saved = []
    for module, attr, value in variant(name):
        saved.append((module, attr, getattr(module, attr)))
        if value == "nogemv":
            value = _no_gemv_table()
        elif value == "swept":
            value = _swept_table(os.environ.get("GEMV_SWEEP", "gemv.json"))
        elif isinstance(value, tuple) and value[0] == "moetable":
            value = _moe_gemv_table(value[1], model)
        elif isinstance(value, tuple) and value[0] == "gemv":
            value = _gemv_table(model, *value[1:])
        setattr(module, attr, value)
    try:
        yield
    finally:
        for module, attr, value in reversed(saved):
            setattr(module, attr, value)


def kernel_table(fn, reps: int = 10) -> list[tuple[str, float, float]]:
    """(name, µs per step, calls per step) of the kernels one call of ``fn`` runs (graph
    replays included), largest first. Under PDL a kernel's time includes its wait."""
    prof = profile_calls(fn, reps)
    rows = [
        (ev.key[:60], ev.self_device_time_total / reps, ev.count / reps)
        for ev in prof.key_averages()
        if ev.self_device_time_total > 0
    ]
    return sorted(rows, key=lambda r: -r[1])


def run(args) -> list[dict]:
    # every variant replays its plain capture, never the long-context one (the variant
    # bn64+splits128 is that one's kernel): the switches decide what each arm runs
    decode_attention.LONG_CONTEXT_MIN_TOKENS = 1 << 62
    max_bs = max(args.batch_sizes)
    results = []
    for model in args.models:
        eng, rows, slots = decode_engine(model, "cuda", max_bs, args.context)
        runner = eng.runner
        pad = runner.decode_graphs.pad_req_idx
        graphs = {}
        for name in args.variants:
            with switches(name, model), torch.inference_mode():
                g = DecodeGraphs(
                    runner.model, runner.kv_pool, runner.req_to_token, pad, max_bs,
                    torch.cuda.graph_pool_handle(),
                )  # fmt: skip
                g.capture()
            graphs[name] = g
        for bs in args.batch_sizes:
            batch = decode_batch(eng, rows, slots, bs, args.context)
            samples = {name: [] for name in args.variants}
            logits = {}
            with torch.inference_mode():
                for _ in range(args.rounds):
                    for name, g in graphs.items():
                        samples[name].append(time_ms(lambda g=g, b=batch: g.run(b), args.reps))
                for name, g in graphs.items():
                    logits[name] = g.run(batch).clone()
            if args.profile:
                for name, g in graphs.items():
                    with torch.inference_mode():
                        table = kernel_table(lambda g=g, b=batch: g.run(b))
                    total = sum(us for _, us, _ in table)
                    print(f"{model} bs={bs} {name}: kernels {total:.1f} us per step", flush=True)
                    for kname, us, calls in table[:14]:
                        print(f"    {us:8.1f} us {calls:6.1f} x {us / calls:6.2f} us  {kname}")
            first = args.variants[0]
            base = statistics.median(samples[first])
            line = f"{model:<14} bs={bs:<3} C={args.context:<6}"
            for name in args.variants:
                ms = statistics.median(samples[name])
                diff = (logits[name] - logits[first]).abs().max().item()
                results.append(
                    dict(model=model, batch_size=bs, context=args.context, variant=name,
                         ms=ms, ratio=ms / base, samples=samples[name], max_logit_diff=diff)
                )  # fmt: skip
                line += f"  {name} {ms:.3f} ({ms / base:.3f}x, dlogit {diff:.2g})"
            print(line, flush=True)
        eng.shutdown()
        del eng, runner, graphs
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["qwen3-0.6b"])
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 2, 4, 8])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument(
        "--variants", nargs="+", default=["base", "merge"],
        help=f"{', '.join(VARIANTS)}, onepass<N>, gemv<BN>[k<BK>][w<W>][s<S>][-<projection>...][@<max M>], moegemv<N>, moetable=PATH",
    )  # fmt: skip
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--profile", action="store_true", help="kernel time by name per step")
    p.add_argument("--json")
    run(p.parse_args())


if __name__ == "__main__":
    main()
