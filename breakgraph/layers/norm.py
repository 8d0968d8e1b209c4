"""RMSNorm, optionally fused with the residual add (HF: ``residual + hidden_states`` then norm)."""

from __future__ import annotations

import torch
from torch import nn

from breakgraph.kernels import ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, reduce=None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual).
        ``reduce``: x is this rank's partial sum, all-reduced over that TP group first (in
        the norm's kernel where it can: ``TPGroup.all_reduce_add_rms_norm``)."""
        if reduce is not None:
            return reduce.all_reduce_add_rms_norm(x, residual, self.weight, self.variance_epsilon)
        if residual is None:
            return ops.rms_norm(x, self.weight, self.variance_epsilon)
        return ops.fused_add_rms_norm(x, residual, self.weight, self.variance_epsilon)

    def project(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        linear: nn.Module,
        activation: str | None = None,
        reduce=None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``linear(self(x + residual))`` (x alone without a residual; with ``activation``,
        gate/up's act-and-mul after ``linear``) and the new residual (x without one): the norm
        as the projection's prologue, one kernel where decode's few rows take the skinny
        GEMM (``ops.norm_linear``). ``linear``: a layer computing ``x W^T + b`` on this rank
        (column-parallel, or replicated). ``reduce``: as in ``forward`` (then the norm and
        the all-reduce are one kernel, the projection another)."""
        if reduce is not None:
            h, residual = self(x, residual, reduce)
            if activation is not None:
                return ops.linear_act_and_mul(h, linear.weight, activation), residual
            return ops.linear(h, linear.weight, linear.bias), residual
        return ops.norm_linear(
            x, residual, self.weight, self.variance_epsilon, linear.weight, linear.bias, activation
        )


class GemmaRMSNorm(nn.Module):
    """Gemma 4's RMSNorm (HF ``Gemma4RMSNorm``): normalized and scaled by ``weight`` in
    float32, cast back once at the end; ``with_scale=False`` has no weight (the v norm)."""

    def __init__(self, dim: int, eps: float = 1e-6, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.gemma_rms_norm(x, self.weight, self.eps)

    def forward_add(
        self, x: torch.Tensor, residual: torch.Tensor, scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``residual + self(x)`` (times the one-element ``scale`` if given) in one kernel:
        Gemma's norms follow their sublayer, and the residual add follows the norm."""
        return ops.gemma_rms_norm(x, self.weight, self.eps, residual, scale)
