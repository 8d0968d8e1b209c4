"""GGUF loading: the embedded SmolLM2 file against transformers' own GGUF loader, plus a synthetic
llama file with an untied head and several tensor types."""

import importlib.metadata
import importlib.util

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from breakgraph.models import gguf_loader
from breakgraph.models.gguf_loader import (
    EMBEDDED_INSTALL,
    EmbeddedModelMissing,
    find_embedded_gguf,
    load_gguf,
)


@pytest.fixture(scope="module")
def gguf_path():
    try:
        return find_embedded_gguf()
    except EmbeddedModelMissing as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def ours(gguf_path):
    return load_gguf(gguf_path)


@pytest.fixture(scope="module")
def hf_model(gguf_path):
    """Transformers' LlamaForCausalLM loaded from the same GGUF file (local, no hub)."""
    transformers = pytest.importorskip("transformers")
    kwargs = {"gguf_file": gguf_path.name}
    if importlib.util.find_spec("accelerate") is not None:
        return transformers.AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, dtype=torch.float32, **kwargs
        )
    # from_pretrained(gguf_file=...) insists on accelerate; this is the same conversion it runs.
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(gguf_path.parent, **kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)
    model.load_state_dict(tensors["tensors"], strict=False)
    model.tie_weights()
    return model


def test_state_dict_equals_transformers(ours, hf_model):
    expected = hf_model.state_dict()
    if hf_model.config.tie_word_embeddings:
        expected.pop("lm_head.weight")  # the tied head is the embedding, not a separate tensor
    assert sorted(ours.state_dict) == sorted(expected)
    for name, tensor in expected.items():
        assert ours.state_dict[name].dtype == torch.float32
        assert torch.equal(ours.state_dict[name], tensor), name


def test_hf_config_matches_transformers(ours, hf_model):
    cfg, hf = ours.hf_config, hf_model.config
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "num_hidden_layers",
        "head_dim",
        "vocab_size",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert cfg[key] == getattr(hf, key), key
    rope_theta = getattr(hf, "rope_parameters", None) or {"rope_theta": hf.rope_theta}
    assert cfg["rope_theta"] == rope_theta["rope_theta"]
    assert cfg["rms_norm_eps"] == pytest.approx(hf.rms_norm_eps, rel=1e-6)
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert cfg["rope_scaling"] is None
    assert cfg["rms_norm_eps"] == 1e-5  # float32 metadata read back in its shortest form


def test_embedded_model_loads_its_tokenizer(ours):
    assert ours.tokenizer.eos_token_ids == {ours.hf_config["eos_token_id"]}
    assert ours.tokenizer.has_chat_template


