"""Rotary position embedding (rotate_half form, as HF): default, Llama-3, linear, YaRN and
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


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, base: float, scaling: dict):
    """YaRN (arXiv 2309.00071): the high frequencies (more than ``beta_fast`` turns over the
    original context) keep their value, the low ones (under ``beta_slow`` turns) are divided
    by ``factor``, a linear ramp over the dimensions between; HF's arithmetic."""
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def turns_dim(turns: float) -> float:  # the dimension whose wavelength fits ``turns`` times
        return head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = turns_dim(beta_fast), turns_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (the frequency as trained), 0: interpolate (divided)
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def rope_attention_factor(rope_scaling: dict | None) -> float:
    """The factor on cos and sin (YaRN's attention temperature; 1 for the other kinds)."""
    if (rope_scaling or {}).get("rope_type") != "yarn":
        return 1.0
    given = rope_scaling.get("attention_factor")
    if given is not None:
        return float(given)
    factor = rope_scaling["factor"]
    mscale, mscale_all_dim = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return _yarn_mscale(factor)


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
    if kind == "yarn":
        if rope_scaling.get("partial_rotary_factor", 1.0) != 1.0:
            raise NotImplementedError("YaRN rope over part of the head (partial_rotary_factor)")
        return _yarn_inv_freq(inv_freq, head_dim, base, rope_scaling)
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
        scale = rope_attention_factor(rope_scaling)
        self.register_buffer("cos_cache", emb.cos() * scale, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * scale, persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos_cache[positions], self.sin_cache[positions]

    def forward(self, positions, q, k):
        """q [T, H, D], k [T, Hkv, D] -> rotated (q, k)."""
        cos, sin = self.cos_sin(positions)
        return ops.rope(q, k, cos, sin)
