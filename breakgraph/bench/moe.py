"""MoE layer benchmark: the fused Triton MoE against references measured in the same run.

    python -m breakgraph.bench.moe [--model qwen3-30b-a3b] [--tokens 1 8 64 256 1024 8192] [--sweep] [--breakdown] [--gemv 8]

Per token count M, one MoE layer of the model's expert shapes (bf16, routing from random
logits: about uniform over the experts): routing + experts (what ``ops`` runs) against

- a dense bf16 cuBLAS GEMM pair of the same active FLOPs (M*K rows through [H, 2I], then
  their first I columns through [I, H]): the goal at M = 8K is <= 1.4x its time;
- the bandwidth floor: the bytes of the experts the step touches (distinct experts x 3*H*I
  x 2) at the measured device copy bandwidth: the goal at decode sizes (M = 1..64).

Each timed call routes new logits (a cycle of 16), so small steps read experts that are not
all in L2. "moe ms" launches the kernels from Python, as an eager step does: at decode sizes
that is paced by the host. "graph ms" replays the layer captured in a CUDA graph, as the
decode and prefill graphs run it (plus one copy of the next routing logits): the GPU's time,
which the floor ratio uses. ``--sweep`` times launch configs per token count (BLOCK_M, then each GEMM's
BLOCK_N/BLOCK_K/warps/stages) and prints the best as rows for ``fused_moe._CONFIGS``.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from breakgraph.bench.kernels import bench_ms, copy_bandwidth_bytes_per_ms
from breakgraph.kernels import fused_moe as fm
from breakgraph.kernels import ops, pdl
from breakgraph.models.config import ModelConfig
from breakgraph.models.qwen3_moe import num_experts
from breakgraph.models.sources import CONFIG_DIR

GEMM_CANDIDATES = [(64, 64, 4, 3), (64, 128, 4, 4), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (32, 128, 4, 4), (128, 64, 8, 4), (128, 128, 8, 4), (256, 64, 8, 3), (256, 64, 8, 4), (128, 64, 4, 4), (256, 64, 4, 3), (128, 128, 4, 3)]  # fmt: skip
BLOCK_M_CANDIDATES = [(16, 1), (32, 4), (64, 8), (128, 8)]  # (BLOCK_M, GROUP_M)
# MoEConfig's on/off variants (its bool fields)
VARIANT_FLAGS = tuple(f for f, v in fm.MoEConfig._field_defaults.items() if isinstance(v, bool))


def expert_shapes(model: str) -> dict:
    config = ModelConfig.from_file(CONFIG_DIR / f"{model}.json")
    raw = config.raw
    gemma = "Gemma4" in config.architecture
    return {
        "experts": num_experts(config),
        "top_k": raw["top_k_experts"] if gemma else raw["num_experts_per_tok"],
        "hidden": config.hidden_size,
        "inter": raw["moe_intermediate_size"],
        "activation": "gelu_tanh" if gemma else "silu",
    }


class Layer:
    """One MoE layer's weights and a cycle of routings for M tokens."""

    def __init__(self, m: int, s: dict, seed: int = 0):
        g = torch.Generator(device="cuda").manual_seed(seed)
        e, h, i = s["experts"], s["hidden"], s["inter"]

        def randn(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g, device="cuda") * scale).bfloat16()

        self.s, self.m = s, m
        self.x = randn(m, h)
        self.gate_up = randn(e, 2 * i, h, scale=h**-0.5)
        self.down = randn(e, h, i, scale=i**-0.5)
        self.logits = [randn(m, e) for _ in range(16)]
        self.turn = itertools.cycle(self.logits)

    def __call__(self) -> torch.Tensor:
        w, ids = ops.moe_route(next(self.turn), self.s["top_k"])
        return ops.fused_experts(self.x, self.gate_up, self.down, w, ids, self.s["activation"])

    def touched_bytes(self) -> float:
        """Mean bytes of the distinct experts one step reads."""
        k, h, i = self.s["top_k"], self.s["hidden"], self.s["inter"]
        hit = [len(torch.topk(lg.float(), k).indices.unique()) for lg in self.logits]
        return sum(hit) / len(hit) * 3 * h * i * 2


