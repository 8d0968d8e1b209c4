"""Rotary position embedding (rotate_half form, as HF), with Llama-3 frequency scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from breakgraph.kernels import ops


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context_len = scaling.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Holds a float32 cos/sin cache over all positions; ``forward`` gathers rows by position."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        rope_scaling: dict | None = None,
    ):
        super().__init__()
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (base**exponent)
        if rope_scaling is not None:
            kind = rope_scaling.get("rope_type")
            if kind == "llama3":
                inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
            elif kind == "linear":
                inv_freq = inv_freq / rope_scaling["factor"]
            else:
                raise NotImplementedError(f"rope_scaling type {kind!r} is not supported")
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        self.register_buffer("sin_cache", emb.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos_cache[positions], self.sin_cache[positions]

    def forward(self, positions, q, k):
        """q [T, H, D], k [T, Hkv, D] -> rotated (q, k)."""
        cos, sin = self.cos_sin(positions)
        return ops.rope(q, k, cos, sin)
