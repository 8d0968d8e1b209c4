"""MoE models beyond the HF-parity steps (those run in test_models_hf.py for Qwen3-MoE and
test_gemma4.py for Gemma 4's MoE block): both checkpoint layouts of the experts, which
layers are sparse, and the built-in configs."""

from __future__ import annotations

import json
import re

import pytest
import torch

from breakgraph.models.config import ModelConfig
from breakgraph.models.gemma4_config import gemma4_layers
from breakgraph.models.loader import build_model
from breakgraph.models.qwen3_moe import Qwen3MoeSparseMoeBlock
from breakgraph.models.sources import CONFIG_DIR
from tests.support.engines import make_engine
from tests.support.hf import ATOL, LogitsTap, hf_logits, make_hf_model, one_token, prompts

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


def save_checkpoint(path, hf, tensors: dict[str, torch.Tensor]) -> None:
    """``tensors`` under HF's config of ``hf``, as one safetensors file (a tied head once)."""
    path.mkdir(parents=True, exist_ok=True)
    config = {**hf.config.to_dict(), "architectures": [type(hf).__name__]}
    (path / "config.json").write_text(json.dumps(config))
    tied = hf.config.tie_word_embeddings
    tensors = {
        k: v.contiguous() for k, v in tensors.items() if not (tied and k == "lm_head.weight")
    }
    safetensors_torch.save_file(tensors, str(path / "model.safetensors"))


def assert_engine_matches_hf(path, hf) -> None:
    engine = make_engine(path)
    tap = LogitsTap(engine)
    ps = prompts(3, [29, 4, 50])
    engine.generate(ps, one_token())
    for row, p in enumerate(ps):
        torch.testing.assert_close(tap.steps[0][row], hf_logits(hf, p)[-1], atol=ATOL, rtol=1e-4)


def test_qwen3_moe_loads_the_stacked_layout(tmp_path):
    """HF 5's in-memory names (``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj``)."""
    hf = make_hf_model("qwen3_moe")
    state = hf.state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_checkpoint(tmp_path, hf, state)
    assert_engine_matches_hf(tmp_path, hf)


def test_gemma4_moe_loads_per_expert_tensors(tmp_path):
    """Gemma 4's experts split as HF splits Qwen3-MoE's (``experts.{e}.gate_proj.weight``)."""
    from tests.support.gemma4 import make_hf_gemma4

    hf = make_hf_gemma4("moe")
    tensors = {}
    for name, t in hf.state_dict().items():
        m = re.fullmatch(r"(.+\.experts)\.(gate_up_proj|down_proj)", name)
        if m is None:
            tensors[name] = t
            continue
        for e in range(t.shape[0]):
            if m[2] == "down_proj":
                tensors[f"{m[1]}.{e}.down_proj.weight"] = t[e]
            else:
                gate, up = t[e].chunk(2)
                tensors[f"{m[1]}.{e}.gate_proj.weight"] = gate
                tensors[f"{m[1]}.{e}.up_proj.weight"] = up
    assert "model.layers.0.experts.3.up_proj.weight" in tensors
    save_checkpoint(tmp_path, hf, tensors)
    assert_engine_matches_hf(tmp_path, hf)


def test_a_checkpoint_missing_an_expert_is_refused(tmp_path):
    hf = make_hf_model("qwen3_moe")
    hf.save_pretrained(tmp_path / "full")
    tensors = safetensors_torch.load_file(str(tmp_path / "full" / "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_checkpoint(tmp_path / "partial", hf, tensors)
    with pytest.raises(ValueError, match="layers.2.mlp.experts.gate_up_proj"):
        make_engine(tmp_path / "partial")


@pytest.mark.parametrize(
    ("step", "mlp_only", "norm"),
    [(1, [], False), (2, [], True), (1, [0, 3], True), (3, [2], False)],
)
def test_qwen3_moe_sparse_layers_and_routing_follow_hf(step, mlp_only, norm):
    """Which layers are sparse (decoder_sparse_step, mlp_only_layers) and the router's
    norm_topk_prob, as HF decides them; the layer's output equals HF's."""
    cfg = transformers.Qwen3MoeConfig(
        hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=6,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=64,
        num_experts=6, num_experts_per_tok=2, decoder_sparse_step=step,
        mlp_only_layers=mlp_only, norm_topk_prob=norm,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(cfg).eval()
    config = ModelConfig.from_dict({**cfg.to_dict(), "architectures": ["Qwen3MoeForCausalLM"]})
    ours = build_model(config, torch.float32, torch.device("cpu"))
    ours.load_weights(hf.state_dict().items())
    x = torch.randn(11, 32)
    for hf_layer, layer in zip(hf.model.layers, ours.model.layers, strict=True):
        sparse = type(hf_layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock"
        assert isinstance(layer.mlp, Qwen3MoeSparseMoeBlock) == sparse
        with torch.no_grad():
            torch.testing.assert_close(layer.mlp(x), hf_layer.mlp(x[None])[0], atol=1e-5, rtol=1e-4)


def _params(model, experts_fraction: float = 1.0) -> float:
    """Parameters in billions; experts counted at ``experts_fraction`` (active share)."""
    total = 0
    for name, p in model.named_parameters():
        share = experts_fraction if ".experts." in name else 1.0
        total += p.numel() * share
    return total / 1e9  # a tied LM head is the embedding: named_parameters lists it once


def test_builtin_qwen3_30b_a3b():
    config = ModelConfig.from_file(CONFIG_DIR / "qwen3-30b-a3b.json")
    model = build_model(config, torch.bfloat16, torch.device("meta"))
    layers = model.model.layers
    assert len(layers) == 48 and all(isinstance(la.mlp, Qwen3MoeSparseMoeBlock) for la in layers)
    moe = layers[0].mlp
    assert moe.experts.gate_up_proj.shape == (128, 2 * 768, 2048)
    assert moe.gate.top_k == 8 and moe.gate.norm_topk_prob
    attn = layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim) == (32, 4, 128)
    assert config.vocab_size == 151936 and config.rope_theta == 1e6
    assert 30.0 < _params(model) < 31.0  # "30.5B total"
    assert 3.2 < _params(model, 8 / 128) < 3.4  # "3.3B activated"


def test_builtin_gemma_4_26b_a4b():
    gemma4 = pytest.importorskip("transformers.models.gemma4")
    config = ModelConfig.from_file(CONFIG_DIR / "gemma-4-26b-a4b.json")
    specs = gemma4_layers(config)
    assert len(specs) == 30
    for i, s in enumerate(specs):
        full = (i + 1) % 6 == 0
        assert (s.head_dim, s.num_kv_heads, s.sliding_window, s.k_eq_v) == (
            (512, 2, None, True) if full else (256, 8, 1024, False)
        )
        assert not s.shares_kv
    fields = {k: v for k, v in config.raw.items() if k not in ("architectures", "torch_dtype")}
    hf = gemma4.Gemma4TextConfig(**fields)
    assert [(c.head_dim, c.num_key_value_heads) for c in hf.per_layer_config] == [
        (s.head_dim, s.num_kv_heads) for s in specs
    ]
    model = build_model(config, torch.bfloat16, torch.device("meta"))
    layer = model.model.layers[0]
    assert layer.experts.gate_up_proj.shape == (128, 2 * 704, 2816)
    assert layer.experts.activation == "gelu_tanh" and layer.router.top_k == 8
    assert layer.mlp.intermediate_size == 2112
    assert 25.0 < _params(model) < 25.5  # "25.2B total"
    assert 3.7 < _params(model, 8 / 128) < 4.0  # "3.8B active"
