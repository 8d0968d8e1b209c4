"""Inputs the attention kernel tests share: paged KV caches with scattered slots."""

from __future__ import annotations

from dataclasses import replace

import torch

from breakgraph.kernels.attention_meta import AttentionMeta


def paged_batch(
    prefix_extend, num_kv_heads, head_dim, dtype, device, pad_rows=3, seed=0, host=False
):
    """Caches with random content, each request's tokens on scattered slots (never slot 0).

    Returns ``(k_cache, v_cache, meta, rows)``: ``meta`` with the exact ``max_extend_len``
    and no ``max_seq_len`` bound (one-pass extend), ``rows`` the query rows with padding.
    ``host``: ``meta`` also has the exact ``max_seq_len`` and the host lengths, as an
    engine's extend step has them.
    """
    g = torch.Generator().manual_seed(seed)
    total = sum(p + e for p, e in prefix_extend)
    num_slots = total + 64
    batch = len(prefix_extend)
    max_context = max(p + e for p, e in prefix_extend) + 16
    slots = torch.randperm(num_slots - 1, generator=g)[:total] + 1
    req_to_token = torch.zeros(batch + 3, max_context, dtype=torch.int32)
    pool_rows = torch.randperm(batch + 3, generator=g)[:batch]
    at = 0
    for row, (p, e) in zip(pool_rows.tolist(), prefix_extend, strict=True):
        req_to_token[row, : p + e] = slots[at : at + p + e].int()
        at += p + e
    shape = (num_slots, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    extend_lens = torch.tensor([e for _, e in prefix_extend], dtype=torch.int32)
    seq_lens = torch.tensor([p + e for p, e in prefix_extend], dtype=torch.int32)
    starts = torch.cumsum(extend_lens, 0, dtype=torch.int32) - extend_lens
    meta = AttentionMeta(
        *(t.to(device) for t in (req_to_token, pool_rows.long(), seq_lens, starts, extend_lens)),
        max_extend_len=max(e for _, e in prefix_extend),
    )
    if host:
        meta = replace(
            meta, max_seq_len=max(seq_lens.tolist()), extend_lens_cpu=extend_lens.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
        )  # fmt: skip
    return k_cache.to(device), v_cache.to(device), meta, int(extend_lens.sum()) + pad_rows
