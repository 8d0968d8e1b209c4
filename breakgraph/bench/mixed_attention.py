"""``bench kernels --mixed``: a mixed step's attention (prefill requests, then the running
requests' decode rows, one query row each) as the engine plans it, the one-row requests on
the decode kernel (``ops.plan_extend_attention``), against the whole step in one extend
launch, where each one-row request takes a query tile of its own over all of its keys.

Cases at Llama-3.1-8B's heads (32/8, d128): an 8K prefill beside 1-128 decode rows of 4K
and 8K keys; and Gemma 4's (8/1 d512, 16/8 d256 with a 512 window) with only one-row requests
(its KV-shared tail: each request's last row over its context) and beside a 2K prefill.
"""

from __future__ import annotations

from dataclasses import replace

import torch

# (prefill tokens, one-row requests, keys of each, query heads, kv heads, head size, window)
CASES = [
    *((8192, n, keys, 32, 8, 128, None) for n, keys in
      ((1, 8192), (4, 8192), (16, 4096), (64, 4096), (128, 4096))),
    *((prefill, n, keys, 8, 1, 512, None) for prefill in (0, 2048) for n, keys in
      ((1, 8192), (8, 8192), (32, 2048))),
    *((prefill, n, keys, 16, 8, 256, 512) for prefill in (0, 2048) for n, keys in
      ((1, 8192), (8, 8192), (32, 2048))),
]  # fmt: skip


def bench_mixed(bench_ms, paged_kv) -> list[tuple]:
    """Rows ``(kernel, shape, ms, reference, ref ms)``: the engine's plan against one
    extend launch; their outputs compared first (printed)."""
    from breakgraph.kernels import ops

    rows = []
    for prefill, n, keys, heads, kv_heads, head_dim, window in CASES:
        seqs = ([prefill] if prefill else []) + [keys] * n
        lens = ([prefill] if prefill else []) + [1] * n
        k_cache, v_cache, meta = paged_kv(seqs, True, kv_heads=kv_heads, head_dim=head_dim)
        ext = torch.tensor(lens, dtype=torch.int32, device=k_cache.device)
        meta = replace(
            meta, extend_start_loc=torch.cumsum(ext, 0, dtype=torch.int32) - ext,
            extend_lens=ext, max_extend_len=max(lens), max_seq_len=max(seqs),
            extend_lens_cpu=lens, seq_lens_cpu=seqs,
        )  # fmt: skip
        q = torch.randn(sum(lens), heads, head_dim, device=k_cache.device, dtype=k_cache.dtype)
        o, o_one = torch.empty_like(q), torch.empty_like(q)
        scale = head_dim**-0.5
        plan = ops.plan_extend_attention(q, k_cache, meta, scale, sliding_window=window)
        one = ops.plan_extend_attention(
            q, k_cache, meta, scale, sliding_window=window, decode_rows=False
        )
        plan(q, o, k_cache, v_cache)
        one(q, o_one, k_cache, v_cache)
        diff = (o.float() - o_one.float()).abs().max().item()
        shape = (f"{prefill} new + {n} x 1 over {keys}, {heads}/{kv_heads} d{head_dim}"
                 + (f" w{window}" if window else ""))  # fmt: skip
        print(f"  {shape}: |plan - one launch| max {diff:.1e}")
        kv = (k_cache, v_cache)
        ms = bench_ms(lambda p=plan, q=q, o=o, kv=kv: p(q, o, *kv))
        ref_ms = bench_ms(lambda p=one, q=q, o=o_one, kv=kv: p(q, o, *kv))
        rows.append(("mixed step attention", shape, ms, "one extend launch", ref_ms))
        del k_cache, v_cache, kv, q, o, o_one, plan, one
    return rows
