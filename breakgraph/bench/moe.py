"""``breakgraph bench moe``: the fused Triton MoE layer against references measured in the same
run, and the tables of kernels/fused_moe.py it regenerates.

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
which the floor ratio uses. The grouped path's config search, kernel breakdown and A/B are in
moe_tune.py; the GEMV path of a few tokens in moe_gemv.py.
"""

from __future__ import annotations

import itertools
import json

import torch

from breakgraph.bench.kernels import bench_ms, copy_bandwidth_bytes_per_ms
from breakgraph.kernels import fused_moe as fm
from breakgraph.kernels import ops, pdl

# MoEConfig's on/off variants (its bool fields)
VARIANT_FLAGS = tuple(f for f, v in fm.MoEConfig._field_defaults.items() if isinstance(v, bool))


def expert_shapes(model: str) -> dict:
    from breakgraph.models.config import ModelConfig
    from breakgraph.models.qwen3_moe import num_experts
    from breakgraph.models.sources import CONFIG_DIR

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

    def error(self) -> float:
        """The layer's largest error on one routing against its torch twin, relative to the
        twin's largest output."""
        s = self.s
        w, ids = ops.moe_route(self.logits[0], s["top_k"])
        got = ops.fused_experts(self.x, self.gate_up, self.down, w, ids, s["activation"])
        twin = fm.fused_experts_torch(self.x, self.gate_up, self.down, w, ids, s["activation"])
        return ((got.float() - twin.float()).abs().max() / twin.float().abs().max()).item()


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


def graphed(layer: Layer):
    """The layer as a graph step runs it: routing + experts captured once over a static
    logits buffer that each call refills from the cycle, then one replay. Captured as a
    decode graph of M rows is (``pdl.scope``: with programmatic dependent launch up to
    ``pdl.AUTO_MAX_BATCH`` rows, as the engine's decode graphs)."""
    static = layer.logits[0].clone()

    def body() -> torch.Tensor:
        w, ids = ops.moe_route(static, layer.s["top_k"])
        return ops.fused_experts(layer.x, layer.gate_up, layer.down, w, ids, layer.s["activation"])

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


def parse_flag_overrides(items: list[str]) -> dict[str, bool]:
    """``["sorted_y=1", ...]`` -> ``{"sorted_y": True}``; a bad item is a usage error."""
    out = {}
    for item in items:
        name, _, value = item.partition("=")
        if name not in VARIANT_FLAGS or value not in ("0", "1"):
            raise SystemExit(
                f"error: --set {item!r}: expected FLAG=0|1, FLAG one of {VARIANT_FLAGS}"
            )
        out[name] = value == "1"
    return out


def run_moe_bench(args) -> list[dict]:
    from breakgraph.bench import moe_gemv, moe_tune

    overrides = parse_flag_overrides(args.set)
    if not torch.cuda.is_available():
        raise SystemExit("error: bench moe needs a CUDA device")
    if args.gemv_kernels:
        return moe_gemv.run_gemv_kernels(args)
    if args.ab:
        return moe_tune.run_ab(args)
    if overrides:
        table = fm.moe_config
        fm.moe_config = lambda *a: table(*a)._replace(**overrides)
        print(f"table flags overridden: {overrides}")
    bw = copy_bandwidth_bytes_per_ms()
    rows, tuned = [], []
    for model in args.models:
        s = expert_shapes(model)
        print(f"{torch.cuda.get_device_name()}  {model}: {s}  copy {bw / 1e6:.0f} GB/s")
        print("M      moe ms  graph ms   dense ms  graph/dense  floor ms  graph/floor  "
              "|moe - twin|/|twin|")  # fmt: skip
        for m in args.tokens:
            layer = Layer(m, s)
            moe, graph = bench_ms(layer), bench_ms(graphed(layer))
            dense = bench_ms(dense_reference(m, s))
            floor, rel = layer.touched_bytes() / bw, layer.error()
            print(f"{m:<6} {moe:7.3f} {graph:9.3f} {dense:10.3f} {graph / dense:11.2f}x "
                  f"{floor:9.3f} {graph / floor:11.2f}x  {rel:.1e}", flush=True)  # fmt: skip
            row = dict(model=model, m=m, moe_ms=moe, graph_ms=graph, dense_ms=dense,
                       floor_ms=floor, rel_error=rel)  # fmt: skip
            if m <= args.gemv:
                row.update(moe_gemv.gemv_row(layer, args.gemv, floor, args.gemv_sweep))
            if args.breakdown:
                moe_tune.breakdown(layer)
            if args.sweep:
                cfg, ms = moe_tune.sweep(layer, args.sweep_block_m, args.sweep_table_flags)
                tuned.append((m * s["top_k"] / s["experts"], cfg, ms, moe))
                print(f"  best {cfg}: {ms:.3f} ms (default {moe:.3f})", flush=True)
            rows.append(row)
    if tuned:
        print("\n# fused_moe._CONFIGS candidates (mean rows per expert, config; ms vs default):")
        for mean_rows, cfg, ms, moe in tuned:
            print(f"    ({mean_rows:g}, {cfg!r}),  # {ms:.3f} ms vs {moe:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows
