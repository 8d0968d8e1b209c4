"""Model classes by HF architecture name."""

from __future__ import annotations

from torch import nn

from breakgraph.models.deepseek_v4 import DeepseekV4ForCausalLM
from breakgraph.models.gemma4 import Gemma4ForCausalLM
from breakgraph.models.gemma4_config import gemma4_layers
from breakgraph.models.llama import LlamaForCausalLM
from breakgraph.models.qwen2 import Qwen2ForCausalLM
from breakgraph.models.qwen3 import Qwen3ForCausalLM
from breakgraph.models.qwen3_moe import Qwen3MoeForCausalLM, is_sparse_layer

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "DeepseekV4ForCausalLM": DeepseekV4ForCausalLM,
    "Gemma4ForCausalLM": Gemma4ForCausalLM,
    "Gemma4ForConditionalGeneration": Gemma4ForCausalLM,  # its text model
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def check_tp_support(config, tp_size: int) -> None:
    """Raise a one-line error if ``config``'s model cannot run at ``tp_size`` (every family
    in the registry shards; what remains to check is that the sizes divide)."""
    if tp_size < 1:
        raise ValueError(f"--tp-size must be >= 1, got {tp_size}")
    if tp_size == 1:
        return
    get_model_class(config.architecture)  # an unknown one fails here, before any spawn
    heads = config.num_attention_heads
    if heads % tp_size:
        raise ValueError(f"--tp-size {tp_size} does not divide the {heads} attention heads")
    if config.architecture == "DeepseekV4ForCausalLM":
        _check_v4_tp(config, tp_size)
        return
    if config.architecture.startswith("Gemma4"):
        # per layer type: KV heads and (double-wide on shared layers) MLP widths differ
        layers = gemma4_layers(config)
        kv_heads = sorted({layer.num_kv_heads for layer in layers})
        inters = sorted({layer.intermediate_size for layer in layers})
        moe_layers = config.num_hidden_layers if config.raw.get("enable_moe_block") else 0
    else:
        kv_heads, inters = [config.num_key_value_heads], [config.intermediate_size]
        moe_layers = 0
        if config.architecture == "Qwen3MoeForCausalLM":
            moe_layers = sum(is_sparse_layer(config, i) for i in range(config.num_hidden_layers))
            if moe_layers == config.num_hidden_layers:
                inters = []  # no dense MLP
    for kv in kv_heads:
        if kv % tp_size and tp_size % kv:
            raise ValueError(
                f"--tp-size {tp_size} neither divides the {kv} KV heads nor is a multiple of them"
            )
    moe_inter = config.raw.get("moe_intermediate_size")
    if moe_layers and moe_inter % tp_size:
        raise ValueError(
            f"--tp-size {tp_size} does not divide the MoE intermediate size {moe_inter}"
        )
    for inter in inters:
        if inter % tp_size:
            raise ValueError(f"--tp-size {tp_size} does not divide the intermediate size {inter}")


def _check_v4_tp(config, tp_size: int) -> None:
    """DeepSeek V4 splits query heads by whole output groups, the indexer heads, and the
    experts' and shared expert's intermediate size (its one KV head is replicated)."""
    raw = config.raw
    for what, n in (
        ("output groups (o_groups)", raw["o_groups"]),
        ("indexer heads", raw["index_n_heads"]),
        ("MoE intermediate size", raw["moe_intermediate_size"]),
    ):
        if n % tp_size:
            raise ValueError(f"--tp-size {tp_size} does not divide the {n} {what}")


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        known = ", ".join(sorted(MODEL_REGISTRY))
        raise ValueError(
            f"unsupported architecture {architecture!r} (supported: {known})"
        ) from None
