"""``breakgraph bench gemm``: decode's projections at M = 1..64 rows, cuBLAS against the
skinny-GEMM kernel, same run (``--gemv``: the batch-1 GEMV kernel's configs instead, gemv.py).

For each weight shape of the models' projections (fused qkv, o, fused gate/up, down,
lm_head, and a family's others; every family, read from the model built on the meta
device), each M: cuBLAS (``F.linear``) and the best of a sweep of skinny-GEMM configs, both
timed as CUDA-graph replays (as the decode graphs run them; medians), against the floor: the
bytes read and written over the measured device-to-device copy bandwidth. For qkv and gate/up
also the fusions the kernel offers, each against its two launches: the residual add + RMSNorm
as the prologue, gate/up's SiLU as the epilogue. Prints the table and the ``SKINNY_TABLE``
literal to paste into kernels/skinny_gemm.py (configs that beat cuBLAS by at least
``--min-gain``); ``--table-out PATH`` also writes it as JSON, which ``BREAKGRAPH_SKINNY=PATH``
serves as is (another GPU's table without editing the code). The table's GEMV entries (batch
1) are carried over as they are: ``--gemv`` measures those.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from breakgraph.bench.shapes import projection_shapes
from breakgraph.kernels import ops
from breakgraph.kernels import skinny_gemm as sg

CONFIGS = [
    sg.SkinnyConfig(block_n, block_k, split_k)
    for block_n in (16, 32, 64)
    for block_k in (128, 256)
    for split_k in (1, 2, 4, 8)
]


def configs_for(k: int) -> list[sg.SkinnyConfig]:
    """The sweep, less the splits left with fewer than one chunk each."""
    return [c for c in CONFIGS if k // c.split_k >= c.block_k]


def graph_us(fn) -> float:
    """Median µs of one call, timed as CUDA-graph replays (fn already compiled)."""
    import triton.testing

    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median")


def copy_bytes_per_us(nbytes: int = 1 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / graph_us(lambda: dst.copy_(src))


def best_skinny(x, w, configs) -> tuple[float, sg.SkinnyConfig | None]:
    best = (float("inf"), None)
    ws = sg.SkinnyWorkspace()
    for cfg in configs:
        fn = lambda c=cfg: sg.skinny_gemm_triton(x, w, None, c, ws)  # noqa: E731
        try:
            fn()
            us = graph_us(fn)
        except Exception as e:  # a config that does not compile for this shape
            print(f"  {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
            continue
        best = min(best, (us, cfg), key=lambda t: t[0])
    return best


def fused_act(x, gate_up, cfg) -> dict:
    """gate/up then SiLU: cuBLAS and the activation kernel (two launches) against the skinny
    GEMM with the activation in its epilogue (one), the same config; printed, and returned."""
    two = lambda: ops.silu_and_mul(F.linear(x, gate_up))  # noqa: E731
    ws = sg.SkinnyWorkspace()
    one = lambda: sg.skinny_gemm_triton(x, gate_up, None, cfg, ws, activation="silu")  # noqa: E731
    two(), one()
    two_us, one_us = graph_us(two), graph_us(one)
    print(f"{'  + SiLU: cuBLAS + kernel / fused':<34} {x.shape[0]:>3} {two_us:>10.2f} "
          f"{one_us:>10.2f} {one_us / two_us:>5.2f}x")  # fmt: skip
    return {"cublas_silu_us": two_us, "skinny_silu_us": one_us}


def fused_norm(x, w, cfg) -> dict:
    """The residual add + RMSNorm in front: the norm kernel and cuBLAS, the norm kernel and
    the skinny GEMM (two launches each) against the skinny GEMM with the norm as its prologue
    (one; it re-reads the rows' K per program): ``fuse_norm`` if that is the fastest way for
    the skinny GEMM."""
    res = torch.randn_like(x)
    norm_w = torch.ones(x.shape[1], device=x.device, dtype=x.dtype)
    ws = sg.SkinnyWorkspace()
    norm = lambda: ops.fused_add_rms_norm(x, res, norm_w, 1e-6)[0]  # noqa: E731
    cublas = lambda: F.linear(norm(), w)  # noqa: E731
    apart = lambda: sg.skinny_gemm_triton(norm(), w, None, cfg, ws)  # noqa: E731
    fused = lambda: sg.skinny_norm_gemm_triton(x, res, norm_w, 1e-6, w, cfg, ws)  # noqa: E731
    times = {}
    for key, fn in (
        ("norm_cublas_us", cublas),
        ("norm_skinny_us", apart),
        ("skinny_norm_us", fused),
    ):
        try:
            fn()
            times[key] = graph_us(fn)
        except Exception as e:  # the prologue's extra tiles may not fit this config
            print(f"  {key}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
            times[key] = float("inf")
    print(f"{'  + norm: kernel + cuBLAS / fused':<34} {x.shape[0]:>3} {times['norm_cublas_us']:>10.2f} "
          f"{times['skinny_norm_us']:>10.2f} {times['skinny_norm_us'] / times['norm_cublas_us']:>5.2f}x"
          f"  (kernel + skinny {times['norm_skinny_us']:.2f})")  # fmt: skip
    return {**times, "fuse_norm": times["skinny_norm_us"] <= times["norm_skinny_us"]}


def table_entries(
    per_m: list[tuple[int, sg.SkinnyConfig | None]],
) -> list[tuple[int, sg.SkinnyConfig | None]]:
    """Measured (m, choice) ascending -> ``SKINNY_TABLE`` entries: runs of one choice merged
    into (max_m, choice); rows between two measured m take the larger one's choice."""
    merged: list[tuple[int, sg.SkinnyConfig | None]] = []
    for m, cfg in per_m:
        if merged and merged[-1][1] == cfg:
            merged[-1] = (m, cfg)
        else:
            merged.append((m, cfg))
    return merged


def with_gemv_entries(
    shape: tuple[int, int], merged: list[tuple[int, sg.SkinnyConfig | None]]
) -> list[tuple[int, sg.SkinnyConfig | None]]:
    """``merged`` behind the current table's GEMV entries for ``shape`` (batch 1 on the GEMV
    kernel: chosen by ``bench gemm --gemv``, whose launches read their weights from DRAM as
    in the decode graph, not by this sweep's, which read them from L2); the rows those cover
    dropped."""
    gemv = [(m, c) for m, c in sg.SKINNY_TABLE.get(shape, ()) if c is not None and c.gemv]
    if not gemv:
        return merged
    covered = gemv[-1][0]
    return gemv + [(m, c) for m, c in merged if m > covered]


def run_gemm_bench(args) -> list[dict]:
    if not torch.cuda.is_available():
        raise SystemExit("error: bench gemm needs a CUDA device")
    if args.gemv:
        from breakgraph.bench.gemv import run_gemv_sweep

        return run_gemv_sweep(args)
    assert max(args.m) <= sg.MAX_M
    torch.manual_seed(0)
    bw = copy_bytes_per_us()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  copy {bw / 1e6:.2f} TB/s")
    shapes: dict[tuple[int, int], list[str]] = {}
    for model in args.models:
        for tp in args.tp:
            tag = model if tp == 1 else f"{model}/tp{tp}"
            for name, nk in projection_shapes(model, tp):
                shapes.setdefault(nk, []).append(f"{tag}:{name}")
    rows, table = [], {}
    header = f"{'shape (N x K)':<34} {'M':>3} {'cuBLAS us':>10} {'skinny us':>10} {'ratio':>6} {'floor us':>9} {'cuBLAS/floor':>12}  config"
    print(header)
    for (n, k), names in shapes.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        entries = []
        for m in sorted(args.m):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            F.linear(x, w)
            cublas = graph_us(lambda x=x, w=w: F.linear(x, w))
            skinny, cfg = best_skinny(x, w, configs_for(k))
            floor = 2 * (n * k + m * k + m * n) / bw
            label = f"{n} x {k} ({', '.join(names)})"
            print(
                f"{label[:34]:<34} {m:>3} {cublas:>10.2f} {skinny:>10.2f} "
                f"{skinny / cublas:>5.2f}x {floor:>9.2f} {cublas / floor:>11.2f}x  {cfg}",
                flush=True,
            )
            rows.append(dict(n=n, k=k, names=names, m=m, cublas_us=cublas, skinny_us=skinny,
                             config=None if cfg is None else cfg._asdict(), floor_us=floor))  # fmt: skip
            wins = cfg is not None and skinny <= (1 - args.min_gain) * cublas
            if cfg is not None and any(name.endswith(":gate_up") for name in names):
                rows[-1].update(fused_act(x, w, cfg))
            if cfg is not None and any(name.endswith((":qkv", ":gate_up")) for name in names):
                rows[-1].update(fused_norm(x, w, cfg))
                cfg = cfg._replace(fuse_norm=rows[-1]["fuse_norm"])
            entries.append((m, cfg if wins else None))
        merged = with_gemv_entries((n, k), table_entries(entries))
        if any(cfg is not None for _, cfg in merged):
            table[(n, k)] = merged
    print("\nSKINNY_TABLE = {")
    for (n, k), merged in table.items():
        print(f"    ({n}, {k}): {merged!r},  # {', '.join(shapes[(n, k)])}")
    print("}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.table_out:
        Path(args.table_out).write_text(json.dumps(sg.table_to_json(table), indent=1))
    return rows
