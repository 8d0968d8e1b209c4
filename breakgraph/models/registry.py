"""Model classes by HF architecture name."""

from __future__ import annotations

from torch import nn

from breakgraph.models.gemma4 import Gemma4ForCausalLM
from breakgraph.models.llama import LlamaForCausalLM
from breakgraph.models.qwen2 import Qwen2ForCausalLM
from breakgraph.models.qwen3 import Qwen3ForCausalLM
from breakgraph.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "Gemma4ForCausalLM": Gemma4ForCausalLM,
    "Gemma4ForConditionalGeneration": Gemma4ForCausalLM,  # its text model
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        known = ", ".join(sorted(MODEL_REGISTRY))
        raise ValueError(
            f"unsupported architecture {architecture!r} (supported: {known})"
        ) from None
