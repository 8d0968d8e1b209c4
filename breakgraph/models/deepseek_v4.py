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

import logging
import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from breakgraph.distributed import get_tp_group
from breakgraph.forward_batch import get_forward_context
from breakgraph.kernels import ops
from breakgraph.kernels.compressed_attention import CompressedStep
from breakgraph.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    ReplicatedLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    default_weight_loader,
    divide_for_tp,
    full,
    narrow,
    sharded_param,
)
from breakgraph.layers.moe import ExpertWeights, FusedMoE
from breakgraph.layers.rotary import rope_inv_freq
from breakgraph.models.config import ModelConfig
from breakgraph.models.deepseek_v4_config import CSA, SLIDING, V4Layout, v4_layout

logger = logging.getLogger(__name__)


def _fp32_param(*shape: int, fill: float | None = None) -> nn.Parameter:
    """A float32 parameter whatever the model's dtype (HF keeps these in float32)."""
    t = torch.empty(shape, dtype=torch.float32)
    if fill is not None:
        t.fill_(fill)
    p = nn.Parameter(t, requires_grad=False)
    p.weight_loader = default_weight_loader
    p.full_shape = tuple(shape)
    return p


class DeepseekV4RMSNorm(nn.Module):
    """float32 weight, normalised and scaled in float32, cast back (HF's)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = _fp32_param(dim, fill=1.0)
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight * h).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's DeepseekV4UnweightedRMSNorm: the scale computed in float32, applied in x's dtype."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class DeepseekV4RotaryEmbedding(nn.Module):
    """cos/sin [T, rope_dim / 2] of the ``main`` and ``compress`` ropes (one angle per
    interleaved pair), computed from the positions as HF does: no table."""

    def __init__(self, layout: V4Layout):
        super().__init__()
        for name, params in (("main", layout.rope_main), ("compress", layout.rope_compress)):
            inv_freq = rope_inv_freq(layout.rope_dim, float(params["rope_theta"]), params)
            self.register_buffer(f"{name}_inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * getattr(self, f"{kind}_inv_freq")[None, :]
        return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE on the trailing ``2 * cos.shape[-1]`` channels of x [T, ..., D] (pairs
    of neighbouring channels rotate; float32, cast back), cos/sin [T, r / 2]."""
    r = 2 * cos.shape[-1]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (r // 2,)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    rope = x[..., -r:].float().unflatten(-1, (-1, 2))
    x1, x2 = rope[..., 0], rope[..., 1]
    rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat([x[..., :-r], rotated.to(x.dtype)], dim=-1)


def _step() -> CompressedStep:
    """The live step as the compressed-attention ops read it: built at the first layer, kept
    on the batch (device ops only, no host sync)."""
    ctx = get_forward_context()
    batch = ctx.batch
    step = batch.attention_plans.get("deepseek_v4")
    if step is None:
        t = batch.input_ids.shape[0]
        b = batch.seq_lens.shape[0]
        ext = batch.extend_lens.long()
        row_req = torch.repeat_interleave(torch.arange(b, device=ext.device), ext, output_size=t)
        first = batch.out_cache_loc[batch.extend_start_loc.long().clamp(max=max(t - 1, 0))]
        step = batch.attention_plans["deepseek_v4"] = CompressedStep(
            positions=batch.positions,
            row_req=row_req,
            req_rows=batch.req_pool_indices,
            start_pos=batch.prefix_lens.long(),
            end_pos=batch.seq_lens.long(),
            fresh=(batch.prefix_lens == 0) | (first == 0),
            req_to_token=ctx.req_to_token,
            max_extend=max(batch.extend_lens_cpu) if batch.extend_lens_cpu else 1,
            max_seq=max(batch.seq_lens_cpu) if batch.seq_lens_cpu else 1,
        )
    return step


class DeepseekV4GroupedLinear(nn.Module):
    """HF's grouped output projection ``o_a_proj``: each group of heads projected on its
    own, weight [groups * rank, in_per_group]; under TP each rank holds its heads' groups."""

    def __init__(self, in_per_group: int, out_features: int, n_groups: int):
        super().__init__()
        self.tp = get_tp_group()
        self.groups = divide_for_tp(n_groups, self.tp.size, "o_groups")
        self.out_per_group = out_features // n_groups
        rows = self.groups * self.out_per_group
        self.weight = sharded_param(
            (rows, in_per_group), self.weight_loader, (out_features, in_per_group)
        )

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        n = param.shape[0]
        param.data.copy_(narrow(loaded, 0, self.tp.rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, groups, in_per_group] -> [T, groups * out_per_group]."""
        w = self.weight.view(self.groups, self.out_per_group, -1)
        return torch.einsum("tgi,goi->tgo", x, w).flatten(1)


class _Compressor(nn.Module):
    """One compressor: ``kv_proj`` / ``gate_proj`` to ``series * head_dim`` channels, a
    float32 ``position_bias`` per slot of the window, ``kv_norm``; pools each window into an
    entry stored (normed, roped at the window's first position) in the slot of the window's
    last token of the per-slot buffer ``cache_name``."""

    def __init__(self, config: ModelConfig, head_dim: int, ratio: int, overlap: bool, name: str):
        super().__init__()
        series = 2 if overlap else 1
        self.ratio, self.overlap, self.head_dim = ratio, overlap, head_dim
        self.cache_name, self.state_name = name, f"{name}_state"
        h = config.hidden_size
        self.kv_proj = ReplicatedLinear(h, series * head_dim)
        self.gate_proj = ReplicatedLinear(h, series * head_dim)
        self.position_bias = _fp32_param(ratio, series * head_dim)
        self.kv_norm = DeepseekV4RMSNorm(head_dim, config.rms_norm_eps)

    def compress(self, x: torch.Tensor, rotary: DeepseekV4RotaryEmbedding) -> torch.Tensor:
        """Pool the step's rows into the cache; return the cache buffer [slots, head_dim]."""
        ctx, step = get_forward_context(), _step()
        pool = ctx.kv_pool
        kv = self.kv_proj(x)
        score = self.gate_proj(x).float() + self.position_bias[step.positions % self.ratio]
        state = pool.request_states[self.state_name]
        pooled = ops.pool_windows(kv, score, state, self.ratio, self.overlap, step)
        entry = self.kv_norm(pooled.to(kv.dtype))
        start = (step.positions // self.ratio) * self.ratio
        entry = apply_rope(entry, *rotary(start, "compress"))
        cache = pool.slot_buffers[self.cache_name]
        closes = step.positions % self.ratio == self.ratio - 1
        dst = torch.where(closes, ctx.batch.out_cache_loc, torch.zeros_like(step.positions))
        cache[dst] = entry.to(cache.dtype)
        return cache


class DeepseekV4Indexer(_Compressor):
    """The lightning indexer: its own CSA-style compressor at ``index_head_dim`` and
    ``index_n_heads`` query heads scoring each visible entry; keeps the top ``index_topk``."""

    def __init__(self, config: ModelConfig, ratio: int, layer_id: int):
        raw = config.raw
        super().__init__(config, raw["index_head_dim"], ratio, True, f"index.{layer_id}")
        self.tp = get_tp_group()
        self.num_heads = raw["index_n_heads"]
        self.index_topk = raw["index_topk"]
        self.q_b_proj = ColumnParallelLinear(raw["q_lora_rank"], self.num_heads * self.head_dim)
        self.heads_per_rank = self.q_b_proj.out_per_rank // self.head_dim
        self.scorer = nn.Module()
        self.scorer.weights_proj = ColumnParallelLinear(config.hidden_size, self.num_heads)

    def forward(
        self, x: torch.Tensor, q_residual: torch.Tensor, rotary: DeepseekV4RotaryEmbedding
    ) -> torch.Tensor:
        """[T, k] the entries each row attends to (-1: none)."""
        step = _step()
        keys = self.compress(x, rotary)
        t = x.shape[0]
        q = self.q_b_proj(q_residual).view(t, self.heads_per_rank, self.head_dim)
        q = apply_rope(q, *rotary(step.positions, "compress"))
        weights = self.scorer.weights_proj(x).float() * self.num_heads**-0.5
        scores = ops.indexer_scores(q, weights, keys, step, self.ratio, self.head_dim**-0.5)
        scores = self.tp.all_reduce(scores)
        picks = scores.topk(min(self.index_topk, scores.shape[1]), dim=-1)
        visible = (step.positions + 1) // self.ratio
        return torch.where(picks.indices < visible[:, None], picks.indices, -1)


class DeepseekV4HCACompressor(_Compressor):
    """One entry per ``ratio`` (128) tokens, non-overlapping windows; all attended."""

    def __init__(self, config: ModelConfig, ratio: int, layer_id: int):
        super().__init__(config, config.head_dim, ratio, False, f"comp.{layer_id}")

    def forward(self, x, q_residual, rotary) -> tuple[torch.Tensor, None]:
        return self.compress(x, rotary), None


class DeepseekV4CSACompressor(_Compressor):
    """One entry per ``ratio`` (4) tokens over two overlapping series (each token's first
    half feeds the next window's entry); the indexer picks which entries a row attends to."""

    def __init__(self, config: ModelConfig, ratio: int, layer_id: int):
        super().__init__(config, config.head_dim, ratio, True, f"comp.{layer_id}")
        self.indexer = DeepseekV4Indexer(config, ratio, layer_id)

    def forward(self, x, q_residual, rotary) -> tuple[torch.Tensor, torch.Tensor]:
        cache = self.compress(x, rotary)
        return cache, self.indexer(x, q_residual, rotary)


class DeepseekV4Attention(nn.Module):
    def __init__(self, config: ModelConfig, layout: V4Layout, layer_id: int):
        super().__init__()
        raw = config.raw
        self.layer_id = layer_id
        self.layer_type = layout.layer_types[layer_id]
        self.rope_kind = "main" if self.layer_type == SLIDING else "compress"
        self.head_dim = d = config.head_dim
        self.eps = config.rms_norm_eps
        self.sliding_window = raw.get("sliding_window", 128)
        self.scaling = d**-0.5
        h, heads, rank = config.hidden_size, config.num_attention_heads, raw["q_lora_rank"]
        self.q_a_proj = ReplicatedLinear(h, rank)
        self.q_a_norm = DeepseekV4RMSNorm(rank, self.eps)
        self.q_b_proj = ColumnParallelLinear(rank, heads * d)
        self.num_heads = self.q_b_proj.out_per_rank // d
        self.kv_proj = ReplicatedLinear(h, d)
        self.kv_norm = DeepseekV4RMSNorm(d, self.eps)
        groups, o_rank = raw["o_groups"], raw["o_lora_rank"]
        self.o_a_proj = DeepseekV4GroupedLinear(heads * d // groups, groups * o_rank, groups)
        self.o_b_proj = RowParallelLinear(groups * o_rank, h)
        self._tp_rank = self.q_b_proj.tp.rank
        self.sinks = _fp32_param(self.num_heads)  # this rank's heads
        self.sinks.weight_loader, self.sinks.full_shape = self._load_sinks, (heads,)
        ratio = layout.ratio(layer_id)
        self.ratio = ratio
        if self.layer_type == SLIDING:
            self.compressor = None
        elif self.layer_type == CSA:
            self.compressor = DeepseekV4CSACompressor(config, ratio, layer_id)
        else:
            self.compressor = DeepseekV4HCACompressor(config, ratio, layer_id)

    def _load_sinks(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        n = self.num_heads
        param.data.copy_(narrow(loaded, 0, self._tp_rank * n, n))

    def forward(self, x: torch.Tensor, rotary: DeepseekV4RotaryEmbedding) -> torch.Tensor:
        ctx, step = get_forward_context(), _step()
        t, d = x.shape[0], self.head_dim
        cos, sin = rotary(step.positions, self.rope_kind)
        q_residual = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(q_residual).view(t, self.num_heads, d)
        q = apply_rope(unweighted_rms_norm(q, self.eps), cos, sin)
        kv = apply_rope(self.kv_norm(self.kv_proj(x)), cos, sin)
        kv_cache = ctx.kv_pool.k_buffers[self.layer_id]
        kv_cache[ctx.batch.out_cache_loc, 0] = kv.to(kv_cache.dtype)
        comp_cache = picks = None
        if self.compressor is not None:
            comp_cache, picks = self.compressor(x, q_residual, rotary)
        o = ops.sparse_attention(
            q, kv_cache, comp_cache, step, self.sliding_window, self.ratio, picks, self.sinks,
            self.scaling,
        )  # fmt: skip
        o = apply_rope(o, cos, -sin)  # V = K carries rope: undone at the query's position
        grouped = self.o_a_proj(o.reshape(t, self.o_a_proj.groups, -1))
        return self.o_b_proj(grouped)


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
        self.fn = _fp32_param((2 + n) * n, n * config.hidden_size)
        self.base = _fp32_param((2 + n) * n)
        self.scale = _fp32_param(3)

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
        self.hc_fn = _fp32_param(n, n * config.hidden_size)
        self.hc_base = _fp32_param(n)
        self.hc_scale = _fp32_param(1)

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


def _sqrtsoftplus(logits: torch.Tensor) -> torch.Tensor:
    return torch.sqrt(F.softplus(logits.float()))


class DeepseekV4TopKRouter(nn.Module):
    """``sqrtsoftplus`` scores; experts chosen by score + ``e_score_correction_bias``,
    weighted by their scores renormalised, times ``routed_scaling_factor``."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        raw = config.raw
        self.top_k = raw["num_experts_per_tok"]
        self.scaling = raw.get("routed_scaling_factor", 1.0)
        self.weight = nn.Parameter(torch.empty(raw["n_routed_experts"], config.hidden_size))
        self.register_buffer(
            "e_score_correction_bias", torch.zeros(raw["n_routed_experts"], dtype=torch.float32)
        )
        if raw.get("scoring_func", "sqrtsoftplus") != "sqrtsoftplus":
            raise NotImplementedError(f"DeepSeek V4 scoring_func {raw['scoring_func']!r}")

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor):
        logits = F.linear(x, self.weight)
        bias = self.e_score_correction_bias
        return ops.moe_route(logits, self.top_k, "sqrtsoftplus", True, None, bias, self.scaling)


class DeepseekV4HashRouter(nn.Module):
    """Experts fixed per token id (``tid2eid``), weighted by their ``sqrtsoftplus`` scores."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        raw = config.raw
        k, e = raw["num_experts_per_tok"], raw["n_routed_experts"]
        self.scaling = raw.get("routed_scaling_factor", 1.0)
        self.weight = nn.Parameter(torch.empty(e, config.hidden_size))
        # a checkpoint brings its own table; dummy weights get k distinct experts per token
        ids = torch.arange(config.vocab_size)[:, None] * 7 + torch.arange(k)[None, :]
        self.register_buffer("tid2eid", (ids % e).to(torch.int32))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor):
        scores = _sqrtsoftplus(F.linear(x, self.weight))
        ids = self.tid2eid[input_ids].long()
        return _weights(scores, ids, self.scaling), ids.to(torch.int32)


def _weights(scores: torch.Tensor, ids: torch.Tensor, scaling: float) -> torch.Tensor:
    w = scores.gather(1, ids)
    return w / (w.sum(dim=-1, keepdim=True) + 1e-20) * scaling


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
        hidden = self.embed_tokens(input_ids)
        streams = hidden.unsqueeze(1).expand(-1, self.hc_mult, -1).contiguous()
        for layer in self.layers:
            streams = layer(streams, input_ids, self.rotary_emb)
        return self.norm(self.hc_head(streams))


# the original checkpoint's names -> HF's (HF's conversion_mapping for deepseek_v4)
_RENAMES = [
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight", "embed_tokens.weight"),
    (r"^head\.weight", "lm_head.weight"),
    (r"^hc_head_fn", "hc_head.hc_fn"),
    (r"^hc_head_base", "hc_head.hc_base"),
    (r"^hc_head_scale", "hc_head.hc_scale"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_(fn|base|scale)", r".attn_hc.\1"),
    (r"\.hc_ffn_(fn|base|scale)", r".ffn_hc.\1"),
    (r"\.attn_sink", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."),
    (r"\.ape", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
    (r"\.experts\.(\d+)\.w1\.", r".experts.\1.gate_proj."),
    (r"\.experts\.(\d+)\.w2\.", r".experts.\1.down_proj."),
    (r"\.experts\.(\d+)\.w3\.", r".experts.\1.up_proj."),
]
_SHARED = re.compile(r"(.+\.shared_experts)\.(gate|up)_proj\.weight")


def hf_name(name: str) -> str:
    """A checkpoint tensor's HF name: the original checkpoint's names and what HF's
    ``save_pretrained`` writes (the original names under ``model.``) are renamed; HF's own
    pass through (no pattern matches them)."""
    name = name.removeprefix("model.")
    for pattern, repl in _RENAMES:
        name = re.sub(pattern, repl, name)
    return name if name.startswith("lm_head.") else "model." + name


class DeepseekV4ForCausalLM(nn.Module):
    # K is V: the pool holds one buffer per layer for both
    kv_k_is_v = True
    # the compressed attention's steps are not captured yet: the engine runs it eagerly
    supports_cuda_graphs = False

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
        """HF-named (or the original checkpoint's) tensors into the parameters, each through
        its ``weight_loader``; per-expert tensors into the stacked experts; the routers'
        buffers (``e_score_correction_bias``, ``tid2eid``). The MTP layers are skipped."""
        targets = dict(self.named_parameters()) | dict(self.named_buffers())
        experts = ExpertWeights(self)
        loaded: set[str] = set()
        mtp = 0
        for raw_name, tensor in weights:
            if raw_name.startswith("mtp.") or ".mtp." in raw_name:
                mtp += 1
                continue
            name = hf_name(raw_name)
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if experts.load(name, tensor):
                continue
            shard = None
            m = _SHARED.fullmatch(name)
            if m:
                name, shard = f"{m[1]}.gate_up_proj.weight", 0 if m[2] == "gate" else 1
            if name not in targets:
                raise KeyError(f"checkpoint tensor {raw_name!r} has no parameter in the model")
            target = targets[name]
            if isinstance(target, nn.Parameter):
                getattr(target, "weight_loader", default_weight_loader)(target, tensor, shard)
            else:
                target.copy_(full(tensor))
            loaded.add(name)
        if mtp:
            logger.info("skipped %d MTP tensors (no speculative decoding yet)", mtp)
        return loaded | experts.loaded()
