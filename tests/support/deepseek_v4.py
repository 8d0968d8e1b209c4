"""A tiny random HF DeepSeek V4 for the engine's parity tests: every attention kind (sliding,
CSA, HCA), hash and routed MoE, YaRN on the compressed layers; windows short enough (CSA 4,
HCA 16 tokens, a sliding window of 8) that a 70-token prompt spans several of each."""

from __future__ import annotations

import pytest
import torch

TINY_V4 = dict(
    vocab_size=256,
    hidden_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=32,
    q_lora_rank=32,
    partial_rotary_factor=0.25,
    num_experts_per_tok=2,
    n_routed_experts=8,
    n_shared_experts=1,
    routed_scaling_factor=1.5,
    max_position_embeddings=512,
    layer_types=[
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    hc_mult=4,
    sliding_window=8,
    o_groups=2,
    o_lora_rank=16,
    index_n_heads=2,
    index_head_dim=16,
    index_topk=64,  # at least every entry a test prompt has: top-k ties do not decide
    swiglu_limit=1.0,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
)


def make_hf_deepseek_v4(seed: int = 0, **overrides):
    """HF's DeepseekV4ForCausalLM in float32, every parameter and buffer random (HF inits
    sinks, biases, mHC bases and the hash table to constants)."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DeepseekV4ForCausalLM"):
        pytest.skip("transformers has no DeepseekV4ForCausalLM")
    config = transformers.DeepseekV4Config(**{**TINY_V4, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.DeepseekV4ForCausalLM(config).eval().float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("sinks", "base", "position_bias", "scale")):
                p.add_(torch.randn_like(p) * 0.3)
            elif name.endswith("gate.weight"):
                p.normal_(0.0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
            elif name.endswith("tid2eid"):
                e, k = config.n_routed_experts, config.num_experts_per_tok
                b.copy_(torch.stack([torch.randperm(e)[:k] for _ in range(b.shape[0])]))
    return model
