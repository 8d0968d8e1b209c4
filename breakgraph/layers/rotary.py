"""Rotary position embedding (rotate_half form, as HF): default, Llama-3, linear and
Gemma 4's proportional frequencies."""

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


def _proportional_inv_freq(head_dim: int, base: float, scaling: dict) -> torch.Tensor:
    """Gemma 4's full layers: the first ``partial_rotary_factor`` of the angles rotate at the
    frequencies of the whole head_dim, the rest not at all (frequency 0)."""
    rope_angles = int(scaling.get("partial_rotary_factor", 1.0) * head_dim // 2)
    exponent = torch.arange(0, 2 * rope_angles, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (base**exponent)
    nope_angles = head_dim // 2 - rope_angles
    if nope_angles > 0:
        inv_freq = torch.cat((inv_freq, torch.zeros(nope_angles, dtype=torch.float32)))
    return inv_freq / scaling.get("factor", 1.0)


def rope_inv_freq(head_dim: int, base: float, rope_scaling: dict | None = None) -> torch.Tensor:
    """float32 [head_dim / 2] inverse frequencies, as HF's ROPE_INIT_FUNCTIONS compute them."""
    kind = (rope_scaling or {}).get("rope_type", "default")
    if kind == "proportional":
        return _proportional_inv_freq(head_dim, base, rope_scaling)
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (base**exponent)
    if kind == "default":
        return inv_freq
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling)
    if kind == "linear":
        return inv_freq / rope_scaling["factor"]
    raise NotImplementedError(f"rope_scaling type {kind!r} is not supported")


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
        inv_freq = rope_inv_freq(head_dim, base, rope_scaling)
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
