"""Qwen3: Llama with per-head RMSNorm on q and k before rotary (``q_norm``, ``k_norm``)."""

from __future__ import annotations

from breakgraph.kernels import ops
from breakgraph.layers.norm import RMSNorm
from breakgraph.models.config import ModelConfig
from breakgraph.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
)


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__(config, layer_id)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def position_embed(self, q, k, cos, sin, store):
        eps = self.q_norm.variance_epsilon
        qw, kw = self.q_norm.weight, self.k_norm.weight
        return ops.qk_norm_rope(q, k, qw, kw, eps, cos, sin, store)[0]


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3Model(LlamaModel):
    layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen3Model
