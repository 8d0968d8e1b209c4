"""DeepSeek V4's attention (HF's DeepseekV4Attention and its compressors), over the engine's
paged caches: the one K = V head per token slot, each compressed layer's entries in the slot
of its window's last token, the compressors' open windows as per-request state
(``kernels/compressed_attention.py``); the float32 norms and the interleaved rope it shares
with the rest of the model (``deepseek_v4.py``).

Under a prefill graph, what reads the step's requests runs as two eager breaks per
compressed layer (one per sliding layer), each reading the live step
(``deepseek_v4_step.live_step``) and slicing its bucket-sized tensors to the live rows:
``compress_windows`` (the compressors' pooling, which carries each request's open window) and
``compressed_attention`` (the indexer's scores and top-k, and the attention over the window
and the entries). Everything else reads only the rows' positions and KV slots
(``V4Rows``) and is captured: the projections, norms and rope, the KV store, the entries'
norm, rope and store. Padding rows store their KV and entries in the reserved slot 0, and the
breaks leave their outputs zero.
"""

from __future__ import annotations

import torch
from torch import nn

from breakgraph.distributed import get_tp_group
from breakgraph.forward_batch import get_forward_context
from breakgraph.graph import eager_break
from breakgraph.kernels import ops
from breakgraph.kernels.compressed_attention import CompressedStep
from breakgraph.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    default_weight_loader,
    divide_for_tp,
    narrow,
    sharded_param,
)
from breakgraph.layers.rotary import rope_inv_freq
from breakgraph.models.config import ModelConfig
from breakgraph.models.deepseek_v4_config import CSA, SLIDING, V4Layout
from breakgraph.models.deepseek_v4_step import V4Rows, live_step, step_rows


def fp32_param(*shape: int, fill: float | None = None) -> nn.Parameter:
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
        self.weight = fp32_param(dim, fill=1.0)
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Gemma 4's norm computes exactly this (one kernel on CUDA, not seven):
        # h = x.float(); h = h * rsqrt(mean(h^2) + eps); (weight * h).to(x.dtype)
        return ops.gemma_rms_norm(x, self.weight, self.variance_epsilon)


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


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """Interleaved RoPE on the trailing ``2 * cos.shape[-1]`` channels of x [T, ..., D] (pairs
    of neighbouring channels rotate; float32, cast back), cos/sin [T, r / 2]; ``inverse``
    undoes it. In place (x is a fresh output that nothing else reads): one kernel on CUDA
    that moves only the tail (``ops.rope_tail``; its twin is HF's arithmetic)."""
    return ops.rope_tail(x, cos, sin, inverse, in_place=True)


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


@eager_break
def compress_windows(
    comp: _Compressor,
    kv: torch.Tensor,
    score: torch.Tensor,
    out: torch.Tensor,
    indexer_kv: torch.Tensor | None = None,
    indexer_score: torch.Tensor | None = None,
    indexer_out: torch.Tensor | None = None,
) -> None:
    """The live step's rows of ``kv``/``score`` [T, C] pooled into ``out`` [T, D] float32
    (the closing rows' entries; rows past the step's stay as they are), carrying each
    request's open window in ``comp``'s state; with ``indexer_kv``, a CSA layer's indexer
    likewise (one break for both)."""
    step = live_step()
    states = get_forward_context().kv_pool.request_states
    n = step.positions.shape[0]
    ops.pool_windows(kv[:n], score[:n], states[comp.state_name], comp.ratio, comp.overlap,
                     step, out=out[:n])  # fmt: skip
    if indexer_kv is not None:
        ind = comp.indexer
        ops.pool_windows(indexer_kv[:n], indexer_score[:n], states[ind.state_name], ind.ratio,
                         ind.overlap, step, out=indexer_out[:n])  # fmt: skip


@eager_break
def compressed_attention(
    q: torch.Tensor,
    o: torch.Tensor,
    attn: DeepseekV4Attention,
    cos: torch.Tensor,
    sin: torch.Tensor,
    indexer_q: torch.Tensor | None = None,
    indexer_weights: torch.Tensor | None = None,
) -> None:
    """q/o [T, H, D]: the live step's rows over their sliding window and, on a compressed
    layer, its entries (a CSA layer's: the indexer's top-k, scored here from ``indexer_q``
    and ``indexer_weights``). q as projected: HF's ``apply_rope(q_norm(q))`` (cos/sin [T,
    r / 2]) and the output's ``apply_rope(o, inverse)`` are the attention op's (inside its
    kernel in a decode step, beside it in a prefill one, in q's place). Writes o's live rows
    only."""
    step = live_step()
    pool = get_forward_context().kv_pool
    n = step.positions.shape[0]
    comp = attn.compressor
    comp_cache = picks = None
    if comp is not None:
        comp_cache = pool.slot_buffers[comp.cache_name]
        if indexer_q is not None:
            picks = comp.indexer.pick(indexer_q[:n], indexer_weights[:n], step)
    ops.sparse_attention(
        q[:n], pool.k_buffers[attn.layer_id], comp_cache, step, attn.sliding_window, attn.ratio,
        picks, attn.sinks, attn.scaling, out=o[:n], rope=(cos[:n], sin[:n], attn.eps),
        q_scratch=True,
    )  # fmt: skip


