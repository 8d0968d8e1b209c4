"""The MoE layer's alignment and top-k sum against a former ``fused_moe`` module, in one
process (#13): per M, the layer's graph replay (routing + experts, the table's config) with
the former module, with this one (``atomic_sum`` forced off, then on, then on with one
atomic_add per element instead of 16-byte reductions), and the alignment alone (former /
this), medians of ``--rounds`` alternating rounds, µs; and each arm's output against the
former module's on one routing (relative norm of the difference).

    git show 264125f:breakgraph/kernels/fused_moe.py > .dev/fused_moe_old.py
    python benchmarks/moe_align_ab.py --old .dev/fused_moe_old.py [--models ...] [--tokens ...]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics

import torch

from breakgraph.bench import moe as bm
from breakgraph.bench.kernels import bench_ms
from breakgraph.kernels import fused_moe as fm


def this_module(atomic: bool, red_v8: bool = True):
    """This module's experts with ``atomic_sum`` forced to ``atomic``."""

    def experts(x, gate_up, down, w, ids, activation):
        cfg = fm.moe_config(x.shape[0], ids.shape[1], gate_up.shape[0])
        saved, fm.RED_V8 = fm.RED_V8, red_v8
        try:
            return bm.with_config(
                cfg._replace(atomic_sum=atomic),
                lambda: fm.fused_experts_triton(x, gate_up, down, w, ids, activation),
            )
        finally:
            fm.RED_V8 = saved

    return experts


def graphed_align(module, m: int, s: dict):
    _, ids = fm.moe_route_triton(torch.randn(m, s["experts"], device="cuda"), s["top_k"])
    block_m = fm.moe_config(m, s["top_k"], s["experts"]).block_m
    graph, _ = bm.capture(lambda: module.moe_align(ids, s["experts"], block_m))
    return graph.replay


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="the former fused_moe.py")
    parser.add_argument("--models", nargs="+", default=["qwen3-30b-a3b", "gemma-4-26b-a4b"])
    parser.add_argument("--tokens", type=int, nargs="+",
                        default=[8, 64, 128, 256, 1024, 2048, 4096, 8192])  # fmt: skip
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("moe_align_ab.py needs a CUDA device; nothing to measure here.")
        return
    spec = importlib.util.spec_from_file_location("fused_moe_old", args.old)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    old.GEMV_MAX_TOKENS = fm.GEMV_MAX_TOKENS = 0  # the grouped path at every M
    arms = {"old": old.fused_experts_triton, "new": this_module(False),
            "new+atomic": this_module(True), "new+atomic1": this_module(True, red_v8=False)}  # fmt: skip
    print(f"{'model':<16} {'M':>5} {'dense':>7} " + " ".join(f"{n:>13}" for n in arms)
          + "   align old/new µs   err vs old (new, atomic, atomic1)")  # fmt: skip
    for model in args.models:
        s = bm.expert_shapes(model)
        for m in args.tokens:
            layer = bm.Layer(m, s)
            replays = {name: bm.graphed(layer, experts) for name, experts in arms.items()}
            times = {name: [] for name in arms}
            for _ in range(args.rounds):
                for name, replay in replays.items():
                    times[name].append(bench_ms(replay))
            w, ids = fm.moe_route_triton(layer.logits[3], s["top_k"])
            inputs = (layer.x, layer.gate_up, layer.down, w, ids, s["activation"])
            base = old.fused_experts_triton(*inputs).float()
            errs = [((arms[n](*inputs).float() - base).norm() / base.norm()).item()
                    for n in list(arms)[1:]]  # fmt: skip
            align = [graphed_align(mod, m, s) for mod in (old, fm)]
            align_us = [statistics.median(bench_ms(a) for _ in range(args.rounds)) * 1e3
                        for a in align]  # fmt: skip
            dense = bench_ms(bm.dense_reference(m, s))
            med = {name: statistics.median(t) for name, t in times.items()}
            print(f"{model:<16} {m:>5} {dense:7.3f} "
                  + " ".join(f"{med[n]:7.3f}({med[n] / dense:4.2f}x)" for n in arms)
                  + f"   {align_us[0]:5.1f}/{align_us[1]:5.1f}   "
                  + " ".join(f"{e:.1e}" for e in errs), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
