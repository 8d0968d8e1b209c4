"""The FLOP limit of a prefill step: its matrix FLOPs over the chip's dense bf16 GEMM rate
measured in the same run (``bench step``'s ``FLOP limit`` arm, #56's reference).

The step's FLOPs are counted from the model as built (one rank's): every projection's
``2 * rows * N * K`` (rows: the step's new tokens; the LM head's: one row per request, the
last, as prefill computes it), a fused MoE layer's experts at ``top_k`` experts per token and
its router, and each attention layer's two matmuls over the keys each new row sees (causal, a
sliding window capped). Norms, rotary, activations and sampling count nothing: the limit is
what the tensor cores cannot go below, not a prediction.
"""

from __future__ import annotations

from torch import nn

from breakgraph.bench.attention_tflops import attention_flops


def _window_keys(prefix: int, new: int, window: int | None) -> int:
    """Keys the ``new`` rows see in total after ``prefix`` cached ones (row i: prefix + i + 1,
    at most ``window``)."""
    below = new if not window else max(0, min(new, window - prefix))  # rows under the cap
    return below * prefix + below * (below + 1) // 2 + (new - below) * (window or 0)


def _router_weight(module: nn.Module):
    """A MoE router's own weight (HF's routers keep it themselves, not in a linear layer)."""
    weight = getattr(module, "weight", None)
    return (
        weight if isinstance(getattr(module, "top_k", None), int) and weight is not None else None
    )


def step_flops(model: nn.Module, new: int, prefix: int) -> float | None:
    """Matrix FLOPs of one request's prefill step of ``new`` tokens after ``prefix`` cached
    ones, through ``model`` (a fused MoE layer at its router's ``top_k`` experts per token);
    None for a model whose attention is its own (DeepSeek V4's compressed attention): not
    counted here."""
    from breakgraph.layers.attention import Attention
    from breakgraph.layers.linear import (
        ColumnParallelLinear,
        ParallelLMHead,
        QKVParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )
    from breakgraph.layers.moe import FusedMoE

    linear = (ColumnParallelLinear, QKVParallelLinear, RowParallelLinear, ReplicatedLinear)
    top_k = next(
        (m.top_k for m in model.modules() if isinstance(getattr(m, "top_k", None), int)), 0
    )
    flops = 0.0
    attention_layers = 0
    for module in model.modules():
        if isinstance(module, ParallelLMHead):
            flops += 2.0 * module.weight.numel()  # the last row's logits
        elif isinstance(module, linear):
            flops += 2.0 * new * module.weight.numel()
        elif (router := _router_weight(module)) is not None:
            flops += 2.0 * new * router.numel()
        elif isinstance(module, FusedMoE):
            per_expert = (
                module.gate_up_proj.numel() + module.down_proj.numel()
            ) / module.num_experts
            flops += 2.0 * new * top_k * per_expert
        elif isinstance(module, Attention):
            attention_layers += 1
            keys = _window_keys(prefix, new, module.sliding_window)
            # attention_flops(0, n) counts n (n + 1) / 2 keys: pass the total as one "row"
            flops += attention_flops(0, 1, module.num_heads, module.head_dim) * keys
    return flops if attention_layers else None


def flop_limit_ms(flops: float, matrix_tflops: float) -> float:
    """The step's time at the measured matrix rate (TFLOP/s), in ms."""
    return flops / (matrix_tflops * 1e12) * 1e3
