"""``bench moe --sweep | --breakdown | --ab``: the grouped path's launch configs (the rows of
``fused_moe``'s config table), each of its kernels' times, and one variant flag or tile
against the table's in one process."""

from __future__ import annotations

import itertools
import statistics

import torch

from breakgraph.bench.kernels import bench_ms
from breakgraph.bench.moe_layer import (
    VARIANT_FLAGS,
    Layer,
    dense_reference,
    expert_shapes,
    graphed,
    with_config,
)
from breakgraph.common import envs
from breakgraph.kernels import fused_moe as fm

GEMM_CANDIDATES = [(64, 64, 4, 3), (64, 128, 4, 4), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (32, 128, 4, 4), (128, 64, 8, 4), (128, 128, 8, 4), (256, 64, 8, 3), (256, 64, 8, 4), (128, 64, 4, 4), (256, 64, 4, 3), (128, 128, 4, 3)]  # fmt: skip
BLOCK_M_CANDIDATES = [(16, 1), (32, 4), (64, 8), (128, 8)]  # (BLOCK_M, GROUP_M)


def sweep(
    layer: Layer, block_ms: list[int] | None = None, table_flags: bool = False
) -> tuple[fm.MoEConfig, float]:
    """Best config at this M: per BLOCK_M and variant (fused activation, or for SiLU also a
    plain GEMM then SiLU-and-mul; sorted intermediate rows or not; TMA loads or not) the
    best gate/up GEMM with the default down GEMM, then the best down GEMM; a candidate that
    fails to compile is skipped. ``table_flags``: every variant flag as the table has it
    (fused activation, sorted rows, TMA, sorted down rows, persistent): only the tiles."""
    default = fm.moe_config(layer.m, layer.s["top_k"], layer.s["experts"])
    best, best_ms = default, with_config(default, lambda: bench_ms(layer))

    def timed(cfg: fm.MoEConfig) -> float:
        try:
            return with_config(cfg, lambda: bench_ms(layer, rep=50))
        except Exception as e:  # noqa: BLE001 - report and go on: a config may not fit
            print(f"    {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
            return float("inf")

    fuse_options = (True, False) if layer.s["activation"] == "silu" else (True,)
    sorted_options, tma_options = (False, True), (False, True)
    if table_flags:
        fuse_options, sorted_options = (default.fuse_act,), (default.sorted_h,)
        tma_options = (default.tma,)
    block_m_options = [c for c in BLOCK_M_CANDIDATES if not block_ms or c[0] in block_ms]
    variants = itertools.product(block_m_options, fuse_options, sorted_options, tma_options)
    for (block_m, group_m), fuse, sorted_h, tma in variants:
        base = default._replace(
            block_m=block_m, group_m=group_m, fuse_act=fuse, sorted_h=sorted_h, tma=tma
        )
        up = min(GEMM_CANDIDATES, key=lambda c, b=base: timed(b._replace(gate_up=c)))
        for down in GEMM_CANDIDATES:
            cfg = base._replace(gate_up=up, down=down)
            ms = timed(cfg)
            print(f"    {cfg}: {ms:.3f} ms", flush=True)
            if ms < best_ms:
                best, best_ms = cfg, ms
    return best, best_ms


def kernel_breakdown(layer: Layer, cfg: fm.MoEConfig, calls: int = 20) -> list[tuple[str, float]]:
    """Mean GPU ms per kernel of one eager layer call under ``cfg`` (torch.profiler), in
    launch order: routing, alignment, gate/up GEMM, down GEMM, top-k sum."""
    from torch.profiler import ProfilerActivity, profile

    with_config(cfg, layer)  # compiled outside the profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            with_config(cfg, layer)
        torch.cuda.synchronize()
    kernels = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    per_call = len(kernels) // calls
    return [
        (kernels[i].name[:24], sum(k.device_time for k in kernels[i::per_call]) / calls / 1e3)
        for i in range(per_call)
    ]


def dense_halves(m: int, s: dict) -> tuple[float, float]:
    """cuBLAS ms of each of ``dense_reference``'s two GEMMs alone."""
    rows, h, i = m * s["top_k"], s["hidden"], s["inter"]
    a = torch.randn(rows, h, device="cuda").bfloat16()
    w1 = torch.randn(h, 2 * i, device="cuda").bfloat16()
    w2 = torch.randn(i, h, device="cuda").bfloat16()
    h1 = torch.randn(rows, i, device="cuda").bfloat16()
    return bench_ms(lambda: torch.mm(a, w1)), bench_ms(lambda: torch.mm(h1, w2))


def breakdown(layer: Layer) -> None:
    """Per-kernel times at the table's config and with each variant flag flipped, beside
    the dense GEMM each MoE GEMM stands against; first the GEMV path's where the step takes
    it (the grouped rows then run with it off)."""
    default = fm.moe_config(layer.m, layer.s["top_k"], layer.s["experts"])
    up, down = dense_halves(layer.m, layer.s)
    print(f"  dense gate/up {up:.3f} ms, dense down {down:.3f} ms")
    if layer.m <= envs.MOE_GEMV.get():
        parts = kernel_breakdown(layer, default)
        cells = "  ".join(f"{k} {ms:.3f}" for k, ms in parts)
        print(f"  {'gemv path':<18} {sum(ms for _, ms in parts):.3f} ms: {cells}", flush=True)
    with envs.MOE_GEMV.override(0):
        grouped_breakdown(layer, default)


def grouped_breakdown(layer: Layer, default: fm.MoEConfig) -> None:
    """The grouped path's rows of :func:`breakdown`."""
    flipped = [
        (f"{f} flipped", default._replace(**{f: not getattr(default, f)})) for f in VARIANT_FLAGS
    ]
    for name, cfg in [("table", default), *flipped]:
        if layer.s["activation"] != "silu" and cfg.fuse_act is False:
            continue
        parts = kernel_breakdown(layer, cfg)
        total = sum(ms for _, ms in parts)
        cells = "  ".join(f"{k} {ms:.3f}" for k, ms in parts)
        graph = with_config(cfg, lambda: bench_ms(graphed(layer)))  # captured under cfg
        print(f"  {name:<18} {total:.3f} ms (graph {graph:.3f}): {cells}", flush=True)


def parse_ab(text: str) -> tuple[str, tuple | None]:
    """``--ab``: ``"half_tail"`` -> ``("half_tail", None)`` (the flag off, then on);
    ``"gate_up=64,64,8,4"`` -> ``("gate_up", (64, 64, 8, 4))`` (the table's tile, then that)."""
    if text in VARIANT_FLAGS:
        return text, None
    name, _, value = text.partition("=")
    parts = value.split(",")
    if name not in ("gate_up", "down") or len(parts) != 4 or not all(p.isdigit() for p in parts):
        raise SystemExit(
            f"error: --ab {text!r}: expected one of {VARIANT_FLAGS} or "
            "gate_up|down=BLOCK_N,BLOCK_K,WARPS,STAGES"
        )
    return name, tuple(int(p) for p in parts)


def ab_configs(table: fm.MoEConfig, name: str, tile: tuple | None) -> dict[str, fm.MoEConfig]:
    """{"A": config, "B": config}: the flag ``name`` off / on, or the table / ``tile`` in it."""
    if tile is not None:
        return {"A": table, "B": table._replace(**{name: tile})}
    return {"A": table._replace(**{name: False}), "B": table._replace(**{name: True})}


def run_ab(args) -> list[dict]:
    """Each M's layer captured twice at the table's config (A, B as :func:`ab_configs`), the
    two graph replays alternating for ``--rounds`` rounds beside the dense reference of the
    same active FLOPs: the median ms of each, its ratio to dense, and B / A. One process, so
    no warm-up drift between two runs of ``--set FLAG=0|1`` falls on the ratio."""
    name, tile = parse_ab(args.ab)
    print(f"A: {'the table' if tile else 'off'}, B: {args.ab if tile else 'on'}, at the "
          "table's config per M (graph ms, median)")  # fmt: skip
    print(f"{'model':<18} {'M':>6} {'table':>16} {'dense':>7} {'A':>13} {'B':>13} {'B/A':>7}")
    rows = []
    for model in args.models:
        s = expert_shapes(model)
        for m in args.tokens:
            layer = Layer(m, s)
            table = fm.moe_config(m, s["top_k"], s["experts"])
            arms = {
                k: with_config(cfg, lambda layer=layer: graphed(layer))
                for k, cfg in ab_configs(table, name, tile).items()
            }
            times: dict[str, list[float]] = {k: [] for k in arms}
            for _ in range(args.rounds):
                for k, replay in arms.items():
                    times[k].append(bench_ms(replay))
            a, b = (statistics.median(times[k]) for k in ("A", "B"))
            d = bench_ms(dense_reference(m, s))
            shown = str(getattr(table, name)).replace(" ", "")
            print(f"{model:<18} {m:>6} {shown:>16} {d:7.3f} {a:7.3f} ({a / d:.2f}x) "
                  f"{b:7.3f} ({b / d:.2f}x) {b / a:7.3f}", flush=True)  # fmt: skip
            rows.append(dict(model=model, m=m, dense_ms=d, a_ms=a, b_ms=b, ab=args.ab))
    return rows
