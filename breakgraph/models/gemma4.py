"""Gemma 4 text models (E2B, E4B, ...), module tree as HF's Gemma4ForCausalLM / Gemma4TextModel.

What sets Gemma 4 apart, all read from the text config:

- ``layer_types``: sliding-window layers (``sliding_window``) and full layers, each type with
  its own head_dim (``global_head_dim`` or ``per_layer_config`` on full layers), KV heads and
  rope (``rope_parameters`` per type; full layers use "proportional" rope);
- KV sharing: the last ``num_kv_shared_layers`` layers have no k/v projections, store no KV
  and read the KV of the last earlier layer of their type; the KV pool holds the others only
  (``kv_cache_shapes``, ``kv_layer_of``);
- per-layer input embeddings (PLE): a per-layer vector from the token id and the embedding
  gates a residual branch after each layer's MLP;
- MoE block (``enable_moe_block``, 26B-A4B): beside each layer's dense MLP, top-k experts
  (``FusedMoE``, tanh GELU) routed from the pre-MLP residual, each branch with its own norms;
- sandwich norms, q/k/v norms (v without scale), attention scaling 1.0, ``layer_scalar``,
  embeddings scaled by sqrt(hidden), final logit softcapping, double-wide MLP on the shared
  layers (``use_double_wide_mlp``), ``attention_k_eq_v`` (full layers use k as v).

``forward`` is HF's computation: every layer on every row. Bounded prefill (the KV-shared
layers on the LM head's rows only: ``forward_logits_rows``, ``forward_head``, ``forward_tail``)
is in ``gemma4_tail.py``; checkpoint names onto parameters in ``gemma4_weights.py``.

Tensor parallel (built under ``tp_group_scope``), as SGLang's and vLLM's: q/k/v (q/k when k
is v) column-parallel by heads, each layer's KV heads split or replicated per rank (the pool
holds each rank's KV heads of the KV layers, so a shared layer finds its source's), o and
MLP down row-parallel, gate/up column-parallel, the experts split by intermediate size (router
replicated), vocab-parallel embedding, PLE table and tied LM head (softcapping after the
gather). The small per-layer (PLE) projections and every norm stay replicated.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from breakgraph.kernels import ops
from breakgraph.layers.attention import Attention
from breakgraph.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    local_kv_heads,
)
from breakgraph.layers.moe import FusedMoE
from breakgraph.layers.norm import GemmaRMSNorm
from breakgraph.layers.rotary import rope_inv_freq
from breakgraph.models import gemma4_weights
from breakgraph.models.config import ModelConfig
from breakgraph.models.gemma4_config import DEFAULT_ROPE, Gemma4Layer, gemma4_layers
from breakgraph.models.gemma4_tail import Gemma4BoundedPrefill


class Gemma4RotaryEmbedding(nn.Module):
    """cos/sin per layer type, computed from the step's positions as HF does: no table (128K
    positions of 512-wide full-layer heads would take half a gigabyte)."""

    def __init__(self, config: ModelConfig, layers: list[Gemma4Layer]):
        super().__init__()
        rope_parameters = config.raw.get("rope_parameters") or DEFAULT_ROPE
        self.layer_types = sorted({layer.layer_type for layer in layers})
        for t in self.layer_types:
            params = rope_parameters.get(t)
            if params is None:
                raise ValueError(f"rope_parameters has no entry for {t!r}")
            head_dim = next(layer.head_dim for layer in layers if layer.layer_type == t)
            inv_freq = rope_inv_freq(head_dim, float(params["rope_theta"]), params)
            self.register_buffer(f"{t}_inv_freq", inv_freq, persistent=False)

    def forward(
        self, positions: torch.Tensor, layer_type: str, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = getattr(self, f"{layer_type}_inv_freq")
        freqs = positions[:, None].float() * inv_freq[None, :].float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class Gemma4MLP(nn.Module):
    """GeGLU (tanh GELU); gate and up stacked into one projection (``gate_up_proj``)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.intermediate_size = intermediate_size
        # a rank holds [gate slice; up slice]: chunk(2) splits it as the full one
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=False
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.act_and_mul(x, "gelu_tanh"))


