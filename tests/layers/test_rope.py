"""Rotary frequencies and cos/sin scale against HF's rope initializers (CPU)."""

from __future__ import annotations

import pytest
import torch

from breakgraph.layers.rotary import RotaryEmbedding, rope_attention_factor, rope_inv_freq
from breakgraph.models.config import ModelConfig

YARN_CASES = [  # (head_dim, theta, max_position, rope_parameters beyond the type)
    (128, 1e6, 131072, {"factor": 4.0, "original_max_position_embeddings": 32768}),
    (64, 1e4, 4096, {"factor": 2.0, "original_max_position_embeddings": 2048, "beta_fast": 16}),
    (128, 5e5, 65536, {"factor": 8.0, "original_max_position_embeddings": 8192, "truncate": False}),
    (64, 1e4, 8192, {"factor": 4.0, "original_max_position_embeddings": 2048, "mscale": 0.707,
                     "mscale_all_dim": 0.707}),
    (128, 1e4, 16384, {"factor": 4.0, "original_max_position_embeddings": 4096,
                       "attention_factor": 1.25}),
    (128, 1e6, 131072, {"factor": None, "original_max_position_embeddings": 32768}),  # ratio
    (32, 1e4, 512, {"factor": 3.0}),  # the pretraining context defaults to max_position
]  # fmt: skip


@pytest.mark.parametrize(("head_dim", "theta", "max_position", "params"), YARN_CASES)
def test_yarn_matches_hf(head_dim, theta, max_position, params):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    raw = {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 4 * head_dim,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": head_dim,
        "vocab_size": 32,
        "max_position_embeddings": max_position,
        "rope_scaling": {"rope_type": "yarn", "rope_theta": theta, **params},
    }
    cfg = ModelConfig.from_dict(raw)
    hf_cfg = transformers.Qwen2Config(**{k: v for k, v in raw.items() if k != "architectures"})
    hf_inv, hf_scale = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    inv = rope_inv_freq(head_dim, cfg.rope_theta, cfg.rope_scaling)
    torch.testing.assert_close(inv, hf_inv.float(), rtol=1e-6, atol=0)
    assert rope_attention_factor(cfg.rope_scaling) == pytest.approx(hf_scale, rel=1e-12)
    rope = RotaryEmbedding(head_dim, 64, cfg.rope_theta, cfg.rope_scaling)
    cos, sin = rope.cos_sin(torch.tensor([0, 63]))
    assert cos[0].max().item() == pytest.approx(hf_scale)  # position 0: cos 1, scaled
    assert sin[1].abs().max().item() <= hf_scale + 1e-6


def test_llama3_pretraining_context_defaults_as_hf():
    """Without ``original_max_position_embeddings`` the llama3 ramp uses max_position, as
    HF fills it in (a top-level value wins)."""
    raw = {
        "hidden_size": 256, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "vocab_size": 32, "max_position_embeddings": 4096,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0},
    }  # fmt: skip
    assert ModelConfig.from_dict(raw).rope_scaling["original_max_position_embeddings"] == 4096
    raw["original_max_position_embeddings"] = 1024
    assert ModelConfig.from_dict(raw).rope_scaling["original_max_position_embeddings"] == 1024


def test_yarn_over_part_of_the_head_is_refused():
    with pytest.raises(NotImplementedError, match="partial_rotary_factor"):
        rope_inv_freq(64, 1e4, {"rope_type": "yarn", "factor": 2.0,
                                "original_max_position_embeddings": 128,
                                "partial_rotary_factor": 0.5})  # fmt: skip
