"""DeepSeek V4 checkpoint tensors into ``DeepseekV4ForCausalLM``'s parameters: HF's names, the
original checkpoint's (what HF's ``save_pretrained`` writes too, renamed as HF's conversion map
does), per-expert tensors into the stacked experts, the shared expert's gate and up into one
projection, the routers' buffers; the MTP layers' (``mtp.{i}.*``) where the model has them."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from breakgraph.layers.linear import default_weight_loader, full
from breakgraph.layers.moe import ExpertWeights
from breakgraph.models.deepseek_v4_mtp import MTP_NAME, mtp_weight_name

if TYPE_CHECKING:
    from breakgraph.models.deepseek_v4 import DeepseekV4ForCausalLM

logger = logging.getLogger(__name__)

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


def load_weights(
    model: DeepseekV4ForCausalLM, weights: Iterable[tuple[str, torch.Tensor]]
) -> set[str]:
    """HF-named (or the original checkpoint's) tensors into the parameters, each through
    its ``weight_loader``; per-expert tensors into the stacked experts; the routers'
    buffers (``e_score_correction_bias``, ``tid2eid``); the MTP layers' where it has them."""
    targets = dict(model.named_parameters()) | dict(model.named_buffers())
    experts = ExpertWeights(model)
    loaded: set[str] = set()
    mtp = 0
    for raw_name, tensor in weights:
        if MTP_NAME.match(raw_name):
            mtp += 1
            if model.mtp is None:
                continue
            name = mtp_weight_name(raw_name, hf_name)
            if name is None:  # the MTP's copy of the shared embedding or head
                continue
        else:
            name = hf_name(raw_name)
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
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
    if mtp and model.mtp is None:
        logger.info("skipped %d MTP tensors (used by --speculative-algorithm NEXTN)", mtp)
    return loaded | experts.loaded()