def capture(fn):
    """``fn`` run once on a side stream (compiles, allocations, as torch asks), then captured
    in a CUDA graph: (graph, the captured call's output)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def graphed(layer: Layer, experts=None):
    """The layer as a graph step runs it: routing + experts captured once over a static
    logits buffer that each call refills from the cycle, then one replay. Captured as a
    decode graph of M rows is (``pdl.scope``: with programmatic dependent launch up to
    ``pdl.AUTO_MAX_BATCH`` rows, as the engine's decode graphs). ``experts``: another
    function of ``ops.fused_experts``'s arguments in its place (an A/B's arm)."""
    static = layer.logits[0].clone()
    experts = experts or ops.fused_experts

    def body() -> torch.Tensor:
        w, ids = ops.moe_route(static, layer.s["top_k"])
        return experts(layer.x, layer.gate_up, layer.down, w, ids, layer.s["activation"])

    with pdl.scope(layer.m):
        graph, _ = capture(body)
    turn = itertools.cycle(layer.logits)

    def replay() -> None:
        static.copy_(next(turn))
        graph.replay()

    return replay


def dense_reference(m: int, s: dict):
    """cuBLAS bf16 GEMMs of the experts' active FLOPs."""
    rows, h, i = m * s["top_k"], s["hidden"], s["inter"]
    a = torch.randn(rows, h, device="cuda").bfloat16()
    w1 = torch.randn(h, 2 * i, device="cuda").bfloat16() * h**-0.5
    w2 = torch.randn(i, h, device="cuda").bfloat16() * i**-0.5
    h1 = torch.empty(rows, 2 * i, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(rows, h, device="cuda", dtype=torch.bfloat16)

    def fn():
        torch.mm(a, w1, out=h1)
        torch.mm(h1[:, :i], w2, out=y)

    return fn


def with_config(cfg: fm.MoEConfig, fn):
    """Run ``fn`` with every MoE launch using ``cfg``."""
    saved = fm.moe_config
    fm.moe_config = lambda *_: cfg
    try:
        return fn()
    finally:
        fm.moe_config = saved


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
    """cuBLAS ms of each of :func:`dense_reference`'s two GEMMs alone."""
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
    saved = fm.GEMV_MAX_TOKENS
    if layer.m <= saved:
        parts = kernel_breakdown(layer, default)
        cells = "  ".join(f"{k} {ms:.3f}" for k, ms in parts)
        print(f"  {'gemv path':<18} {sum(ms for _, ms in parts):.3f} ms: {cells}", flush=True)
    fm.GEMV_MAX_TOKENS = 0
    try:
        _grouped_breakdown(layer, default)
    finally:
        fm.GEMV_MAX_TOKENS = saved


def _grouped_breakdown(layer: Layer, default: fm.MoEConfig) -> None:
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


def parse_flag_overrides(items: list[str], parser: argparse.ArgumentParser) -> dict[str, bool]:
    """``["sorted_y=1", ...]`` -> ``{"sorted_y": True}``; a bad item is a usage error."""
    out = {}
    for item in items:
        name, _, value = item.partition("=")
        if name not in VARIANT_FLAGS or value not in ("0", "1"):
            parser.error(f"--set {item!r}: expected FLAG=0|1 with FLAG one of {VARIANT_FLAGS}")
        out[name] = value == "1"
    return out


GEMV_CANDIDATES = list(itertools.product((2, 4, 8), (256, 512, 1024, 2048), (2, 4, 8)))


def gemv_sweep(layer: Layer, max_tokens: int) -> fm.MoEGemvConfig:
    """The GEMV path's (BLOCK_N, BLOCK_K, warps), gate/up first (down at the table's), then
    down (gate/up at its best), each timed as a graph replay; the best config."""
    saved_cfg, saved_max = fm.GEMV_CONFIG, fm.GEMV_MAX_TOKENS
    fm.GEMV_MAX_TOKENS = max_tokens
    best = fm.gemv_config(layer.m)
    try:
        for field in ("gate_up", "down"):
            timed = []
            for cand in GEMV_CANDIDATES:
                fm.GEMV_CONFIG = best._replace(**{field: cand})
                timed.append((bench_ms(graphed(layer)), cand))
            ms, cand = min(timed)
            best = best._replace(**{field: cand})
            print(f"  gemv {field}: best {cand} {ms:.4f} ms", flush=True)
    finally:
        fm.GEMV_CONFIG, fm.GEMV_MAX_TOKENS = saved_cfg, saved_max
    return best


def gemv_against_grouped(layer: Layer, max_tokens: int, floor: float) -> tuple[float, float]:
    """The layer's graph replay on the GEMV path and on the grouped one, interleaved in
    three rounds (medians), and the GEMV path's error against the twin; (GEMV ms, grouped ms)."""
    saved = fm.GEMV_MAX_TOKENS
    try:
        fm.GEMV_MAX_TOKENS = 0
        grouped = graphed(layer)
        fm.GEMV_MAX_TOKENS = max_tokens
        gemv = graphed(layer)
        s = layer.s
        w, ids = ops.moe_route(layer.logits[0], s["top_k"])
        got = ops.fused_experts(layer.x, layer.gate_up, layer.down, w, ids, s["activation"])
    finally:
        fm.GEMV_MAX_TOKENS = saved
    twin = fm.fused_experts_torch(layer.x, layer.gate_up, layer.down, w, ids, s["activation"])
    rel = ((got.float() - twin.float()).abs().max() / twin.float().abs().max()).item()
    times = {"grouped": [], "gemv": []}
    for _ in range(3):
        times["grouped"].append(bench_ms(grouped))
        times["gemv"].append(bench_ms(gemv))
    g, v = (sorted(t)[1] for t in times.values())
    print(f"  gemv path: graph {v:.3f} ms against grouped {g:.3f} ({v / g:.2f}x), "
          f"{v / floor:.2f}x the floor  {rel:.1e}", flush=True)  # fmt: skip
    return v, g


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 64, 256, 1024, 8192])
    parser.add_argument("--sweep", action="store_true", help="also search launch configs")
    parser.add_argument(
        "--sweep-block-m", type=int, nargs="+", help="the sweep's BLOCK_M values (default: all)"
    )
    parser.add_argument(
        "--sweep-table-flags",
        action="store_true",
        help="the sweep keeps the table's variant flags and searches the tiles only",
    )
    parser.add_argument(
        "--breakdown", action="store_true", help="also time each kernel of the layer (profiler)"
    )
    parser.add_argument(
        "--gemv",
        type=int,
        default=0,
        metavar="N",
        help="steps of up to N tokens: the GEMV path (fused_moe.GEMV_MAX_TOKENS) against the "
        "grouped one, both replayed from graphs, same run",
    )
    parser.add_argument(
        "--gemv-sweep",
        action="store_true",
        help="with --gemv: first search the GEMV path's block sizes at each such M",
    )
    parser.add_argument(
        "--gemv-json",
        metavar="PATH",
        help="with --gemv: write each such M's config and times (decode_ab's moegemv<N> "
        "variant reads it from $MOE_GEMV_SWEEP)",
    )
    parser.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="FLAG=0|1",
        help="override the table's variant flags for the whole run (e.g. sorted_y=1 tma=0)",
    )
    args = parser.parse_args(argv)
    overrides = parse_flag_overrides(args.set, parser)
    if not torch.cuda.is_available():
        print("breakgraph.bench.moe needs a CUDA device; nothing to measure here.")
        return
    if overrides:
        table = fm.moe_config
        fm.moe_config = lambda *a: table(*a)._replace(**overrides)
        print(f"table flags overridden: {overrides}")
    s = expert_shapes(args.model)
    bw = copy_bandwidth_bytes_per_ms()
    print(f"{torch.cuda.get_device_name()}  {args.model}: {s}  copy {bw / 1e6:.0f} GB/s")
    print(
        "M      moe ms  graph ms   dense ms  graph/dense  floor ms  graph/floor  |moe - twin|/|twin|"
    )
    rows, gemv_rows = [], []
    for m in args.tokens:
        layer = Layer(m, s)
        w, ids = ops.moe_route(layer.logits[0], s["top_k"])
        got = ops.fused_experts(layer.x, layer.gate_up, layer.down, w, ids, s["activation"])
        twin = fm.fused_experts_torch(layer.x, layer.gate_up, layer.down, w, ids, s["activation"])
        rel = ((got.float() - twin.float()).abs().max() / twin.float().abs().max()).item()
        moe = bench_ms(layer)
        graph = bench_ms(graphed(layer))
        dense = bench_ms(dense_reference(m, s))
        floor = layer.touched_bytes() / bw
        print(f"{m:<6} {moe:7.3f} {graph:9.3f} {dense:10.3f} {graph / dense:11.2f}x "
              f"{floor:9.3f} {graph / floor:11.2f}x  {rel:.1e}", flush=True)  # fmt: skip
        if m <= args.gemv:
            if args.gemv_sweep:  # this M's search starts from the table's config
                fm.GEMV_CONFIG = gemv_sweep(layer, args.gemv)
            print(f"  gemv config for M = {m}: {fm.gemv_config(m)}")
            v, g = gemv_against_grouped(layer, args.gemv, floor)
            gemv_rows.append(dict(m=m, gemv_ms=v, grouped_ms=g, floor_ms=floor,
                                  config=fm.gemv_config(m)._asdict()))  # fmt: skip
            fm.GEMV_CONFIG = None
        if args.breakdown:
            breakdown(layer)
        if args.sweep:
            cfg, ms = sweep(layer, args.sweep_block_m, args.sweep_table_flags)
            mean_rows = m * s["top_k"] / s["experts"]
            rows.append((mean_rows, cfg, ms, moe))
            print(f"  best {cfg}: {ms:.3f} ms (default {moe:.3f})", flush=True)
    if args.gemv_json:
        with open(args.gemv_json, "w") as f:
            json.dump(dict(model=args.model, rows=gemv_rows), f, indent=1)
    if rows:
        print("\n# fused_moe._CONFIGS candidates (mean rows per expert, config; ms vs default):")
        for mean_rows, cfg, ms, moe in rows:
            print(f"    ({mean_rows:g}, {cfg!r}),  # {ms:.3f} ms vs {moe:.3f}")


if __name__ == "__main__":
    main()
