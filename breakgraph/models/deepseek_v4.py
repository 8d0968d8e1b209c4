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

The layers' blocks are in ``deepseek_v4_layers.py``, the MTP layers (NEXTN's drafts) in
``deepseek_v4_mtp.py``. The attention and its compressors are in ``deepseek_v4_attention.py`` (with what of them a
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
from torch import nn

from breakgraph.layers.linear import ParallelLMHead, VocabParallelEmbedding
from breakgraph.models import deepseek_v4_weights
from breakgraph.models.config import ModelConfig
from breakgraph.models.deepseek_v4_attention import DeepseekV4RMSNorm, DeepseekV4RotaryEmbedding
from breakgraph.models.deepseek_v4_config import v4_layout
from breakgraph.models.deepseek_v4_layers import DeepseekV4DecoderLayer, DeepseekV4HyperHead
from breakgraph.models.deepseek_v4_mtp import DeepseekV4MTP
from breakgraph.models.deepseek_v4_step import begin_rows


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
        # the forward returns the streams before the hyper head ([T, hc_mult * H]: what the
        # MTP layers read); ``head`` collapses them
        self.return_streams = False

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        begin_rows(self.rotary_emb, positions)  # the layers' rope and windows, from these
        hidden = self.embed_tokens(input_ids)
        streams = hidden.unsqueeze(1).expand(-1, self.hc_mult, -1).contiguous()
        for layer in self.layers:
            streams = layer(streams, input_ids, self.rotary_emb)
        if self.return_streams:
            return streams.flatten(1)
        return self.head(streams)

    def head(self, streams: torch.Tensor) -> torch.Tensor:
        """streams [T, hc_mult, H] -> final hidden states [T, H]."""
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
        self.mtp = None
        if config.with_mtp:  # NEXTN's drafts; the forward then returns the streams
            self.mtp = DeepseekV4MTP(config, layout, self.model.embed_tokens, self.lm_head)
            self.model.return_streams = True

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
        """Final hidden states (or, with MTP layers, the streams) -> logits."""
        if self.model.return_streams:
            hidden_states = self.model.head(
                hidden_states.view(-1, self.model.hc_mult, self.config.hidden_size)
            )
        return self.lm_head(hidden_states).float()

    # ---- weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Checkpoint tensors into the parameters (``deepseek_v4_weights.py``)."""
        return deepseek_v4_weights.load_weights(self, weights)
