"""Decode attention: one query row per request over its paged KV."""

from __future__ import annotations

import torch

from breakgraph.kernels.extend_attention import extend_attention_torch


def decode_attention_torch(
    q: torch.Tensor,
    o: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
) -> None:
    """Reference twin. q/o [B, H, D]; request b's keys are ``req_to_token[req, :seq_lens[b]]``."""
    batch = q.shape[0]
    ones = torch.ones(batch, dtype=torch.int32, device=q.device)
    starts = torch.arange(batch, dtype=torch.int32, device=q.device)
    extend_attention_torch(
        q, o, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, starts, ones, sm_scale, 1
    )
