"""Qwen3-MoE (Qwen3-30B-A3B, ...), module tree as HF's Qwen3MoeForCausalLM.

Qwen3's attention; the MLP of layer i is a sparse MoE block (router ``mlp.gate``: float32
softmax, top-k, renormalized if ``norm_topk_prob``; experts ``mlp.experts`` stacked
[E, ...]) when ``num_experts > 0``, ``(i + 1) % decoder_sparse_step == 0`` and i is not in
``mlp_only_layers``; otherwise a dense MLP of ``intermediate_size``.

Weights load from HF's per-expert tensors (``mlp.experts.{e}.gate_proj.weight`` ..., what
transformers 5 writes with ``save_pretrained`` and the released checkpoints hold) or from
the stacked ``mlp.experts.gate_up_proj`` / ``down_proj`` (HF 5's in-memory layout).

Tensor parallel: Qwen3's attention and the dense MLPs as Llama's; the experts split by
intermediate size (``FusedMoE``, one all-reduce per MoE block); the router replicated.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from breakgraph.kernels import ops
from breakgraph.layers.moe import ExpertWeights, FusedMoE
from breakgraph.models.config import ModelConfig
from breakgraph.models.llama import LlamaMLP
from breakgraph.models.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM, Qwen3Model


def num_experts(config: ModelConfig) -> int:
    """HF's ``num_experts`` (transformers 5 writes it as ``num_local_experts``)."""
    raw = config.raw
    return int(raw.get("num_experts") or raw.get("num_local_experts") or 0)


def is_sparse_layer(config: ModelConfig, layer_id: int) -> bool:
    raw = config.raw
    step = raw.get("decoder_sparse_step") or 1
    only_mlp = raw.get("mlp_only_layers") or []
    return num_experts(config) > 0 and layer_id not in only_mlp and (layer_id + 1) % step == 0


class Qwen3MoeTopKRouter(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        raw = config.raw
        self.top_k = raw["num_experts_per_tok"]
        self.norm_topk_prob = bool(raw.get("norm_topk_prob", False))
        self.weight = nn.Parameter(torch.empty(num_experts(config), config.hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights float32 [T, K], expert ids [T, K])."""
        logits = ops.linear(x, self.weight)  # the GEMV kernel where the table measured it
        return ops.moe_route(logits, self.top_k, "softmax", self.norm_topk_prob)


class Qwen3MoeSparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.raw.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"Qwen3-MoE with hidden_act {config.raw['hidden_act']!r}")
        self.gate = Qwen3MoeTopKRouter(config)
        self.experts = FusedMoE(
            num_experts(config), config.hidden_size, config.raw["moe_intermediate_size"], "silu"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, *self.gate(x))


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def build_mlp(self, config: ModelConfig, layer_id: int) -> nn.Module:
        if is_sparse_layer(config, layer_id):
            return Qwen3MoeSparseMoeBlock(config)
        return LlamaMLP(config)


class Qwen3MoeModel(Qwen3Model):
    layer_cls = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    model_cls = Qwen3MoeModel

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Per-expert tensors into the stacked experts; everything else as Qwen3."""
        experts = ExpertWeights(self)

        def others() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if not experts.load(name, tensor):
                    yield name, tensor

        return super().load_weights(others()) | experts.loaded()