def test_missing_package_names_the_install_command(monkeypatch):
    def no_distribution(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(importlib.metadata, "distribution", no_distribution)
    with pytest.raises(EmbeddedModelMissing) as info:
        find_embedded_gguf()
    message = str(info.value)
    assert EMBEDDED_INSTALL in message and "\n" not in message
    assert isinstance(info.value, RuntimeError)


# --- a synthetic llama GGUF: untied head, F32/F16/Q8_0 tensors, llama.cpp's q/k permutation ---

_HIDDEN, _HEADS, _KV_HEADS, _FFN, _LAYERS = 64, 4, 2, 96, 2
_HEAD_DIM = _HIDDEN // _HEADS


def _llama_cpp_permute(weights, n_head, n_head_kv=None):
    """convert_hf_to_gguf.py's LlamaModel.permute: HF rotate_half rows -> interleaved pairs."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _byte_level_vocab():
    """GPT-2's byte-to-unicode alphabet, two control tokens first."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = [b for b in range(256) if b not in printable]
    chars = [chr(b) for b in printable] + [chr(256 + i) for i in range(len(extra))]
    return ["<s>", "</s>", *chars, "Ġt", "he", "Ġthe"], ["Ġ t", "h e", "Ġt he"]


def _write_tiny_llama(path, rng):
    tokens, merges = _byte_level_vocab()
    vocab = len(tokens)
    hf = {
        "model.embed_tokens.weight": rng.standard_normal((vocab, _HIDDEN)),
        "model.norm.weight": rng.standard_normal(_HIDDEN),
        "lm_head.weight": rng.standard_normal((vocab, _HIDDEN)),
    }
    for i in range(_LAYERS):
        p = f"model.layers.{i}."
        hf[p + "input_layernorm.weight"] = rng.standard_normal(_HIDDEN)
        hf[p + "post_attention_layernorm.weight"] = rng.standard_normal(_HIDDEN)
        hf[p + "self_attn.q_proj.weight"] = rng.standard_normal((_HIDDEN, _HIDDEN))
        hf[p + "self_attn.k_proj.weight"] = rng.standard_normal((_KV_HEADS * _HEAD_DIM, _HIDDEN))
        hf[p + "self_attn.v_proj.weight"] = rng.standard_normal((_KV_HEADS * _HEAD_DIM, _HIDDEN))
        hf[p + "self_attn.o_proj.weight"] = rng.standard_normal((_HIDDEN, _HIDDEN))
        hf[p + "mlp.gate_proj.weight"] = rng.standard_normal((_FFN, _HIDDEN))
        hf[p + "mlp.up_proj.weight"] = rng.standard_normal((_FFN, _HIDDEN))
        hf[p + "mlp.down_proj.weight"] = rng.standard_normal((_HIDDEN, _FFN))
    hf = {k: v.astype(np.float32) for k, v in hf.items()}

    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(_LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(_HIDDEN)
    writer.add_feed_forward_length(_FFN)
    writer.add_head_count(_HEADS)
    writer.add_head_count_kv(_KV_HEADS)
    writer.add_rope_dimension_count(_HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(500000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3] + [1] * (vocab - 2))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(True)

    gguf_names = {v: k for k, v in gguf_loader._GLOBAL_NAMES.items()}
    for name, weight in hf.items():
        if name in gguf_names:
            gguf_name = gguf_names[name]
        else:
            _, _, layer, *rest = name.split(".")
            kind = {v: k for k, v in gguf_loader._BLOCK_NAMES.items()}[".".join(rest[:-1])]
            gguf_name = f"blk.{layer}.{kind}.weight"
        if "q_proj" in name:
            weight = _llama_cpp_permute(weight, _HEADS, _HEADS)
        elif "k_proj" in name:
            weight = _llama_cpp_permute(weight, _HEADS, _KV_HEADS)
        if weight.ndim == 1:
            writer.add_tensor(gguf_name, weight)
        elif "mlp" in name:
            qtype = GGMLQuantizationType.Q8_0
            writer.add_tensor(gguf_name, quantize(weight, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, weight.astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


def test_synthetic_llama_gguf_round_trips(tmp_path):
    path = tmp_path / "tiny-llama.gguf"
    hf = _write_tiny_llama(path, np.random.default_rng(0))
    model = load_gguf(path, dtype=torch.bfloat16)

    assert sorted(model.state_dict) == sorted(hf)
    for name, expected in hf.items():
        got = model.state_dict[name]
        assert got.dtype == torch.bfloat16 and tuple(got.shape) == expected.shape, name
        # Q8_0 keeps ~1% per element, F16/bf16 ~0.4%; a wrong row permutation is off by O(1).
        tol = 0.05 if "mlp" in name else 0.02
        torch.testing.assert_close(got.float(), torch.from_numpy(expected), atol=tol, rtol=tol)

    cfg = model.hf_config
    assert cfg["tie_word_embeddings"] is False
    assert (cfg["num_key_value_heads"], cfg["head_dim"], cfg["vocab_size"]) == (2, 16, 261)
    assert (cfg["rope_theta"], cfg["rms_norm_eps"], cfg["rope_scaling"]) == (500000.0, 1e-6, None)
    tok = model.tokenizer
    ids = [tok.token_to_id(t) for t in ("<s>", "t", "he", "Ġthe")]
    assert tok.encode("the the", add_special_tokens=True) == ids  # add_bos_token, then merges
    assert tok.decode(ids) == "the the"


def test_non_llama_architecture_is_refused(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(NotImplementedError, match="architecture 'gpt2'"):
        load_gguf(path)
