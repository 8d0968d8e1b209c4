"""Manifold-constrained hyper-connections (DeepSeek V4's mHC) around a sublayer, as three ops.

``hc_mixes``: the raw mixes ``streams.flatten(1) @ fn^T`` [T, m] in float32 from the bf16
streams [T, n H] and the float32 weights [m, n H] (m = (2 + n) n = 24, or n at the hyper
head): the Triton kernel reads the streams as they are and accumulates in float32 on the
tensor cores (3xTF32: bf16 operands are exact in TF32, the weights split in two), where
torch's ``F.linear(x.float(), fn)`` first writes a float32 copy of the streams and then runs
cuBLAS's float32 FMA GEMM: 0.171 ms against 0.679 at 8K rows on an H100, the 20-layer cut
of V4-Flash's 8K prefill step 284.5 ms against 306.1 (``MIXES_CONFIG``). Short batches
split the reduction over programs (the weights, 1.5 MB, are then what is read) and sum the
parts.

``hc_collapse``: from the residual streams [T, n, H] and the raw mixes, the site's weights
and the sublayer's input: the mixes
scaled by the streams' RMS (the norm before HF's projection is one scalar per row, so it
commutes with the projection), then ``pre = sigmoid(w s0 + b) + eps``, ``post = 2 sigmoid(w
s1 + b)``, ``comb`` a row softmax made doubly stochastic by ``iters`` Sinkhorn steps, and the
collapsed input ``sum_i pre_i streams_i``. Without ``comb`` (the model's hyper head) only
``pre`` and the collapse. ``hc_expand``: the streams after the sublayer, ``post_j out +
sum_i comb_ij streams_i``.

In torch these are about 90 launches per site (the Sinkhorn loop alone 80); each Triton op
is one, a program per row holding the n x n matrix in registers.
"""

from __future__ import annotations

import torch

from breakgraph.kernels.launch import sm_count

try:  # Triton is optional: the CPU-only install runs the torch twins
    import triton
    import triton.language as tl
except ImportError:
    triton = None

_jit = triton.jit if triton is not None else (lambda fn: fn)


# ---------------------------------------------------------------------------- torch twins


