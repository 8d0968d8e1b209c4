"""Extend (prefill) attention over the paged KV: cached prefix plus the new tokens, causal, GQA."""

from __future__ import annotations

import torch


def extend_attention_torch(
    q: torch.Tensor,
    o: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    extend_lens: torch.Tensor,
    sm_scale: float,
    max_extend_len: int,
) -> None:
    """Reference twin. q/o [T, H, D]; the new tokens' k/v are already stored in the cache.

    Request r's query rows ``extend_start_loc[r] : +extend_lens[r]`` sit at positions
    ``seq_lens[r] - extend_lens[r] + i``; its keys are ``req_to_token[req, :seq_lens[r]]``.
    Row i sees keys 0 .. prefix + i. Accumulates in float32.
    """
    del max_extend_len  # a launch-size hint for the Triton kernel
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
    group = num_heads // num_kv_heads
    for req, seq_len, start, ext in zip(
        req_pool_indices.tolist(),
        seq_lens.tolist(),
        extend_start_loc.tolist(),
        extend_lens.tolist(),
        strict=True,
    ):
        if ext == 0:
            continue
        slots = req_to_token[req, :seq_len].long()
        k = k_cache[slots].float().repeat_interleave(group, dim=1)  # [S, H, D]
        v = v_cache[slots].float().repeat_interleave(group, dim=1)
        qr = q[start : start + ext].float()  # [E, H, D]
        scores = torch.einsum("ehd,shd->hes", qr, k) * sm_scale
        prefix = seq_len - ext
        q_pos = torch.arange(ext, device=q.device)[:, None] + prefix
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        scores.masked_fill_((k_pos > q_pos)[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o[start : start + ext] = torch.einsum("hes,shd->ehd", probs, v).to(o.dtype)
