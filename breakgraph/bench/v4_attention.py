"""``bench kernels --v4-attention``: DeepSeek V4's sparse attention and indexer kernels
(kernels/compressed_attention.py) at V4-Flash's shapes, in each launch config of
:data:`CONFIGS` and :data:`INDEXER_CONFIGS`, against the time a dense bf16 GEMM of the same
FLOPs takes on this GPU (measured in the same run); the hyper-connections' mixes
(kernels/hyper_connection.py) in each config of :data:`MIXES_CONFIGS` against torch's float32
copy and GEMM; q's norm and rope (``fused.norm_rope_tail``) per tile size against a copy of
the same bytes.

V4-Flash attends with 64 query heads of 512 over one K = V head: each row its sliding window
of 128 keys and, on a CSA layer (one entry per 4 tokens), the indexer's top 512 entries, on
an HCA layer (one per 128) every entry it may see. The FLOPs counted are the ones the
attention needs (the keys each row may see), so a kernel that computes masked keys or
reloads keys for each block of heads shows it as a ratio above 1.
"""

from __future__ import annotations

import functools

import torch

from breakgraph.kernels import compressed_attention as ca
from breakgraph.kernels import fused
from breakgraph.kernels import hyper_connection as hc

HEADS, HEAD_DIM, WINDOW, TOP_K = 64, 512, 128, 512
# (heads a program, keys a block, warps, stages): compressed_attention's two defaults first
CONFIGS = [
    ca.SPARSE_CONFIG,
    ca.PREFILL_SPARSE_CONFIG,
    (16, 32, 4, 3),
    (32, 32, 8, 3),
    (64, 16, 8, 2),
    (64, 64, 8, 2),
]
INDEX_HEADS, INDEX_DIM = 64, 128
# (heads a tile, entries a program, warps): compressed_attention.INDEXER_CONFIG first
INDEXER_CONFIGS = [ca.INDEXER_CONFIG, (16, 32, 4), (32, 64, 4), (64, 64, 4), (64, 64, 8),
                   (64, 128, 8)]  # fmt: skip

HC_WIDTH, HC_COLS = 4 * 4096, 24  # 4 streams of 4096; (2 + 4) x 4 mixes
# (rows a program, K a step, warps, stages): hyper_connection's default first
MIXES_CONFIGS = [hc.MIXES_CONFIG, (16, 128, 4, 3), (64, 128, 4, 3), (128, 64, 8, 3)]


def v4_step(prefix: int, rows: int, requests: int = 1) -> ca.CompressedStep:
    """``requests`` requests with ``prefix`` cached tokens each and ``rows`` new ones between
    them (one each: a decode step), over shuffled slots."""
    per = rows // requests
    width = prefix + per
    slots = (torch.randperm(requests * width, device="cuda") + 1).view(requests, width)
    pos = torch.arange(prefix, width, device="cuda").repeat(requests)
    return ca.CompressedStep(
        positions=pos,
        row_req=torch.arange(requests, device="cuda").repeat_interleave(per),
        req_rows=torch.arange(requests, device="cuda"),
        start_pos=torch.full((requests,), prefix, device="cuda"),
        end_pos=torch.full((requests,), width, device="cuda"),
        fresh=torch.full((requests,), prefix == 0, device="cuda"),
        req_to_token=slots.to(torch.int32),
        max_extend=per,
        max_seq=width,
    )


