"""``bench kernels --decode-sweep``: decode attention at long context as a decode graph runs
it, against the bandwidth its KV reads need.

A decode step's attention kernels replay inside a graph, back to back with the rest of the
layer, each reading its layer's KV once from HBM. Timed one call at a time (``do_bench``) a
small case measures its launches, not the kernel (two launches and the Python around them
outlast 32 MiB of KV read at 4.8 TB/s), and a case whose KV fits the L2 cache measures the
cache. So the sweep times the calls captured in one CUDA graph (``do_bench_cudagraph``) and
rotates over enough copies of the KV that each call reads from HBM, as a layer does after the
others' weights went through the cache. The reference is the floor: the KV bytes over the
device-to-device copy bandwidth measured in the same run; ``floor / ms`` is the share of that
bandwidth the kernel reaches (#56's goal: 80% at 8K-64K keys, batch 1-64). The capture is
a decode graph's of that batch (``pdl.scope``): under ``BREAKGRAPH_PDL=auto`` the small
batches' kernels launch with programmatic dependent launch, as the engine's graphs do.
"""

from __future__ import annotations

import itertools
import math

import torch

from breakgraph.kernels import decode_attention as dec
from breakgraph.kernels import pdl

L2_COPIES = 4  # KV copies span at least this many L2 caches: each call's reads miss it


def bench_decode_sweep(
    batches: list[int], contexts: list[int], paged_kv, bandwidth: float, heads: int
) -> list[tuple]:
    """Rows ``(kernel, shape, ms, "bandwidth floor", floor ms)`` per context and batch; the
    batch-1 rows also in the long-context variant (the batch-1 graph over long contexts).
    ``paged_kv(lens, shuffle)`` -> (k cache, v cache, decode meta): ``bench kernels``' KV;
    ``bandwidth``: its copy bandwidth, bytes per ms; ``heads``: query heads."""
    import triton.testing

    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    rows = []
    for context in contexts:
        for batch in batches:
            k_cache, v_cache, meta = paged_kv([context] * batch, shuffle=False)
            head_dim = k_cache.shape[-1]
            kv_bytes = 2 * batch * context * k_cache[0].numel() * k_cache.element_size()
            copies = max(1, math.ceil(L2_COPIES * l2 / kv_bytes))
            caches = [(k_cache, v_cache)]
            caches += [(k_cache.clone(), v_cache.clone()) for _ in range(copies - 1)]
            q = torch.randn(batch, heads, head_dim, device="cuda", dtype=k_cache.dtype)
            o = torch.empty_like(q)
            calls = itertools.count()

            def attend(caches=caches, q=q, o=o, meta=meta, calls=calls) -> None:
                k, v = caches[next(calls) % len(caches)]  # a capture bakes each call's copy
                dec.decode_attention_triton(q, o, k, v, meta, q.shape[-1] ** -0.5)

            shape = f"{batch} x {context} ctx, {copies} KV copies"
            floor = kv_bytes / bandwidth
            with pdl.scope(batch):
                ms = triton.testing.do_bench_cudagraph(attend, rep=50, return_mode="median")
                rows.append(("decode attention (graph)", shape, ms, "bandwidth floor", floor))
                if batch == 1:
                    with dec.long_context():
                        ms = triton.testing.do_bench_cudagraph(attend, rep=50, return_mode="median")
                    rows.append(("  long-context variant", shape, ms, "bandwidth floor", floor))
            del caches, k_cache, v_cache
            torch.cuda.empty_cache()
    return rows
