"""One MoEConfig variant flag on and off, or one GEMM's tile against the table's, at the
table's config, in one process (#13).

``bench.moe --set FLAG=0|1`` overrides a flag for a whole run, so an A/B takes two processes
and the device's warm-up drift between them. Here each M's layer is captured twice, with the
table's config at that M and the flag forced off and on (``--tile``: the table's config, and
it with one GEMM's (BLOCK_N, BLOCK_K, warps, stages) replaced), and the two graph replays
alternate for ``--rounds`` rounds beside the dense cuBLAS reference of the same active
FLOPs: the median ms of each, its ratio to dense, and B / A.

    python benchmarks/moe_flag_ab.py --flag half_tail [--models qwen3-30b-a3b gemma-4-26b-a4b]
        [--tokens 2048 4096 8192] [--rounds 5]
    python benchmarks/moe_flag_ab.py --tile gate_up=64,64,8,4 [--models ...] [--tokens ...]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from breakgraph.bench import moe as bm
from breakgraph.bench.kernels import bench_ms
from breakgraph.kernels import fused_moe as fm


def arms_of(table: fm.MoEConfig, flag: str | None, tile: tuple[str, tuple] | None) -> dict:
    """{"A": config, "B": config}: ``flag`` off / on, or the table / ``tile`` in it."""
    if tile is not None:
        name, value = tile
        return {"A": table, "B": table._replace(**{name: value})}
    return {"A": table._replace(**{flag: False}), "B": table._replace(**{flag: True})}


def ab(m: int, cfgs: dict, rounds: int, layer: bm.Layer) -> dict:
    """Median graph-replay ms of the layer under each config of ``cfgs``, and of dense."""
    arms = {k: bm.with_config(cfg, lambda: bm.graphed(layer)) for k, cfg in cfgs.items()}
    times = {k: [] for k in arms}
    for _ in range(rounds):
        for k, replay in arms.items():
            times[k].append(bench_ms(replay))
    dense = bench_ms(bm.dense_reference(m, layer.s))
    return {"dense": dense, **{k: statistics.median(v) for k, v in times.items()}}


def parse_tile(text: str, parser: argparse.ArgumentParser) -> tuple[str, tuple]:
    """``"gate_up=64,64,8,4"`` -> ``("gate_up", (64, 64, 8, 4))``."""
    name, _, value = text.partition("=")
    parts = value.split(",")
    if name not in ("gate_up", "down") or len(parts) != 4 or not all(p.isdigit() for p in parts):
        parser.error(f"--tile {text!r}: expected gate_up|down=BLOCK_N,BLOCK_K,WARPS,STAGES")
    return name, tuple(int(p) for p in parts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--flag", choices=bm.VARIANT_FLAGS)
    which.add_argument("--tile", help="gate_up|down=BLOCK_N,BLOCK_K,WARPS,STAGES")
    parser.add_argument("--models", nargs="+", default=["qwen3-30b-a3b", "gemma-4-26b-a4b"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    tile = parse_tile(args.tile, parser) if args.tile else None
    if not torch.cuda.is_available():
        print("moe_flag_ab.py needs a CUDA device; nothing to measure here.")
        return
    a, b = ("the table's tile", args.tile) if tile else ("off", "on")
    print(f"A: {a}, B: {b}, at the table's config per M (graph ms, median)")
    print(f"{'model':<18} {'M':>6} {'table':>16} {'dense':>7} {'A':>13} {'B':>13} {'B/A':>7}")
    for model in args.models:
        s = bm.expert_shapes(model)
        for m in args.tokens:
            table = fm.moe_config(m, s["top_k"], s["experts"])
            shown = str(getattr(table, tile[0] if tile else args.flag)).replace(" ", "")
            r = ab(m, arms_of(table, args.flag, tile), args.rounds, bm.Layer(m, s))
            d = r["dense"]
            print(f"{model:<18} {m:>6} {shown:>16} {d:7.3f} {r['A']:7.3f} ({r['A'] / d:.2f}x) "
                  f"{r['B']:7.3f} ({r['B'] / d:.2f}x) {r['B'] / r['A']:7.3f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