def top_k_picks(step: ca.CompressedStep, ratio: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(picks [T, k] as the indexer's top-k yields them, sorted: random scores, -inf for the
    entries a row cannot see yet; each row's count of entries it attends to)."""
    n_entries = max(step.max_seq // ratio, 1)
    visible = (step.positions + 1) // ratio
    scores = torch.rand(step.positions.shape[0], n_entries, device="cuda")
    scores[torch.arange(n_entries, device="cuda")[None, :] >= visible[:, None]] = float("-inf")
    picks = scores.topk(min(TOP_K, n_entries), dim=-1).indices
    return picks, visible.clamp(max=picks.shape[1])


def v4_tensors(step: ca.CompressedStep) -> tuple[torch.Tensor, ...]:
    """Random bf16 (q [T, 64, 512], the window's K = V cache, the compressed entries' cache,
    float32 sinks [64]) over ``step``'s rows and slots."""
    slots = step.req_to_token.numel() + 1
    q = torch.randn(step.positions.shape[0], HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(slots, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    comp = torch.randn(slots, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    return q, kv, comp, torch.randn(HEADS, device="cuda")


def gemm_tflops() -> float:
    """A dense bf16 GEMM's TFLOP/s on this GPU (8192 cubed, median)."""
    import triton.testing

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ a, return_mode="median")
    return 2 * 8192**3 / ms / 1e9


def bench_v4_attention(cases: list[tuple[int, int, int]]) -> list[tuple]:
    """Rows ``(kernel, shape, ms, "dense GEMM, same FLOPs", floor ms)`` for each case
    ``(prefix, new rows, requests)``, layer kind and config."""
    import triton.testing

    tflops = gemm_tflops()
    print(f"dense bf16 GEMM: {tflops:.0f} TFLOP/s")
    rows = []
    for prefix, n, requests in cases:
        step = v4_step(prefix, n, requests)
        q, kv, comp, sinks = v4_tensors(step)
        window_keys = (step.positions + 1).clamp(max=WINDOW)
        picks, csa_keys = top_k_picks(step, 4)
        kinds = (("CSA", 4, picks, csa_keys), ("HCA", 128, None, (step.positions + 1) // 128))
        for kind, ratio, pk, entry_keys in kinds:
            keys = int((window_keys + entry_keys).sum())
            floor = 4 * HEADS * HEAD_DIM * keys / tflops / 1e9
            shape = f"{kind} {requests} x {n // requests} over {prefix}"
            out = torch.empty_like(q)
            args = (q, kv, comp, step, WINDOW, ratio, pk, sinks, HEAD_DIM**-0.5, out)
            auto = ca.sparse_splits(n, HEADS, ca.SPARSE_CONFIG[0], q.device)
            runs = [(c, None) for c in CONFIGS] + ([(ca.SPARSE_CONFIG, 1)] if auto > 1 else [])
            for config, splits in runs:
                attend = functools.partial(
                    ca.sparse_attention_triton, *args, config=config, splits=splits
                )
                try:
                    ms = triton.testing.do_bench(attend, return_mode="median")
                except Exception as e:  # a config this GPU cannot run (shared memory)
                    print(f"{shape} {config}: {type(e).__name__}: {str(e)[:120]}")
                    continue
                used = splits or ca.sparse_splits(n, HEADS, config[0], q.device)
                name = f"sparse attention {config}, {used} split" + "s" * (used > 1)
                rows.append((name, shape, ms, "dense GEMM, same FLOPs", floor))
        rows += bench_indexer(step, tflops)
    return rows


def bench_indexer(step: ca.CompressedStep, tflops: float) -> list[tuple]:
    """The CSA indexer's scores of every entry a row may see (64 heads of 128), per config;
    ``tflops``: the dense GEMM's rate the floor is counted at."""
    import triton.testing

    n = step.positions.shape[0]
    q = torch.randn(n, INDEX_HEADS, INDEX_DIM, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, INDEX_HEADS, device="cuda", dtype=torch.bfloat16)
    keys = torch.randn(step.req_to_token.numel() + 1, INDEX_DIM, device="cuda",
                       dtype=torch.bfloat16)  # fmt: skip
    entries = int(((step.positions + 1) // 4).sum())
    floor = 2 * INDEX_HEADS * INDEX_DIM * entries / tflops / 1e9
    prefix = step.max_seq - step.max_extend
    shape = f"indexer {step.req_rows.shape[0]} x {step.max_extend} over {prefix}"
    rows = []
    for config in INDEXER_CONFIGS:
        fn = functools.partial(
            ca.indexer_scores_triton, q, w, keys, step, 4, INDEX_DIM**-0.5, 0.125, config=config
        )
        ms = triton.testing.do_bench(fn, return_mode="median")
        rows.append((f"indexer scores {config}", shape, ms, "dense GEMM, same FLOPs", floor))
    return rows


def bench_hc_mixes(row_counts: list[int]) -> list[tuple]:
    """The hyper-connections' mixes [T, 24] from bf16 streams [T, 16384] and float32 weights,
    per config (its default split, then one program along K), against torch's
    ``F.linear(x.float(), fn)`` (the copy and cuBLAS's float32 GEMM)."""
    import triton.testing

    rows = []
    fn = torch.randn(HC_COLS, HC_WIDTH, device="cuda") / 128
    for t in row_counts:
        x = torch.randn(t, HC_WIDTH, device="cuda", dtype=torch.bfloat16)
        torch_mixes = functools.partial(hc.hc_mixes_torch, x, fn)
        ref = triton.testing.do_bench(torch_mixes, return_mode="median")
        want = hc.hc_mixes_torch(x, fn)
        for config in MIXES_CONFIGS:
            for splits in (None, 1):
                f = functools.partial(hc.hc_mixes_triton, x, fn, config=config, splits=splits)
                diff = (f() - want).abs().max().item()
                ms = triton.testing.do_bench(f, return_mode="median")
                name = f"hc mixes {config}{' 1 split' if splits else ''} (diff {diff:.0e})"
                rows.append((name, f"{t} x {HC_WIDTH} -> {HC_COLS}", ms, "torch float32", ref))
    return rows


def bench_norm_rope(row_counts: list[int]) -> list[tuple]:
    """q's unweighted norm and interleaved rope [T, 64, 512] (bf16) per ``NORM_ROPE_TILE``
    (channels a program: 512 is a row a program), against ``x.clone()`` (the same bytes read
    and written)."""
    import triton.testing

    rows, tile = [], fused.NORM_ROPE_TILE
    for t in row_counts:
        x = torch.randn(t, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        cos, sin = torch.rand(t, 32, device="cuda"), torch.rand(t, 32, device="cuda")
        ref = triton.testing.do_bench(x.clone, return_mode="median")
        want = fused.norm_rope_tail_torch(x, None, 1e-6, cos, sin)
        try:
            for size in (512, 1024, 2048, 4096, 8192):
                fused.NORM_ROPE_TILE = size
                f = functools.partial(fused.norm_rope_tail_triton, x, None, 1e-6, cos, sin)
                diff = (f().float() - want.float()).abs().max().item()
                ms = triton.testing.do_bench(f, return_mode="median")
                name = f"norm rope, {size} channels a program (diff {diff:.0e})"
                rows.append((name, f"{t} x {HEADS} x {HEAD_DIM}", ms, "copy, same bytes", ref))
        finally:
            fused.NORM_ROPE_TILE = tile
    return rows
