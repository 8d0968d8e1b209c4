"""``bench gemm --gemv``: the batch-1 GEMV kernel's configs per projection shape, against cuBLAS
(the one-row entries of kernels/skinny_gemm.py's table).

A decode step at batch 1 is its projections' weight reads. Each shape of the given models
runs every config of a sweep (BLOCK_N weight rows per program, BLOCK_K, warps, pipeline
stages) as one CUDA graph of R launches, each on its own copy of the weight (R copies of at
least 4x the L2 in all, so every launch reads DRAM and follows another launch, as in the
decode graph). Prints, per shape, µs per launch and the read bandwidth of the table's config,
the best config and cuBLAS (``F.linear``; for gate/up plus the SiLU kernel; Gemma's GELU
epilogue runs the same config), and each bandwidth against the device-to-device copy's.
``--table-out PATH`` writes the table with each shape's one-row entry set to its best
config: ``bench decode --variants base skinny=PATH`` then times it inside the decode graph.

The configs compile first in a pool of processes (one compile per config and activation,
whatever the shape: N and K are runtime arguments).
"""

from __future__ import annotations

import itertools
import json
import multiprocessing as mp
import os

import torch
import torch.nn.functional as F

from breakgraph.bench.kernels import copy_bandwidth_bytes_per_ms
from breakgraph.bench.shapes import projection_shapes
from breakgraph.bench.timing import replay_us
from breakgraph.kernels import ops
from breakgraph.kernels import skinny_gemm as sg

SWEEP = [
    sg.SkinnyConfig(bn, bk, 1, warps, stages, fuse_norm=False, gemv=True)
    for bn, bk, warps, stages in itertools.product((1, 2, 4, 8), (512, 1024, 2048, 4096),
                                                   (1, 2, 4, 8), (1, 2, 3))
]  # fmt: skip
L2_BYTES = 50 << 20
MAX_PER_THREAD = 256  # weight elements a thread holds per chunk (more spills, compiles slowly)


def fits(cfg: sg.SkinnyConfig, act: str | None) -> bool:
    rows = cfg.block_n * (2 if act else 1)
    return rows * cfg.block_k <= MAX_PER_THREAD * 32 * cfg.num_warps


def compile_one(job: tuple[sg.SkinnyConfig, str | None]) -> str | None:
    """Compile one config (a launch on small tensors); the error's first line if it fails."""
    cfg, act = job
    try:
        x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
        sg.skinny_gemm_triton(x, w, None, cfg, activation=act)
        torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001 - a config that does not compile (registers, say)
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"


def compile_all(jobs: list, procs: int | None, compile_fn=compile_one) -> set:
    """Compile the jobs in ``procs`` processes (Triton's cache on disk is shared), each by
    ``compile_fn`` (None, or the error's first line); the jobs that failed."""
    procs = procs or max(1, (os.cpu_count() or 2) - 2)
    with mp.get_context("spawn").Pool(procs) as pool:
        errors = pool.map(compile_fn, jobs, chunksize=1)
    return {job for job, err in zip(jobs, errors, strict=True) if err is not None}


def sweep_shape(name: str, n: int, k: int, failed: set, copy_bpus: float) -> dict:
    """``copy_bpus``: the device-to-device copy's bytes (read and written) per µs."""
    act = "silu" if name.startswith("gate_up") else None
    nbytes = n * k * 2
    copies = max(4, -(-4 * L2_BYTES // nbytes))
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)

    def gemv(cfg):
        return [lambda w=w: sg.skinny_gemm_triton(x, w, None, cfg, activation=act) for w in ws]

    if act:
        cublas = [lambda w=w: ops.silu_and_mul(F.linear(x, w)) for w in ws]
    else:
        cublas = [lambda w=w: F.linear(x, w) for w in ws]
    table = sg.table_config(1, n, k)
    res = {"name": name, "n": n, "k": k, "mb": nbytes / 1e6, "copies": copies}
    res["cublas_us"] = replay_us(cublas)
    if table is not None:  # the GEMV kernel's, or the tensor-core kernel's (a TP shape)
        res["table"], res["table_us"] = table._asdict(), replay_us(gemv(table))
    timed = [
        (replay_us(gemv(cfg)), cfg) for cfg in SWEEP if (cfg, act) not in failed and fits(cfg, act)
    ]
    timed.sort(key=lambda t: t[0])
    res["best_us"], best = timed[0]
    res["best"] = best._asdict()
    res["top5"] = [(us, c._asdict()) for us, c in timed[:5]]
    line = f"{name:<8} {n:>6}x{k:<6} {nbytes / 1e6:7.1f} MB"
    for key in ("cublas", "table", "best"):  # µs per launch (read TB/s; the copy's x)
        us = res.get(f"{key}_us")
        if us is not None:
            line += f"  {key} {us:7.2f} us ({nbytes / us / 1e6:4.2f} TB/s, {nbytes / us / copy_bpus:4.2f}x)"
    print(line, flush=True)
    c = best
    print(f"    best: BLOCK_N {c.block_n} BLOCK_K {c.block_k} warps {c.num_warps} "
          f"stages {c.num_stages}; next: "
          + ", ".join(f"{u:.2f} ({d['block_n']},{d['block_k']},w{d['num_warps']},s{d['num_stages']})"
                      for u, d in res["top5"][1:]), flush=True)  # fmt: skip
    ws.clear()
    torch.cuda.empty_cache()
    return res


def swept_table(results: list[dict]) -> dict:
    """The current table with each swept shape's one-row entry set to the sweep's best."""
    table = dict(sg.SKINNY_TABLE)
    for r in results:
        shape = (r["n"], r["k"])
        best = sg.SkinnyConfig(**r["best"])
        table[shape] = [(1, best)] + [(m, c) for m, c in table.get(shape, ()) if m > 1]
    return table


def run_gemv_sweep(args) -> list[dict]:
    shapes = []
    for model in args.models:
        for tp in args.tp:
            for name, shape in projection_shapes(model, tp):
                if args.only and name not in args.only:
                    continue
                if shape not in [s for _, s in shapes]:
                    shapes.append((name if tp == 1 else f"{name}/tp{tp}", shape))
    acts = {"silu" if name.startswith("gate_up") else None for name, _ in shapes}
    jobs = [(cfg, act) for cfg in SWEEP for act in sorted(acts, key=str) if fits(cfg, act)]
    failed = compile_all(jobs, args.procs)
    print(f"{len(jobs)} configs compiled, {len(failed)} failed", flush=True)
    copy_bpus = copy_bandwidth_bytes_per_ms() / 1e3  # what bench decode's floor is over
    print(f"device copy bandwidth {copy_bpus / 1e6:.2f} TB/s", flush=True)
    results = [sweep_shape(name, n, k, failed, copy_bpus) for name, (n, k) in shapes]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.table_out:
        with open(args.table_out, "w") as f:
            json.dump(sg.table_to_json(swept_table(results)), f, indent=1)
    return results
