"""Llama (2, 3, 3.1 with llama3 rope scaling; SmolLM2), module tree as HF's LlamaForCausalLM.

q/k/v and gate/up are stacked into one projection each (``qkv_proj``, ``gate_up_proj``),
as SGLang and vLLM do: one GEMM launch instead of three or two. ``load_weights`` maps
HF's separate tensors into their shards.

Tensor parallel (built under ``tp_group_scope``): q/k/v and gate/up column-parallel, o and
down row-parallel (one all-reduce each), vocab-parallel embedding and LM head; each layer's
``weight_loader`` copies its rank's slice of the HF tensor.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from breakgraph.distributed import get_tp_group, reduce_in_norms
from breakgraph.kernels import ops
from breakgraph.layers.attention import Attention
from breakgraph.layers.linear import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    default_weight_loader,
)
from breakgraph.layers.norm import RMSNorm
from breakgraph.layers.rotary import RotaryEmbedding
from breakgraph.models.config import ModelConfig


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, bias=False
        )
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.act_and_mul(x, "silu"))  # SiLU(gate) * up


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=config.attention_bias,
        )
        # this rank's heads (all of them without TP)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=False
        )
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, layer_id)

    def split_qkv(self, qkv: torch.Tensor):
        """The ``qkv_proj`` output [T, q + 2 kv] as q, k, v heads (views)."""
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (
            q.view(t, self.num_heads, self.head_dim),
            k.view(t, self.num_kv_heads, self.head_dim),
            v.view(t, self.num_kv_heads, self.head_dim),
        )

    def position_embed(self, q, k, cos, sin, store):
        """RoPE of q and k; k and v go to the KV cache in the same kernel (``store``)."""
        return ops.rope(q, k, cos, sin, store)[0]

    def forward(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Attention from the layer's ``qkv_proj`` output (the layer computes it with the input
        norm in front: ``RMSNorm.project``)."""
        q, k, v = self.split_qkv(qkv)
        q = self.position_embed(q, k, cos, sin, self.attn.kv_write(v))
        return self.o_proj(self.attn(q))  # its k/v are stored


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention

    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        self.self_attn = self.attention_cls(config, layer_id)
        self.mlp = self.build_mlp(config, layer_id)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        tp = get_tp_group()
        # the TP group that the norms all-reduce for, or None (the projections reduce)
        self.reduce_group = tp if tp.is_parallel and reduce_in_norms() else None
        # whether forward's output is a partial sum (a dense MLP's down; MoE blocks reduce)
        self.output_partial = self.reduce_group is not None and isinstance(self.mlp, LlamaMLP)
        if self.reduce_group is not None:
            self.self_attn.o_proj.reduce_results = False
            if self.output_partial:
                self.mlp.down_proj.reduce_results = False

    def build_mlp(self, config: ModelConfig, layer_id: int) -> nn.Module:
        return LlamaMLP(config)

    def forward(self, hidden_states, residual, cos, sin, partial: bool = False):
        """``partial``: hidden_states is the previous layer's partial sum on this rank (its
        ``output_partial``), all-reduced by this layer's input norm."""
        # each norm (after the residual add) runs with the projection it feeds: one kernel
        # where decode's few rows take the skinny GEMM, else the norm then the GEMM; under TP
        # the norms after o and down all-reduce their partial sums in the same kernel
        group = self.reduce_group
        qkv, residual = self.input_layernorm.project(
            hidden_states, residual, self.self_attn.qkv_proj, reduce=group if partial else None
        )
        hidden_states = self.self_attn(qkv, cos, sin)
        if not isinstance(self.mlp, LlamaMLP):  # a sparse MoE block: its router reads the norm
            hidden_states, residual = self.post_attention_layernorm(hidden_states, residual, group)
            return self.mlp(hidden_states), residual
        act, residual = self.post_attention_layernorm.project(
            hidden_states, residual, self.mlp.gate_up_proj, "silu", reduce=group
        )
        return self.mlp.down_proj(act), residual


class LlamaModel(nn.Module):
    layer_cls = LlamaDecoderLayer

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [self.layer_cls(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb.cos_sin(positions)
        residual, partial = None, False
        for layer in self.layers:
            hidden_states, residual = layer(hidden_states, residual, cos, sin, partial)
            partial = layer.output_partial
        reduce = self.layers[-1].reduce_group if partial else None
        hidden_states, _ = self.norm(hidden_states, residual, reduce)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    model_cls = LlamaModel
    # (stacked param, HF param, shard id)
    stacked_params = [
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    ]

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = self.model_cls(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat batch of new tokens [T] -> final hidden states [T, hidden]."""
        return self.model(input_ids, positions)

    def kv_cache_shapes(self) -> list[tuple[int, int]]:
        """(num_kv_heads, head_dim) of each layer storing KV (this rank's KV heads): every
        layer, one shape."""
        c = self.config
        attn = self.model.layers[0].self_attn
        return [(attn.num_kv_heads, c.head_dim)] * c.num_hidden_layers

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors (or lazy safetensors slices) into the parameters, each
        parameter's ``weight_loader`` taking this rank's slice; returns the names loaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            for stacked, hf_name, shard in self.stacked_params:
                if f".{hf_name}." in name:
                    target = name.replace(f".{hf_name}.", f".{stacked}.")
                    param = params[target]
                    param.weight_loader(param, tensor, shard)
                    loaded.add(target)
                    break
            else:
                if name not in params:
                    raise KeyError(f"checkpoint tensor {name!r} has no parameter in the model")
                param = params[name]
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                loaded.add(name)
        return loaded