def hc_collapse_torch(
    streams: torch.Tensor,
    mixes: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    iters: int,
    hc_eps: float,
    norm_eps: float,
    with_comb: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """streams [T, n, H], mixes [T, (2 + n) n] (or [T, n] without comb) float32 -> (post
    [T, n], comb [T, n, n], collapsed [T, H] in streams' dtype); (None, None, collapsed)
    without comb. HF's DeepseekV4HyperConnection / HyperHead arithmetic."""
    n = streams.shape[1]
    flat = streams.flatten(1).float()
    mixes = mixes * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    if not with_comb:
        pre = torch.sigmoid(mixes * scale[0] + base) + hc_eps
        return None, None, (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * scale[2] + comb_b.view(n, n), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return post, comb, collapsed


def hc_expand_torch(
    streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """``post_j out + sum_i comb_ij streams_i`` [T, n, H] in streams' dtype (HF: post and comb
    cast to it first; comb is not symmetric, so comb^T @ streams)."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(1) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), streams
    )


def hc_mixes_torch(x: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
    """x [T, K] (the streams flattened), fn [m, K] float32 -> x @ fn^T [T, m] float32."""
    return torch.nn.functional.linear(x.float(), fn)


# ---------------------------------------------------------------------------- Triton


@_jit
def _hc_mixes_kernel(
    x,
    fn,
    out,
    rows,
    cols,
    width,
    k_per_split,
    stride_x,
    stride_f,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    split = tl.program_id(1)
    j = tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_T, BLOCK_N), tl.float32)
    k_lo = split * k_per_split
    for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
        k = k0 + kk
        a = tl.load(
            x + t[:, None] * stride_x + k[None, :],
            mask=(t[:, None] < rows) & (k[None, :] < width), other=0.0,
        ).to(tl.float32)  # fmt: skip
        b = tl.load(
            fn + j[None, :] * stride_f + k[:, None],
            mask=(j[None, :] < cols) & (k[:, None] < width), other=0.0,
        )  # fmt: skip
        acc = tl.dot(a, b, acc, input_precision="tf32x3")
    at = out + split.to(tl.int64) * rows * cols + t[:, None] * cols + j[None, :]
    tl.store(at, acc, mask=(t[:, None] < rows) & (j[None, :] < cols))


# (BLOCK_T, BLOCK_K, warps, stages). On an H100 (``bench kernels --v4-attention``, 16384 ->
# 24, against torch's copy and float32 GEMM): 8K rows 0.171 ms against 0.679, 32K 0.738
# against 2.560, 1K 0.032 against 0.111, one row (256 programs along K) 0.011 against 0.014;
# of six configs the best or within 10% of it at every row count but 32 (0.015 against 0.013)
MIXES_CONFIG = (64, 64, 4, 4)


def hc_mixes_triton(x: torch.Tensor, fn: torch.Tensor, config=None, splits=None) -> torch.Tensor:
    """Triton twin of :func:`hc_mixes_torch` (module docstring); ``config`` and ``splits``
    override the choices (the benchmark's sweep)."""
    t, width = x.shape
    cols = fn.shape[0]
    assert x.stride(1) == 1 and fn.is_contiguous() and fn.dtype == torch.float32
    block_t, block_k, warps, stages = config or MIXES_CONFIG
    t_blocks = max(1, triton.cdiv(t, block_t))
    k_blocks = triton.cdiv(width, block_k)
    if splits is None:  # fill the GPU: about two programs an SM
        splits = max(1, min(k_blocks, 2 * sm_count(x.device) // t_blocks))
    per_split = triton.cdiv(k_blocks, splits) * block_k
    splits = triton.cdiv(width, per_split)
    out = torch.empty((splits, t, cols), dtype=torch.float32, device=x.device)
    if t:
        _hc_mixes_kernel[(t_blocks, splits)](
            x, fn, out, t, cols, width, per_split, x.stride(0), fn.stride(0), BLOCK_T=block_t,
            BLOCK_N=max(16, triton.next_power_of_2(cols)), BLOCK_K=block_k, num_warps=warps,
            num_stages=stages,
        )  # fmt: skip
    return out[0] if splits == 1 else out.sum(0)


@_jit
def _hc_collapse_kernel(
    streams,
    mixes,
    base,
    scale,
    post,
    comb,
    collapsed,
    hidden,
    stride_st,
    stride_sn,
    stride_m,
    stride_c,
    iters,
    hc_eps,
    norm_eps,
    N: tl.constexpr,
    WITH_COMB: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, N)
    h = tl.arange(0, BLOCK_H)
    rows = streams + t * stride_st + i[:, None] * stride_sn
    sq = tl.zeros((N, BLOCK_H), tl.float32)
    for h0 in range(0, hidden, BLOCK_H):
        ok = (h0 + h) < hidden
        x = tl.load(rows + h0 + h[None, :], mask=ok[None, :], other=0.0).to(tl.float32)
        sq += x * x
    r = tl.rsqrt(tl.sum(tl.sum(sq, 1), 0) / (N * hidden) + norm_eps)
    m = mixes + t * stride_m
    pre_w = tl.load(m + i) * r
    pre = tl.sigmoid(pre_w * tl.load(scale) + tl.load(base + i)) + hc_eps
    if WITH_COMB:
        post_w = tl.load(m + N + i) * r
        post_b = tl.load(base + N + i)
        tl.store(post + t * N + i, 2 * tl.sigmoid(post_w * tl.load(scale + 1) + post_b))
        cells = i[:, None] * N + i[None, :]
        c = tl.load(m + 2 * N + cells) * r * tl.load(scale + 2) + tl.load(base + 2 * N + cells)
        c = tl.exp(c - tl.max(c, 1)[:, None])
        c = c / tl.sum(c, 1)[:, None] + hc_eps
        c = c / (tl.sum(c, 0)[None, :] + hc_eps)
        for _ in range(iters - 1):
            c = c / (tl.sum(c, 1)[:, None] + hc_eps)
            c = c / (tl.sum(c, 0)[None, :] + hc_eps)
        tl.store(comb + t * N * N + cells, c)
    for h0 in range(0, hidden, BLOCK_H):
        ok = (h0 + h) < hidden
        x = tl.load(rows + h0 + h[None, :], mask=ok[None, :], other=0.0).to(tl.float32)
        y = tl.sum(pre[:, None] * x, 0)
        tl.store(collapsed + t * stride_c + h0 + h, y.to(collapsed.dtype.element_ty), mask=ok)


def hc_collapse_triton(streams, mixes, base, scale, iters, hc_eps, norm_eps, with_comb=True):
    """Triton twin of :func:`hc_collapse_torch`: one launch, a program per row."""
    t, n, hidden = streams.shape
    assert streams.stride(2) == 1 and n & (n - 1) == 0
    mixes = mixes.float().contiguous()
    collapsed = torch.empty((t, hidden), dtype=streams.dtype, device=streams.device)
    post = comb = None
    if with_comb:
        post = torch.empty((t, n), dtype=torch.float32, device=streams.device)
        comb = torch.empty((t, n, n), dtype=torch.float32, device=streams.device)
    if t:
        _hc_collapse_kernel[(t,)](
            streams, mixes, base, scale, post if with_comb else collapsed,
            comb if with_comb else collapsed, collapsed, hidden, streams.stride(0),
            streams.stride(1), mixes.stride(0), collapsed.stride(0), iters, hc_eps, norm_eps,
            N=n, WITH_COMB=with_comb, BLOCK_H=min(1024, triton.next_power_of_2(hidden)),
        )  # fmt: skip
    return post, comb, collapsed


@_jit
def _hc_expand_kernel(
    streams,
    out,
    post,
    comb,
    new,
    hidden,
    stride_st,
    stride_sn,
    stride_o,
    N: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = h < hidden
    i = tl.arange(0, N)
    dtype = new.dtype.element_ty
    rows = streams + t * stride_st + i[:, None] * stride_sn
    x = tl.load(rows + h[None, :], mask=ok[None, :], other=0.0)
    o = tl.load(out + t * stride_o + h, mask=ok, other=0.0).to(tl.float32)
    for j in tl.static_range(N):
        c = tl.load(comb + t * N * N + i * N + j).to(dtype).to(tl.float32)  # column j
        p = tl.load(post + t * N + j).to(dtype).to(tl.float32)
        mixed = tl.sum(c[:, None] * x.to(tl.float32), 0).to(dtype).to(tl.float32)
        y = (p * o).to(dtype).to(tl.float32) + mixed
        tl.store(new + t * stride_st + j * stride_sn + h, y.to(dtype), mask=ok)


def hc_expand_triton(streams, out, post, comb):
    """Triton twin of :func:`hc_expand_torch` (rounding where it rounds: the product, the
    mix, their sum), one launch."""
    t, n, hidden = streams.shape
    assert streams.is_contiguous() and out.stride(1) == 1
    new = torch.empty_like(streams)
    block = min(1024, triton.next_power_of_2(hidden))
    if t:
        _hc_expand_kernel[(t, triton.cdiv(hidden, block))](
            streams, out, post.contiguous(), comb.contiguous(), new, hidden, streams.stride(0),
            streams.stride(1), out.stride(0), N=n, BLOCK_H=block,
        )  # fmt: skip
    return new
