"""Model configuration read from an HF config.json (or a dict shaped like one)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class ModelConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)
    # build the checkpoint's multi-token prediction layers too (NEXTN speculative decoding)
    with_mtp: bool = False

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        cfg = _text_config(cfg)
        heads = cfg["num_attention_heads"]
        # transformers 5 moved rope settings into `rope_parameters`; accept both layouts.
        # Per layer type ({"sliding_attention": {...}, ...}): the model reads them from raw.
        rope_params = dict(cfg.get("rope_parameters") or {})
        if rope_params and all(isinstance(v, dict) for v in rope_params.values()):
            rope_params = {}
        rope_scaling = cfg.get("rope_scaling") or rope_params or None
        rope_theta = (
            rope_params.pop("rope_theta", None)
            or (rope_scaling or {}).get("rope_theta")  # transformers 5's constructor layout
            or cfg.get("rope_theta", 10000.0)
        )
        if rope_scaling is not None:
            rope_scaling = dict(rope_scaling)
            kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            rope_scaling["rope_type"] = kind
            if kind == "default":
                rope_scaling = None
            elif kind in ("llama3", "yarn"):  # the pretraining context, as HF fills it in
                original = cfg.get("original_max_position_embeddings")
                if original is not None:  # a top-level value wins (HF: Phi-3's layout)
                    rope_scaling["original_max_position_embeddings"] = original
                else:
                    rope_scaling.setdefault(
                        "original_max_position_embeddings", cfg.get("max_position_embeddings", 4096)
                    )
                if kind == "yarn" and rope_scaling.get("factor") is None:  # HF: their ratio
                    rope_scaling["factor"] = (
                        cfg.get("max_position_embeddings", 4096)
                        / rope_scaling["original_max_position_embeddings"]
                    )
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        arch = archs[0]
        return cls(
            architecture=arch,
            hidden_size=cfg["hidden_size"],
            # MoE-only families (DeepSeek V4) name their one width moe_intermediate_size
            intermediate_size=cfg.get("intermediate_size") or cfg["moe_intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama/Qwen3 only when attention_bias says so
            attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            raw=dict(cfg),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))


# keys of a multimodal config's top level that hold for its text model too
_TOP_LEVEL_KEYS = ("architectures", "eos_token_id", "bos_token_id", "torch_dtype", "dtype")


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A multimodal checkpoint's config (Gemma4ForConditionalGeneration: the language
    model's settings under ``text_config``) as one flat text config; others unchanged."""
    text = cfg.get("text_config")
    if not isinstance(text, dict) or "hidden_size" in cfg:
        return cfg
    flat = dict(text)
    flat.update({k: cfg[k] for k in _TOP_LEVEL_KEYS if cfg.get(k) is not None})
    if "tie_word_embeddings" in cfg:
        flat["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    return flat
