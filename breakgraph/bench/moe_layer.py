"""One MoE layer of a model's expert shapes on the GPU, as ``bench moe`` and its searches time
it: weights, a cycle of routings, the layer eager and captured as a graph step runs it, and
the dense cuBLAS reference of the same active FLOPs."""

from __future__ import annotations

import itertools

import torch

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
