"""DeepSeek V4's building blocks: the mHC hyper-connections and hyper head, the MoE (scored
and hash-routed, clamped SwiGLU, shared expert) and the decoder layer (deepseek_v4.py's
docstring says what each does); the target's layers and its MTP layers are built of them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from breakgraph.kernels import ops
from breakgraph.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from breakgraph.layers.moe import FusedMoE
from breakgraph.models.config import ModelConfig
from breakgraph.models.deepseek_v4_attention import (
    DeepseekV4Attention,
    DeepseekV4RMSNorm,
    DeepseekV4RotaryEmbedding,
    fp32_param,
)
from breakgraph.models.deepseek_v4_config import V4Layout


class DeepseekV4HyperConnection(nn.Module):
    """mHC weights of one site from the ``hc_mult`` streams: ``pre`` (collapse, consumed
    here), ``post`` (expand the sublayer's output), ``comb`` (mix the streams; Sinkhorn-
    normalised towards doubly stochastic). All float32."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        raw = config.raw
        self.hc_mult = n = raw.get("hc_mult", 4)
        self.iters = raw.get("hc_sinkhorn_iters", 20)
        self.hc_eps = raw.get("hc_eps", 1e-6)
        self.norm_eps = config.rms_norm_eps
        self.fn = fp32_param((2 + n) * n, n * config.hidden_size)
        self.base = fp32_param((2 + n) * n)
        self.scale = fp32_param(3)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """streams [T, n, H] -> (post [T, n], comb [T, n, n], collapsed [T, H]): HF's input
        norm (one scale per row) applied after the projection, in ``ops.hc_collapse``."""
        mixes = ops.hc_mixes(streams.flatten(1), self.fn)
        return ops.hc_collapse(
            streams, mixes, self.base, self.scale, self.iters, self.hc_eps, self.norm_eps
        )


class DeepseekV4HyperHead(nn.Module):
    """The streams' final collapse (before the model's norm)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        n = config.raw.get("hc_mult", 4)
        self.eps = config.raw.get("hc_eps", 1e-6)
        self.norm_eps = config.rms_norm_eps
        self.hc_fn = fp32_param(n, n * config.hidden_size)
        self.hc_base = fp32_param(n)
        self.hc_scale = fp32_param(1)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = ops.hc_mixes(streams.flatten(1), self.hc_fn)
        _, _, collapsed = ops.hc_collapse(
            streams, mixes, self.hc_base, self.hc_scale, 0, self.eps, self.norm_eps, False
        )
        return collapsed


def _clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(gate.clamp(max=L)) * up.clamp(-L, L)`` of [T, I] rows: one kernel on CUDA."""
    return ops.clamped_silu_mul(gate, up, limit)


class DeepseekV4MLP(nn.Module):
    """The shared expert: SwiGLU with gate and up clamped (``swiglu_limit``)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        h, inter = config.hidden_size, config.raw["moe_intermediate_size"]
        self.limit = config.raw.get("swiglu_limit", 10.0)
        self.gate_up_proj = MergedColumnParallelLinear(h, [inter, inter])
        self.down_proj = RowParallelLinear(inter, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(_clamped_swiglu(gate, up, self.limit))


class _Router(nn.Module):
    """A gate of ``sqrtsoftplus`` scores over the experts, its weights renormalised over the
    chosen ones and times ``routed_scaling_factor``."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        raw = config.raw
        self.top_k = raw["num_experts_per_tok"]
        self.scaling = raw.get("routed_scaling_factor", 1.0)
        self.weight = nn.Parameter(torch.empty(raw["n_routed_experts"], config.hidden_size))
        if raw.get("scoring_func", "sqrtsoftplus") != "sqrtsoftplus":
            raise NotImplementedError(f"DeepSeek V4 scoring_func {raw['scoring_func']!r}")


class DeepseekV4TopKRouter(_Router):
    """Experts chosen by score + ``e_score_correction_bias``, weighted by their scores."""

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.register_buffer(
            "e_score_correction_bias", torch.zeros(self.weight.shape[0], dtype=torch.float32)
        )

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor):
        logits = F.linear(x, self.weight)
        bias = self.e_score_correction_bias
        return ops.moe_route(logits, self.top_k, "sqrtsoftplus", True, None, bias, self.scaling)


class DeepseekV4HashRouter(_Router):
    """Experts fixed per token id (``tid2eid``), weighted by their scores."""

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        e = self.weight.shape[0]
        # a checkpoint brings its own table; dummy weights get k distinct experts per token
        ids = torch.arange(config.vocab_size)[:, None] * 7 + torch.arange(self.top_k)[None, :]
        self.register_buffer("tid2eid", (ids % e).to(torch.int32))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor):
        scores = torch.sqrt(F.softplus(F.linear(x, self.weight).float()))
        ids = self.tid2eid[input_ids].long()
        w = scores.gather(1, ids)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling
        return w, ids.to(torch.int32)


class DeepseekV4SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig, layout: V4Layout, layer_id: int):
        super().__init__()
        raw = config.raw
        hashed = layout.mlp_layer_types[layer_id] == "hash_moe"
        self.gate = DeepseekV4HashRouter(config) if hashed else DeepseekV4TopKRouter(config)
        self.experts = FusedMoE(
            raw["n_routed_experts"], config.hidden_size, raw["moe_intermediate_size"], "silu",
            swiglu_limit=raw.get("swiglu_limit", 10.0),
        )  # fmt: skip
        self.shared_experts = DeepseekV4MLP(config)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return self.experts(x, *self.gate(x, input_ids)) + self.shared_experts(x)


class DeepseekV4DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layout: V4Layout, layer_id: int):
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = DeepseekV4Attention(config, layout, layer_id)
        self.mlp = DeepseekV4SparseMoeBlock(config, layout, layer_id)
        self.input_layernorm = DeepseekV4RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = DeepseekV4RMSNorm(config.hidden_size, eps)
        self.attn_hc = DeepseekV4HyperConnection(config)
        self.ffn_hc = DeepseekV4HyperConnection(config)

    def forward(
        self, streams: torch.Tensor, input_ids: torch.Tensor, rotary: DeepseekV4RotaryEmbedding
    ) -> torch.Tensor:
        """streams [T, hc_mult, H] -> the same."""
        post, comb, collapsed = self.attn_hc(streams)
        out = self.self_attn(self.input_layernorm(collapsed), rotary)
        streams = ops.hc_expand(streams, out, post, comb)
        post, comb, collapsed = self.ffn_hc(streams)
        out = self.mlp(self.post_attention_layernorm(collapsed), input_ids)
        return ops.hc_expand(streams, out, post, comb)
