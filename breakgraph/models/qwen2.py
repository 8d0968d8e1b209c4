"""Qwen2: the Llama architecture with q/k/v biases (set by ModelConfig.attention_bias)."""

from __future__ import annotations

from breakgraph.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass
