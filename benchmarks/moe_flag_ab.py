"""One MoEConfig variant flag on and off at the table's config, in one process (#13).

``bench.moe --set FLAG=0|1`` overrides a flag for a whole run, so an A/B takes two processes
and the device's warm-up drift between them. Here each M's layer is captured twice, with the
table's config at that M and the flag forced on and off, and the two graph replays alternate
for ``--rounds`` rounds beside the dense cuBLAS reference of the same active FLOPs: the
median ms of each, its ratio to dense, and on / off.

    python benchmarks/moe_flag_ab.py --flag half_tail [--models qwen3-30b-a3b gemma-4-26b-a4b]
        [--tokens 2048 4096 8192] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from breakgraph.bench import moe as bm
from breakgraph.bench.kernels import bench_ms
from breakgraph.kernels import fused_moe as fm


def flag_ab(model: str, m: int, flag: str, rounds: int) -> dict:
    """Median graph-replay ms of the layer with ``flag`` off and on, and of dense."""
    s = bm.expert_shapes(model)
    layer = bm.Layer(m, s)
    table = fm.moe_config(m, s["top_k"], s["experts"])
    arms = {
        state: bm.with_config(table._replace(**{flag: state}), lambda: bm.graphed(layer))
        for state in (False, True)
    }
    times = {False: [], True: []}
    for _ in range(rounds):
        for state, replay in arms.items():
            times[state].append(bench_ms(replay))
    dense = bench_ms(bm.dense_reference(m, s))
    return dict(
        model=model, m=m, dense=dense, table=getattr(table, flag),
        off=statistics.median(times[False]), on=statistics.median(times[True]),
    )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flag", required=True, choices=bm.VARIANT_FLAGS)
    parser.add_argument("--models", nargs="+", default=["qwen3-30b-a3b", "gemma-4-26b-a4b"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("moe_flag_ab.py needs a CUDA device; nothing to measure here.")
        return
    print(f"{args.flag}: the table's config at each M with the flag off and on (graph ms, median)")
    print(f"{'model':<18} {'M':>6} {'table':>6} {'dense':>7} {'off':>13} {'on':>13} {'on/off':>7}")
    for model in args.models:
        for m in args.tokens:
            r = flag_ab(model, m, args.flag, args.rounds)
            d = r["dense"]
            print(f"{model:<18} {m:>6} {'on' if r['table'] else 'off':>6} {d:7.3f} "
                  f"{r['off']:7.3f} ({r['off'] / d:.2f}x) {r['on']:7.3f} ({r['on'] / d:.2f}x) "
                  f"{r['on'] / r['off']:7.3f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
