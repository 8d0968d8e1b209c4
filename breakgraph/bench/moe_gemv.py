"""``bench moe --gemv N | --gemv-kernels``: the MoE GEMV path of a few tokens (two launches, no
alignment; ``fused_moe``'s GEMV table) against the grouped path, and its two kernels alone.

``--gemv N`` times, at each M <= N, the whole layer's graph replay on the GEMV path against
the grouped one (``--gemv-sweep``: the path's block sizes searched first at each such M, by
that replay, where a config's effect on one kernel is a few µs inside ~45).
``--gemv-kernels`` runs each kernel alone as one CUDA graph of R launches, launch j on the
j-th set of distinct experts (the sets cycle over all E, hundreds of MB, so each launch reads
DRAM after another launch as in a decode step): µs per launch, the read bandwidth of the
experts it touches, and that against the device-to-device copy's, for the table's config and
the sweep's best five at each M. Its ``--json`` is what ``bench decode --variants
moetable=PATH`` reads. The configs compile first in a pool of processes.
"""

from __future__ import annotations

import contextlib
import itertools
import json

import torch

from breakgraph.bench.gemv import compile_all
from breakgraph.bench.kernels import bench_ms, copy_bandwidth_bytes_per_ms
from breakgraph.bench.moe_layer import Layer, expert_shapes, graphed
from breakgraph.bench.timing import replay_us
from breakgraph.common import envs
from breakgraph.kernels import fused_moe as fm

GEMV_CANDIDATES = list(itertools.product((2, 4, 8), (256, 512, 1024, 2048), (2, 4, 8)))
KERNELS = ("gate_up", "down")
SWEEP = list(itertools.product((1, 2, 4, 8, 16), (128, 256, 512, 1024, 2048), (1, 2, 4, 8)))
MAX_PER_THREAD = 128  # weight elements a thread holds per chunk (more spills, compiles slowly)


@contextlib.contextmanager
def fixed_gemv_config(cfg: fm.MoEGemvConfig | None):
    """Every GEMV-path launch inside the block on ``cfg`` (None: the table's)."""
    saved = fm.GEMV_CONFIG
    fm.GEMV_CONFIG = cfg
    try:
        yield
    finally:
        fm.GEMV_CONFIG = saved


def gemv_sweep(layer: Layer, max_tokens: int) -> fm.MoEGemvConfig:
    """The GEMV path's (BLOCK_N, BLOCK_K, warps), gate/up first (down at the table's), then
    down (gate/up at its best), each timed as a graph replay; the best config."""
    best = fm.gemv_config(layer.m)
    with envs.MOE_GEMV.override(max_tokens):
        for field in KERNELS:
            timed = []
            for cand in GEMV_CANDIDATES:
                with fixed_gemv_config(best._replace(**{field: cand})):
                    timed.append((bench_ms(graphed(layer)), cand))
            ms, cand = min(timed)
            best = best._replace(**{field: cand})
            print(f"  gemv {field}: best {cand} {ms:.4f} ms", flush=True)
    return best


def gemv_against_grouped(layer: Layer, max_tokens: int, floor: float) -> tuple[float, float]:
    """The layer's graph replay on the GEMV path and on the grouped one, interleaved in
    three rounds (medians), and the GEMV path's error against the twin; (GEMV ms, grouped ms)."""
    with envs.MOE_GEMV.override(0):
        grouped = graphed(layer)
    with envs.MOE_GEMV.override(max_tokens):
        gemv = graphed(layer)
        rel = layer.error()
    times: dict[str, list[float]] = {"grouped": [], "gemv": []}
    for _ in range(3):
        times["grouped"].append(bench_ms(grouped))
        times["gemv"].append(bench_ms(gemv))
    g, v = (sorted(t)[1] for t in times.values())
    print(f"  gemv path: graph {v:.3f} ms against grouped {g:.3f} ({v / g:.2f}x), "
          f"{v / floor:.2f}x the floor  {rel:.1e}", flush=True)  # fmt: skip
    return v, g


def gemv_row(layer: Layer, max_tokens: int, floor: float, search: bool) -> dict:
    """``--gemv``'s columns of one M's row (``search``: ``--gemv-sweep`` first, this M's
    search starting from the table's config)."""
    with fixed_gemv_config(gemv_sweep(layer, max_tokens) if search else None):
        cfg = fm.gemv_config(layer.m)
        print(f"  gemv config for M = {layer.m}: {cfg}")
        v, g = gemv_against_grouped(layer, max_tokens, floor)
    return dict(gemv_ms=v, grouped_ms=g, gemv_config=cfg._asdict())


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


def compile_kernel(job: tuple[str, str, tuple[int, int, int]]) -> str | None:
    model, kernel, cfg = job
    try:
        experts = Experts(expert_shapes(model), 8, 1)
        for fn in experts.launches(kernel, cfg)[:1]:
            fn()
        torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001 - a config that does not compile (registers, say)
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"


def run_gemv_kernels(args) -> list[dict]:
    copy_bpus = copy_bandwidth_bytes_per_ms() / 1e3
    shapes = {model: expert_shapes(model) for model in args.models}
    jobs = [(model, kernel, cfg) for model, s in shapes.items() for kernel in KERNELS
            for cfg in SWEEP if fits(kernel, cfg, s)]  # fmt: skip
    failed = compile_all(jobs, args.procs, compile_kernel)
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
    return results
