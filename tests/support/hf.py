"""Tiny random HF transformers models of each dense and MoE family, and what the tests that
compare the engine with them share: a tap on the engine's logits, HF's logits, prompts."""

from __future__ import annotations

import pytest
import torch

from breakgraph.engine.request import SamplingParams

ATOL = 2e-4  # float32 logits, engine against HF

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)

FAMILIES = {
    # Llama 3.1 style: llama3 rope scaling, tied embeddings
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            tie_word_embeddings=True,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 10000.0,
            },
        ),
    ),
    # Qwen2: q/k/v biases, GQA 4:1
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(num_key_value_heads=1, tie_word_embeddings=False),
    ),
    # Qwen2.5's long-context layout: YaRN rope (here 4x over a 128-token pretraining context)
    "qwen2_yarn": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "rope_theta": 10000.0,
            },
        ),
    ),
    # Qwen3: q/k norms, head_dim not hidden/heads
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=False)),
    # Qwen3-MoE: layers 0 and 2 sparse (8 experts, top-2, renormalized), layer 1 dense
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            head_dim=32,
            num_hidden_layers=3,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
        ),
    ),
}


class LogitsTap:
    """Records every step's last-row logits (float32 copies) of an engine's scheduler forward."""

    def __init__(self, engine):
        self.steps: list[torch.Tensor] = []
        inner = engine.scheduler.forward

        def forward(batch):
            logits = inner(batch)
            self.steps.append(logits.float().clone())
            return logits

        engine.scheduler.forward = forward


def make_hf_model(family: str, seed: int = 0):
    transformers = pytest.importorskip("transformers")
    cfg_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, cfg_name)(**{**TINY, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval().float()
    with torch.no_grad():  # HF zero-inits biases and ones-inits norms: randomize them too
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("mlp.gate.weight"):  # a router: top-k by margins, not by noise
                p.normal_(0.0, 0.5)
    return model


def assert_greedy_equals_hf(engine, hf, ps: list[list[int]], n: int) -> None:
    """The engine's greedy tokens for ``ps`` (one batch) equal HF ``generate``'s, one by one."""
    sp = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    for p, res in zip(ps, engine.generate(ps, sp), strict=True):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([p]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                eos_token_id=None,
            )  # fmt: skip
        assert res.output_ids == out[0, len(p) :].tolist()


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def prompts(n: int, lengths: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (length,), generator=g).tolist() for length in lengths[:n]]


def one_token() -> SamplingParams:
    return SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)


def hf_last_logits(model, ids: list[int]) -> torch.Tensor:
    """HF's float32 logits of the last row of ``ids``."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, -1].float()


def assert_last_logits_hf(got: torch.Tensor, hf, ids: list[int]) -> None:
    torch.testing.assert_close(got, hf_last_logits(hf, ids), atol=ATOL, rtol=1e-4)