def _zeros_past_capture(t: torch.Tensor) -> torch.Tensor:
    """``t`` with the rows a graph replay may pad zeroed (when captured), which the breaks
    leave unwritten: every padding value stays defined."""
    pad_from = get_forward_context().pad_rows_from
    if pad_from is not None and pad_from < t.shape[0]:
        t[pad_from:].zero_()
    return t


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
        self.position_bias = fp32_param(ratio, series * head_dim)
        self.kv_norm = DeepseekV4RMSNorm(head_dim, config.rms_norm_eps)

    def project(self, x: torch.Tensor, rows: V4Rows) -> tuple[torch.Tensor, ...]:
        """(kv, score with the window slot's bias, a zeroed [T, head_dim] float32 for the
        pooled windows): what the pooling break reads and writes."""
        slot_in_window = rows.windows(self.ratio)[0]
        kv = self.kv_proj(x)
        score = ops.window_score(self.gate_proj(x), self.position_bias, slot_in_window)
        pooled = torch.zeros((x.shape[0], self.head_dim), dtype=torch.float32, device=x.device)
        return kv, score, pooled

    def store(self, pooled: torch.Tensor, rows: V4Rows) -> None:
        """The closing rows' entries (normed, roped at their window's first position) into
        the per-slot buffer (of the model's dtype); the other rows' go to slot 0."""
        _, cos, sin, dst = rows.windows(self.ratio)
        cache = get_forward_context().kv_pool.slot_buffers[self.cache_name]
        norm = self.kv_norm  # HF: apply_rope(kv_norm(pooled.to(dtype))), stored: one kernel
        ops.norm_rope_tail(pooled, norm.weight, norm.variance_epsilon, cos, sin, cache, dst)


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

    def queries(
        self, x: torch.Tensor, q_residual: torch.Tensor, rows: V4Rows
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [T, heads, head_dim] roped at the rows' positions, weights [T, heads]; HF scales
        the weights by heads^-0.5 in float32, which the scores do as they read them)."""
        q = self.q_b_proj(q_residual).view(x.shape[0], self.heads_per_rank, self.head_dim)
        q = apply_rope(q, *rows.rope("compress"))
        return q, self.scorer.weights_proj(x)

    def pick(self, q: torch.Tensor, weights: torch.Tensor, step: CompressedStep) -> torch.Tensor:
        """[T, k] the entries each of the step's rows attends to: the top-k of its scores,
        where a row that sees fewer than k entries gets some it cannot see yet (scored
        ``-inf``), which the attention skips."""
        keys = get_forward_context().kv_pool.slot_buffers[self.cache_name]
        scores = ops.indexer_scores(
            q, weights, keys, step, self.ratio, self.head_dim**-0.5, self.num_heads**-0.5
        )
        scores = self.tp.all_reduce(scores)
        return scores.topk(min(self.index_topk, scores.shape[1]), dim=-1).indices


class DeepseekV4HCACompressor(_Compressor):
    """One entry per ``ratio`` (128) tokens, non-overlapping windows; all attended."""

    def __init__(self, config: ModelConfig, ratio: int, layer_id: int):
        super().__init__(config, config.head_dim, ratio, False, f"comp.{layer_id}")

    def forward(self, x, q_residual, rows: V4Rows) -> tuple[None, None]:
        """Pool and store the step's entries; nothing for the attention to score."""
        kv, score, pooled = self.project(x, rows)
        compress_windows(self, kv, score, pooled)
        self.store(pooled, rows)
        return None, None


class DeepseekV4CSACompressor(_Compressor):
    """One entry per ``ratio`` (4) tokens over two overlapping series (each token's first
    half feeds the next window's entry); the indexer picks which entries a row attends to."""

    def __init__(self, config: ModelConfig, ratio: int, layer_id: int):
        super().__init__(config, config.head_dim, ratio, True, f"comp.{layer_id}")
        self.indexer = DeepseekV4Indexer(config, ratio, layer_id)

    def forward(self, x, q_residual, rows: V4Rows) -> tuple[torch.Tensor, torch.Tensor]:
        """Pool and store the step's entries and the indexer's keys -> the indexer's queries
        and weights (the attention break scores the entries with them)."""
        ind = self.indexer
        kv, score, pooled = self.project(x, rows)
        ikv, iscore, ipooled = ind.project(x, rows)
        compress_windows(self, kv, score, pooled, ikv, iscore, ipooled)
        self.store(pooled, rows)
        ind.store(ipooled, rows)
        return ind.queries(x, q_residual, rows)


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
        self.sinks = fp32_param(self.num_heads)  # this rank's heads
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
        ctx, rows = get_forward_context(), step_rows(rotary)
        t, d = x.shape[0], self.head_dim
        cos, sin = rows.rope(self.rope_kind)
        q_residual = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(q_residual).view(t, self.num_heads, d)
        # HF: kv = apply_rope(kv_norm(kv_proj(x))), then the cache's store: one kernel (norm,
        # rope and store: fused.norm_rope_tail); q's norm and rope are the attention op's
        kv_cache = ctx.kv_pool.k_buffers[self.layer_id]
        norm = self.kv_norm
        ops.norm_rope_tail(self.kv_proj(x), norm.weight, norm.variance_epsilon, cos, sin,
                           kv_cache, rows.out_cache_loc)  # fmt: skip
        indexer_q = indexer_weights = None
        if self.compressor is not None:
            indexer_q, indexer_weights = self.compressor(x, q_residual, rows)
        o = _zeros_past_capture(torch.empty_like(q))
        # (V = K carries rope: the output's undone at the query's position, there too)
        compressed_attention(q, o, self, cos, sin, indexer_q, indexer_weights)
        grouped = self.o_a_proj(o.reshape(t, self.o_a_proj.groups, -1))
        return self.o_b_proj(grouped)