class Gemma4Router(nn.Module):
    """HF's Gemma4TextRouter: unscaled RMSNorm, times ``scale`` and 1/sqrt(hidden), linear to
    E scores, float32 softmax, top-k renormalized, times ``per_expert_scale`` of the chosen."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        h, e = config.hidden_size, config.raw["num_experts"]
        self.top_k = config.raw["top_k_experts"]
        self.scalar_root_size = h**-0.5
        self.norm = GemmaRMSNorm(h, config.rms_norm_eps, with_scale=False)
        self.proj = ReplicatedLinear(h, e, bias=False)
        self.scale = nn.Parameter(torch.ones(h))
        self.per_expert_scale = nn.Parameter(torch.ones(e))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights float32 [T, K], expert ids [T, K])."""
        logits = self.proj(self.norm(x) * self.scale * self.scalar_root_size)
        return ops.moe_route(logits, self.top_k, "softmax", True, self.per_expert_scale)


class Gemma4Attention(nn.Module):
    """q/k/v stacked into ``qkv_proj`` (q and k only when k is v); a KV-shared layer has only
    ``q_proj`` and reads its source layer's KV. Head counts and sizes are this rank's."""

    def __init__(self, config: ModelConfig, layer: Gemma4Layer, layer_id: int):
        super().__init__()
        eps, h = config.rms_norm_eps, config.hidden_size
        heads = config.num_attention_heads
        self.head_dim = d = layer.head_dim
        self.shares_kv = layer.shares_kv
        self.k_eq_v = layer.k_eq_v
        bias = config.attention_bias
        if self.shares_kv:
            self.q_proj = ColumnParallelLinear(h, heads * d, bias=bias)
            self.num_heads = self.q_proj.out_per_rank // d
            # the KV heads its source layer stores on this rank (same split as its qkv_proj)
            self.num_kv_heads = local_kv_heads(layer.num_kv_heads, self.q_proj.tp.size)
        else:
            self.qkv_proj = QKVParallelLinear(
                h, d, heads, layer.num_kv_heads, bias, with_v=not self.k_eq_v
            )
            self.num_heads = self.qkv_proj.num_heads
            self.num_kv_heads = self.qkv_proj.num_kv_heads
            self.k_norm = GemmaRMSNorm(d, eps)
            self.v_norm = GemmaRMSNorm(d, eps, with_scale=False)
        self.q_size = self.num_heads * d
        self.kv_size = self.num_kv_heads * d
        self.q_norm = GemmaRMSNorm(d, eps)
        self.o_proj = RowParallelLinear(heads * d, h, bias=bias)
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            d,
            layer_id,
            scaling=1.0,  # q and k are normed: no 1/sqrt(d)
            sliding_window=layer.sliding_window,
            kv_layer_id=layer.kv_layer,
        )

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        t = hidden_states.shape[0]
        eps = self.q_norm.eps
        if self.shares_kv:
            q = self.q_proj(hidden_states).view(t, self.num_heads, self.head_dim)
            q, _ = ops.gemma_qk_norm_rope(q, None, self.q_norm.weight, None, eps, cos, sin)
            return self.o_proj(self.attn(q))
        qkv = self.qkv_proj(hidden_states)
        q = qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(t, self.num_kv_heads, -1)
        v = k if self.k_eq_v else qkv[:, self.q_size + self.kv_size :].view(k.shape)
        # q/k norms, RoPE and the KV store in one kernel (HF: q_norm, k_norm, then
        # apply_rotary_pos_emb; the cache update in attention)
        store = self.attn.kv_write(self.v_norm(v))
        q, _ = ops.gemma_qk_norm_rope(
            q, k, self.q_norm.weight, self.k_norm.weight, eps, cos, sin, store
        )  # fmt: skip
        return self.o_proj(self.attn(q))


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: Gemma4Layer, layer_id: int):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.layer_type = layer.layer_type
        self.self_attn = Gemma4Attention(config, layer, layer_id)
        self.mlp = Gemma4MLP(h, layer.intermediate_size)
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.register_buffer("layer_scalar", torch.ones(1))
        # MoE block (26B-A4B): experts beside the dense MLP, routed from the pre-MLP residual
        self.enable_moe_block = bool(config.raw.get("enable_moe_block"))
        if self.enable_moe_block:
            raw = config.raw
            self.router = Gemma4Router(config)
            # experts split by intermediate size, one all-reduce of their own: the dense
            # MLP's output is summed (down_proj) before post_feedforward_layernorm_1 and the
            # experts' before post_feedforward_layernorm_2, so the two cannot share one
            self.experts = FusedMoE(
                raw["num_experts"], h, raw["moe_intermediate_size"], "gelu_tanh"
            )
            self.post_feedforward_layernorm_1 = GemmaRMSNorm(h, eps)
            self.post_feedforward_layernorm_2 = GemmaRMSNorm(h, eps)
            self.pre_feedforward_layernorm_2 = GemmaRMSNorm(h, eps)
        self.hidden_size_per_layer_input = p = config.raw.get("hidden_size_per_layer_input") or 0
        if p:
            # small (hidden x P): replicated under TP, every rank computes the whole branch
            self.per_layer_input_gate = ReplicatedLinear(h, p, bias=False)
            self.per_layer_projection = ReplicatedLinear(p, h, bias=False)
            self.post_per_layer_input_norm = GemmaRMSNorm(h, eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        per_layer_input: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(hidden_states, cos, sin)
        # residual + post-norm: one kernel each (HF: residual + norm(hidden_states))
        hidden_states = self.post_attention_layernorm.forward_add(hidden_states, residual)

        residual = hidden_states
        hidden_states = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        if self.enable_moe_block:
            dense = self.post_feedforward_layernorm_1(hidden_states)
            routing = self.router(residual)
            sparse = self.experts(self.pre_feedforward_layernorm_2(residual), *routing)
            hidden_states = self.post_feedforward_layernorm_2.forward_add(sparse, dense)
        # the layer's last norm + residual add also applies layer_scalar (HF: hidden_states *=
        # layer_scalar at the end), in the same kernel
        if not self.hidden_size_per_layer_input:
            return self.post_feedforward_layernorm.forward_add(
                hidden_states, residual, self.layer_scalar
            )
        hidden_states = self.post_feedforward_layernorm.forward_add(hidden_states, residual)
        residual = hidden_states
        gate = self.per_layer_input_gate(hidden_states)
        branch = self.per_layer_projection(ops.gelu_tanh_mul(gate, per_layer_input))
        return self.post_per_layer_input_norm.forward_add(branch, residual, self.layer_scalar)


class Gemma4TextModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        raw = config.raw
        self.layer_specs = gemma4_layers(config)
        n = config.num_hidden_layers
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # HF keeps the scales as float32 tensors and casts them to the weights' dtype at each
        # forward: built in the model's dtype (the default while it is built), the cast in
        # ``embed`` is a no-op, not a kernel per step
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size**0.5), persistent=False)
        self.layers = nn.ModuleList(
            [Gemma4DecoderLayer(config, spec, i) for i, spec in enumerate(self.layer_specs)]
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = Gemma4RotaryEmbedding(config, self.layer_specs)
        self.first_kv_shared_layer_idx = sum(not s.shares_kv for s in self.layer_specs)

        # Per-layer embeddings: one packed table [vocab, layers * P], and a projection of the
        # token embedding to the same width; their normalized mean feeds each layer's gate.
        self.hidden_size_per_layer_input = p = raw.get("hidden_size_per_layer_input") or 0
        if p:
            vocab_ple = raw.get("vocab_size_per_layer_input") or config.vocab_size
            # huge (262144 x layers * P): vocab-parallel, as the token embedding
            self.embed_tokens_per_layer = VocabParallelEmbedding(vocab_ple, n * p)
            self.register_buffer("embed_per_layer_scale", torch.tensor(p**0.5), persistent=False)
            self.per_layer_input_scale = 2.0**-0.5
            # hidden x layers * P, small: replicated under TP (as its norm)
            self.per_layer_model_projection = ReplicatedLinear(
                config.hidden_size, n * p, bias=False
            )
            self.per_layer_model_projection_scale = config.hidden_size**-0.5
            self.per_layer_projection_norm = GemmaRMSNorm(p, config.rms_norm_eps)

    @property
    def num_kv_shared_layers(self) -> int:
        return len(self.layers) - self.first_kv_shared_layer_idx

    def embed(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Scaled token embeddings [T, hidden] and per-layer inputs [T, layers, P] (or None)."""
        weight = self.embed_tokens.weight
        hidden = self.embed_tokens(input_ids) * self.embed_scale.to(weight.dtype)
        p = self.hidden_size_per_layer_input
        if not p:
            return hidden, None
        shape = (input_ids.shape[0], len(self.layers), p)
        table = self.embed_tokens_per_layer
        token = table(input_ids) * self.embed_per_layer_scale.to(table.weight.dtype)
        proj = self.per_layer_model_projection(hidden) * self.per_layer_model_projection_scale
        proj = self.per_layer_projection_norm(proj.reshape(shape))
        return hidden, (proj + token.reshape(shape)) * self.per_layer_input_scale

    def run_layers(
        self,
        hidden: torch.Tensor,
        per_layer_inputs: torch.Tensor | None,
        positions: torch.Tensor,
        layer_ids: range,
    ) -> torch.Tensor:
        """Run ``layers[layer_ids]`` over the rows of ``hidden`` (the forward context's batch)."""
        cos_sin = {
            t: self.rotary_emb(positions, t, hidden.dtype)
            for t in {self.layer_specs[i].layer_type for i in layer_ids}
        }
        for i in layer_ids:
            layer = self.layers[i]
            ple = None if per_layer_inputs is None else per_layer_inputs[:, i]
            hidden = layer(hidden, ple, *cos_sin[layer.layer_type])
        return hidden

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, per_layer_inputs = self.embed(input_ids)
        hidden = self.run_layers(hidden, per_layer_inputs, positions, range(len(self.layers)))
        return self.norm(hidden)


class Gemma4ForCausalLM(Gemma4BoundedPrefill, nn.Module):
    """Also serves ``Gemma4ForConditionalGeneration`` checkpoints: their text model only.
    Bounded prefill (``forward_logits_rows``, ``forward_head``, ``forward_tail``,
    ``tail_inputs``) comes from ``Gemma4BoundedPrefill``."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = Gemma4TextModel(config)
        # vocab-parallel, logits all-gathered: compute_logits softcaps the whole row
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.final_logit_softcapping = config.raw.get("final_logit_softcapping")
        # bounded replay (eager): shared layers on the LM head's rows only in extend steps;
        # under TP every rank must choose the same (their all-reduces pair up): the engine
        # applies --[no-]kv-sharing-fast-prefill on every rank (``configure_model``)
        self.kv_sharing_fast_prefill = self.model.num_kv_shared_layers > 0

    # ---- KV layout: only the layers before the first KV-shared one store KV
    @property
    def num_kv_layers(self) -> int:
        return self.model.first_kv_shared_layer_idx

    def kv_layer_of(self, layer_id: int) -> int:
        """The KV layer (pool buffer) layer ``layer_id`` reads: its own, or its source's."""
        return self.model.layer_specs[layer_id].kv_layer

    def kv_cache_shapes(self) -> list[tuple[int, int]]:
        """(num_kv_heads, head_dim) of each KV layer (this rank's KV heads), for
        ``KVPool.from_shapes``."""
        layers = self.model.layers[: self.num_kv_layers]
        return [(layer.self_attn.num_kv_heads, layer.self_attn.head_dim) for layer in layers]

    # ---- forward
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat batch of new tokens [T] -> final hidden states [T, hidden], every layer."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden_states).float()
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    # ---- weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors (``model.*`` or ``model.language_model.*``; tensors or lazy
        safetensors slices) into the parameters, each through its ``weight_loader`` (this
        rank's slice), and the ``layer_scalar`` buffers; returns the names loaded."""
        return gemma4_weights.load_weights(self, weights)
