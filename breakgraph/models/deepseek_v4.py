"""DeepSeek V4 (V4-Flash, V4-Pro), module tree as HF's DeepseekV4ForCausalLM.

What sets V4 apart (the config's fields: ``deepseek_v4_config.py``):

- attention of one shared K = V head (MQA, head_dim 512) over a sliding window of the last
  ``sliding_window`` tokens, plus per layer type (``layer_types``) compressed entries:
  CSA layers pool every 4 tokens into one entry (two overlapping series) and attend to the
  top ``index_topk`` entries a lightning indexer scores; HCA layers pool every 128 tokens
  and attend to all of them. q is low-rank (``q_a_proj``, a weighted norm, ``q_b_proj``,
  an unweighted per-head norm); interleaved RoPE on the trailing ``rope_dim`` channels
  (plain theta on sliding layers, the YaRN'd ``compress`` rope on compressed layers and
  their compressors), undone on the output at the query's position; a sink logit per head;
  a grouped low-rank output projection (``o_a_proj`` per head group, then ``o_b_proj``);
- manifold-constrained hyper-connections (mHC): the residual is ``hc_mult`` streams; each
  sublayer reads their ``pre``-weighted sum and writes back ``post`` times its output plus
  the streams mixed by a Sinkhorn-normalised ``comb``; a hyper head collapses them at the end;
- MoE: ``n_routed_experts`` experts (clamped SwiGLU, ``swiglu_limit``) top-k routed by
  ``sqrtsoftplus`` scores with a correction bias (``moe``) or by a frozen token -> experts
  table (``hash_moe``, ``tid2eid[input_ids]``), plus a shared expert.

The attention and its compressors are in ``deepseek_v4_attention.py`` (with what of them a
prefill graph captures and what runs in its eager breaks), the per-step derivations in
``deepseek_v4_step.py`` (a V4 forward calls ``begin_rows`` with its positions before its
layers), checkpoint loading in ``deepseek_v4_weights.py``.

**The caches** (``kv_cache_shapes``, ``kv_slot_shapes``, ``request_state_shapes``): every
layer stores its K = V row per token slot (the sliding window reads the last
``sliding_window`` of them); a compressed layer stores each entry in the slot of its
window's last token (its own per-slot buffer; CSA also its indexer's key); the compressors'
open windows are per-request state (``kernels/compressed_attention.py``). A request's
compressors start empty when its first row of the step is position 0 or is recomputed (KV
slot 0: the rows before a resumed cached prefix that rebuild CSA's state,
``prefix_recompute``); a cached prefix is resumed at a multiple of ``prefix_align``.

Tensor parallel (built under ``tp_group_scope``): the query heads (``q_b_proj``, sinks, the
output groups) and the indexer heads split, the one KV head and the compressors replicated,
the indexer's scores all-reduced; the experts split by intermediate size; the shared expert
column/row parallel; vocab-parallel embedding and LM head; mHC replicated.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from breakgraph.kernels import ops
from breakgraph.layers.linear import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from breakgraph.layers.moe import FusedMoE
from breakgraph.models import deepseek_v4_weights
from breakgraph.models.config import ModelConfig
from breakgraph.models.deepseek_v4_attention import (
    DeepseekV4Attention,
    DeepseekV4RMSNorm,
    DeepseekV4RotaryEmbedding,
    fp32_param,
)
from breakgraph.models.deepseek_v4_config import V4Layout, v4_layout
from breakgraph.models.deepseek_v4_step import begin_rows


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
        mixes = F.linear(streams.flatten(1).float(), self.fn)
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
        mixes = F.linear(streams.flatten(1).float(), self.hc_fn)
        _, _, collapsed = ops.hc_collapse(
            streams, mixes, self.hc_base, self.hc_scale, 0, self.eps, self.norm_eps, False
        )
        return collapsed


def _clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


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


class DeepseekV4Model(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.layout = layout = v4_layout(config)
        self.hc_mult = config.raw.get("hc_mult", 4)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [DeepseekV4DecoderLayer(config, layout, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = DeepseekV4RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = DeepseekV4RotaryEmbedding(layout)
        self.hc_head = DeepseekV4HyperHead(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        begin_rows(self.rotary_emb, positions)  # the layers' rope and windows, from these
        hidden = self.embed_tokens(input_ids)
        streams = hidden.unsqueeze(1).expand(-1, self.hc_mult, -1).contiguous()
        for layer in self.layers:
            streams = layer(streams, input_ids, self.rotary_emb)
        return self.norm(self.hc_head(streams))


class DeepseekV4ForCausalLM(nn.Module):
    # K is V: the pool holds one buffer per layer for both
    kv_k_is_v = True
    # prefill graphs break at the compressors' pooling and the attention, decode graphs
    # capture the whole step (deepseek_v4_attention.py)
    supports_cuda_graphs = True
    # a whole prefill graph would bake in the entries' bounds of its capture (not built)
    supports_whole_prefill_graphs = False

    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.raw.get("quantization_config"):
            kind = config.raw["quantization_config"].get("quant_method", "quantized")
            raise ValueError(
                f"DeepSeek V4 checkpoint is {kind} (FP8/FP4): only bfloat16 checkpoints "
                "are served (or --load-format dummy)"
            )
        self.config = config
        self.model = DeepseekV4Model(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        layout = self.model.layout
        self.prefix_align = layout.prefix_align
        self.prefix_recompute = layout.prefix_recompute

    # ---- caches
    def kv_cache_shapes(self) -> list[tuple[int, int]]:
        """One K = V head per layer (``kv_k_is_v``: the pool stores it once)."""
        return [(1, self.config.head_dim)] * self.config.num_hidden_layers

    def kv_slot_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-slot buffers beside the KV: each compressed layer's entries (and a CSA
        layer's indexer keys), in the slot of each window's last token."""
        shapes = {}
        for layer in self.model.layers:
            comp = layer.self_attn.compressor
            if comp is not None:
                shapes[comp.cache_name] = (comp.head_dim,)
                if hasattr(comp, "indexer"):
                    shapes[comp.indexer.cache_name] = (comp.indexer.head_dim,)
        return shapes

    def request_state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-request float32 state: each compressor's open window(s), as
        (max, sum of weights, weighted sum) per channel."""
        shapes = {}
        for layer in self.model.layers:
            comp = layer.self_attn.compressor
            for c in (comp, getattr(comp, "indexer", None)):
                if c is not None:
                    shapes[c.state_name] = (2 if c.overlap else 1, 3, c.head_dim)
        return shapes

    # ---- forward
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat batch of new tokens [T] -> final hidden states [T, hidden]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states).float()

    # ---- weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Checkpoint tensors into the parameters (``deepseek_v4_weights.py``)."""
        return deepseek_v4_weights.load_weights(self, weights)
