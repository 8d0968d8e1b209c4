"""Kernel dispatch: Triton on CUDA, the torch twins elsewhere.

(Placeholder written by the model author: torch twins only, with HF's arithmetic. The
Triton dispatch and the fused twins' home in kernels/fused.py replace this.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from breakgraph.kernels.decode_attention import decode_attention_torch as decode_attention
from breakgraph.kernels.extend_attention import extend_attention_torch as extend_attention
from breakgraph.kernels.kv_store import store_kv_torch as store_kv

__all__ = [
    "decode_attention",
    "extend_attention",
    "store_kv",
    "rms_norm",
    "fused_add_rms_norm",
    "silu_and_mul",
    "rope",
    "qk_norm_rope",
]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def fused_add_rms_norm(x, residual, weight, eps):
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(q, k, cos, sin):
    cos = cos.to(q.dtype).unsqueeze(1)
    sin = sin.to(q.dtype).unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def qk_norm_rope(q, k, q_weight, k_weight, eps, cos, sin):
    return rope(rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps), cos, sin)
