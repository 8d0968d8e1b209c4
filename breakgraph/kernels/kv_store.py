"""KV store: write the new tokens' k and v rows into their slots of the paged pool."""

from __future__ import annotations

import torch


def store_kv_torch(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """k_cache/v_cache [num_slots, kv_heads, head_dim]; k/v [T, kv_heads, head_dim]; slots [T].

    Padding rows carry slot 0, which is reserved and never read as real KV.
    """
    k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.to(v_cache.dtype))
