"""Gemma 4 checkpoint tensors into ``Gemma4ForCausalLM``'s parameters.

HF names (``model.*``, or ``model.language_model.*`` in a ``Gemma4ForConditionalGeneration``
checkpoint, whose vision and audio towers are skipped) map to ours with the stacked
projections (``qkv_proj``, ``gate_up_proj``) taking their shards; the experts load through
``ExpertWeights``; a KV-shared layer's k/v tensors are dropped (HF ignores them too).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from breakgraph.layers.linear import default_weight_loader, full
from breakgraph.layers.moe import ExpertWeights

if TYPE_CHECKING:
    from breakgraph.models.gemma4 import Gemma4ForCausalLM

logger = logging.getLogger(__name__)

# top-level modules of a Gemma4ForConditionalGeneration checkpoint that are not the text model
_NON_TEXT_MODULES = ("vision_tower", "audio_tower", "embed_vision", "embed_audio")
_PROJ = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(q|k|v|gate|up)_proj\.(weight|bias)")
_SHARED_LAYER_KV = re.compile(r"model\.layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.")


def load_weights(model: Gemma4ForCausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Copy HF-named tensors (or lazy safetensors slices) into ``model``'s parameters, each
    through its ``weight_loader`` (this rank's slice), and the ``layer_scalar`` buffers;
    returns the names loaded."""
    targets = dict(model.named_parameters()) | dict(model.named_buffers())
    experts = ExpertWeights(model)
    loaded: set[str] = set()
    skipped = 0
    for hf_name, tensor in weights:
        name = hf_name
        if name.startswith("model.language_model."):
            name = "model." + name.removeprefix("model.language_model.")
        elif name.startswith("model.") and name.split(".")[1] in _NON_TEXT_MODULES:
            skipped += 1
            continue
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        if experts.load(name, tensor):
            continue
        shared = _SHARED_LAYER_KV.match(name)
        if shared and model.model.layer_specs[int(shared[1])].shares_kv:
            continue  # HF ignores them too: a shared layer uses its source's k/v
        target, shard = _target(model, name)
        if target not in targets:
            raise KeyError(f"checkpoint tensor {hf_name!r} has no parameter in the model")
        param = targets[target]
        if isinstance(param, nn.Parameter):
            getattr(param, "weight_loader", default_weight_loader)(param, tensor, shard)
        else:  # a buffer (layer_scalar)
            param.copy_(full(tensor))
        loaded.add(target)
    if skipped:
        logger.info("skipped %d vision/audio tensors (text model only)", skipped)
    return loaded | experts.loaded()


def _target(model: Gemma4ForCausalLM, name: str) -> tuple[str, str | int | None]:
    """Our parameter for an HF name, and the shard of it the tensor fills (stacked ones:
    "q"/"k"/"v" of ``qkv_proj``, 0/1 (gate/up) of ``gate_up_proj``)."""
    m = _PROJ.fullmatch(name)
    if m is None:
        return name, None
    layer_id, module, shard, kind = int(m[1]), m[2], m[3], m[4]
    prefix = f"model.layers.{layer_id}.{module}"
    if module == "mlp":
        return f"{prefix}.gate_up_proj.{kind}", 0 if shard == "gate" else 1
    attn = model.model.layers[layer_id].self_attn
    if attn.shares_kv:
        return name, None
    if shard == "v" and attn.k_eq_v:
        return name, None  # no such parameter: reported as unknown
    return f"{prefix}.qkv_proj.{kind}", shard
