"""Tiny random Gemma 4 models (HF transformers): text (E2B-like, KV-shared layers, per-layer
inputs), dense (as the 31B), MoE (the 26B-A4B's block) and multimodal; and the GPU engine
and workload the Gemma 4 GPU tests share."""

from __future__ import annotations

import pytest
import torch

from breakgraph.engine.request import SamplingParams
from tests.support.engines import make_engine
from tests.support.hf import prompts

transformers = pytest.importorskip("transformers")
gemma4 = pytest.importorskip("transformers.models.gemma4")

S, F = "sliding_attention", "full_attention"
WINDOW = 8
TINY_TEXT = dict(
    vocab_size=256,
    vocab_size_per_layer_input=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=16,
    global_head_dim=32,
    sliding_window=WINDOW,
    # shared layers 4 (sliding) and 5 (full) read the KV of layers 3 and 2
    layer_types=[S, S, F, S, S, F],
    num_kv_shared_layers=2,
    hidden_size_per_layer_input=8,
    use_double_wide_mlp=True,
    final_logit_softcapping=30.0,
    max_position_embeddings=512,
    rope_parameters={
        S: {"rope_type": "default", "rope_theta": 10_000.0},
        F: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
    },
)
# the larger checkpoints' attention: k is v on full layers, with 2 KV heads there
K_EQ_V_TEXT = {
    **TINY_TEXT,
    "attention_k_eq_v": True,
    "num_global_key_value_heads": 2,
    "use_double_wide_mlp": False,
}
# as the 31B: no per-layer inputs, no KV sharing
DENSE_TEXT = {**K_EQ_V_TEXT, "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0}
# the MoE block of the 26B-A4B (8 experts, top-2) on every layer, KV-shared ones included
MOE_TEXT = {
    **K_EQ_V_TEXT,
    "enable_moe_block": True,
    "num_experts": 8,
    "top_k_experts": 2,
    "moe_intermediate_size": 24,
}
TINY_VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=16,
)


def _randomize(model) -> None:
    """HF ones-inits norms, layer scalars and router scales: randomize them too (as support/hf.py
    does); spread the routers' scores so that top-k is decided by margins, not by noise."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("router.scale"):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("router.per_expert_scale"):
                p.copy_(0.5 + torch.rand_like(p))
            elif name.endswith("router.proj.weight"):
                p.normal_(0.0, 4.0)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.8 + 0.4 * torch.rand_like(b))


def make_hf_gemma4(kind: str, seed: int = 0):
    """``text``: Gemma4ForCausalLM (E2B-like); ``dense``: Gemma4ForCausalLM as the 31B;
    ``moe``: Gemma4ForCausalLM with the MoE block; ``multimodal``:
    Gemma4ForConditionalGeneration with a vision tower and the k-is-v text model (its
    checkpoint names ``model.language_model.*``)."""
    torch.manual_seed(seed)
    if kind in ("text", "dense", "moe"):
        text = {"text": TINY_TEXT, "dense": DENSE_TEXT, "moe": MOE_TEXT}[kind]
        model = gemma4.Gemma4ForCausalLM(gemma4.Gemma4TextConfig(**text))
    else:
        config = gemma4.Gemma4Config(
            text_config=K_EQ_V_TEXT, vision_config=TINY_VISION, audio_config=None
        )
        model = gemma4.Gemma4ForConditionalGeneration(config)
    model = model.eval().float()
    _randomize(model)
    return model


# ---- on the GPU ----
def gpu_engine(path, graphs: bool, **kw):
    return make_engine(
        path, device="cuda", chunked_prefill_size=128, max_running_requests=32,
        cuda_graph_max_bs=16, cuda_graph_bs_prefill=[16, 32, 64, 128],
        disable_cuda_graph=not graphs,
        cuda_graph_backend_prefill="breakable" if graphs else "disabled", **kw,
    )  # fmt: skip


def workload(eng):
    sp = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
    ps = prompts(6, [1, 16, 17, 40, 100, 300], seed=5)  # 300: chunked; > window everywhere
    out = [r.output_ids for r in eng.generate(ps, sp)]
    out += [r.output_ids for r in eng.generate([ps[3] + [7, 8], ps[4][:50]], sp)]  # prefix hits
    out += [r.output_ids for r in eng.generate(prompts(20, [9] * 20, seed=6), sp)]  # 20 > 16 rows
    return out
