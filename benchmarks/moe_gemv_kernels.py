"""The MoE GEMV path's two kernels, each alone, per config (#13).

``bench.moe --gemv-sweep`` picks the path's configs by the whole layer's graph replay
(routing, both launches, the graph's own launch), where a config's effect on one kernel is
a few µs inside ~45. Here each kernel runs alone as one CUDA graph of R launches, launch j on
the j-th set of distinct experts (the sets cycle over all E, hundreds of MB, so each launch
reads DRAM after another launch as in a decode step): µs per launch, the read bandwidth of
the experts it touches, and that against the device-to-device copy's, for the table's config
(``fused_moe.GEMV_TABLE``) and the sweep's best five, at each step size.

The configs compile first in a pool of processes (one compile per config and model: the
shapes' chunk counts and top-k are constexprs).

    python benchmarks/moe_gemv_kernels.py [--models qwen3-30b-a3b gemma-4-26b-a4b] [--tokens 1 2 4]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
from gemv_sweep import compile_all

from breakgraph.bench.gemm import replay_us
from breakgraph.bench.kernels import copy_bandwidth_bytes_per_ms
from breakgraph.bench.moe import expert_shapes
from breakgraph.kernels import fused_moe as fm

KERNELS = ("gate_up", "down")
SWEEP = list(itertools.product((1, 2, 4, 8, 16), (128, 256, 512, 1024, 2048), (1, 2, 4, 8)))
MAX_PER_THREAD = 128  # weight elements a thread holds per chunk (more spills, compiles slowly)


def fits(kernel: str, cfg: tuple[int, int, int], s: dict) -> bool:
    bn, bk, warps = cfg
    k = s["hidden"] if kernel == "gate_up" else s["inter"]
    rows = bn * (2 if kernel == "gate_up" else 1)
    return bk <= max(128, 1 << (k - 1).bit_length()) and rows * bk <= MAX_PER_THREAD * 32 * warps


class Experts:
    """Small expert weights of ``s``'s shapes (a compile), or all E of them (a timing)."""

    def __init__(self, s: dict, experts: int, m: int, seed: int = 0):
        g = torch.Generator(device="cuda").manual_seed(seed)
        h, i, k = s["hidden"], s["inter"], s["top_k"]
        self.s, self.m = s, m
        self.gate_up = torch.randn(experts, 2 * i, h, generator=g, device="cuda").bfloat16()
        self.down = torch.randn(experts, h, i, generator=g, device="cuda").bfloat16()
        self.x = torch.randn(m, h, generator=g, device="cuda").bfloat16()
        self.h = torch.randn(m * k, i, generator=g, device="cuda").bfloat16()
        self.weights = torch.rand(m, k, generator=g, device="cuda")
        # launch j's experts: the j-th run of m * k distinct ids in a cycle over all of them
        per = min(m * k, experts)
        order = torch.randperm(experts, generator=torch.Generator().manual_seed(seed))
        sets = max(1, experts // per)
        self.ids = [
            order[j * per : (j + 1) * per].repeat(-(-m * k // per))[: m * k]
            .view(m, k).to(torch.int32).cuda()
            for j in range(sets)
        ]  # fmt: skip

    def launches(self, kernel: str, cfg: tuple[int, int, int]) -> list:
        act = self.s["activation"]
        if kernel == "gate_up":
            return [
                lambda i=i: fm.gemv_gate_up(self.x, self.gate_up, i, cfg, act) for i in self.ids
            ]
        return [lambda i=i: fm.gemv_down(self.h, self.down, self.weights, i, cfg) for i in self.ids]

    def bytes_per_launch(self, kernel: str) -> float:
        rows = (2 if kernel == "gate_up" else 1) * self.s["inter"] * self.s["hidden"] * 2
        return sum(len(i.unique()) for i in self.ids) / len(self.ids) * rows


def _compile(job: tuple[str, str, tuple[int, int, int]]) -> str | None:
    model, kernel, cfg = job
    try:
        experts = Experts(expert_shapes(model), 8, 1)
        for fn in experts.launches(kernel, cfg)[:1]:
            fn()
        torch.cuda.synchronize()
        return None
    except Exception as e:  # a config that does not compile (too many registers, say)
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["qwen3-30b-a3b", "gemma-4-26b-a4b"])
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--procs", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    p.add_argument("--json")
    args = p.parse_args()
    copy_bpus = copy_bandwidth_bytes_per_ms() / 1e3
    shapes = {model: expert_shapes(model) for model in args.models}
    jobs = [(model, kernel, cfg) for model, s in shapes.items() for kernel in KERNELS
            for cfg in SWEEP if fits(kernel, cfg, s)]  # fmt: skip
    failed = compile_all(jobs, args.procs, _compile)
    print(f"{len(jobs)} configs compiled, {len(failed)} failed", flush=True)
    results = []
    for model, s in shapes.items():
        for m in args.tokens:
            experts = Experts(s, s["experts"], m)
            table = fm.gemv_config(m)
            for kernel in KERNELS:
                nbytes = experts.bytes_per_launch(kernel)
                timed = sorted(
                    (replay_us(experts.launches(kernel, cfg)), cfg)
                    for cfg in SWEEP
                    if fits(kernel, cfg, s) and (model, kernel, cfg) not in failed
                )
                mine = getattr(table, kernel)
                table_us = replay_us(experts.launches(kernel, mine))

                def cell(us: float, cfg: tuple[int, int, int], nbytes=nbytes) -> str:
                    return (f"{us:6.2f} us {cfg} ({nbytes / us / 1e6:4.2f} TB/s, "
                            f"{nbytes / us / copy_bpus:4.2f}x copy)")  # fmt: skip

                print(f"{model} M={m} {kernel:<7} {nbytes / 1e6:6.1f} MB  table "
                      f"{cell(table_us, mine)}  best {cell(*timed[0])}", flush=True)  # fmt: skip
                print("    next: " + ", ".join(f"{us:.2f} {c}" for us, c in timed[1:5]), flush=True)
                results.append(dict(model=model, m=m, kernel=kernel, mb=nbytes / 1e6,
                                    table=[table_us, mine], top=timed[:5]))  # fmt: skip
            del experts
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
