"""The projection shapes of a built-in model, one rank's at a TP size (``bench gemm``, its
``--gemv`` sweep, and the table tests)."""

from __future__ import annotations

import torch

from breakgraph.models.sources import CONFIG_DIR


def projection_shapes(model: str, tp: int = 1) -> list[tuple[str, tuple[int, int]]]:
    """The distinct (name, (N, K)) of a built-in model's projections on one rank of ``tp``
    (fused qkv, o, fused gate/up, down, lm_head, and a family's others: Gemma 4's per-layer
    ones, its router), read from the model built on the meta device: every family, every
    layer type."""
    from breakgraph.distributed import TPGroup
    from breakgraph.layers.linear import (
        ColumnParallelLinear,
        ParallelLMHead,
        QKVParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )
    from breakgraph.models.config import ModelConfig
    from breakgraph.models.loader import build_model
    from breakgraph.models.qwen3_moe import Qwen3MoeTopKRouter

    config = ModelConfig.from_file(CONFIG_DIR / f"{model}.json")
    meta = torch.device("meta")
    built = build_model(config, torch.bfloat16, meta, TPGroup(0, tp, meta) if tp > 1 else None)
    kinds = (ColumnParallelLinear, QKVParallelLinear, RowParallelLinear, ReplicatedLinear)
    out: list[tuple[str, tuple[int, int]]] = []
    for path, module in built.named_modules():
        if not isinstance(module, (*kinds, ParallelLMHead, Qwen3MoeTopKRouter)):
            continue
        parts = path.split(".")
        name = parts[-1].removesuffix("_proj") or parts[-2]
        if parts[-1] == "proj":  # a module's only projection: named by its module
            name = parts[-2]
        if isinstance(module, Qwen3MoeTopKRouter):  # HF's router keeps its weight itself
            name = "router"
        entry = (name, tuple(module.weight.shape))
        if entry not in out:
            out.append(entry)
    return out
