"""Extend (prefill) attention over the paged KV: cached prefix plus the new tokens, causal, GQA."""

from __future__ import annotations

import functools
import math

import torch

try:  # Triton is optional: the CPU-only install runs the torch twin
    import triton
    import triton.language as tl
except ImportError:
    triton = None

_jit = triton.jit if triton is not None else (lambda fn: fn)
_LOG2E = math.log2(math.e)


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


@_jit
def _extend_attention_kernel(
    q,
    o,
    k_cache,
    v_cache,
    req_to_token,
    req_pool_indices,
    seq_lens,
    extend_start_loc,
    extend_lens,
    qk_scale,  # sm_scale * log2(e): the softmax runs in base 2
    group,  # query heads per kv head
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_k_s,
    stride_k_h,
    stride_v_s,
    stride_v_h,
    stride_req,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    head = tl.program_id(0)
    b = tl.program_id(1)
    # The last query blocks see the most keys: launch them first for a better tail.
    m_block = tl.num_programs(2) - 1 - tl.program_id(2)
    extend_len = tl.load(extend_lens + b)
    if m_block * BLOCK_M < extend_len:  # blocks past this request's rows do nothing
        seq_len = tl.load(seq_lens + b)
        row0 = tl.load(extend_start_loc + b).to(tl.int64)
        req = tl.load(req_pool_indices + b).to(tl.int64)
        prefix = seq_len - extend_len
        kv_head = head // group

        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        mask_m = offs_m < extend_len
        mask_d = offs_d < HEAD_DIM
        q_ptrs = q + (row0 + offs_m)[:, None] * stride_q_t + head * stride_q_h + offs_d[None, :]
        q_tile = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0)

        tokens = req_to_token + req * stride_req
        k_base = k_cache + kv_head * stride_k_h
        v_base = v_cache + kv_head * stride_v_h
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        # Keys before the block's first query position are visible to every row and lie
        # inside the sequence: whole key blocks there need no mask at all.
        q_first = prefix + m_block * BLOCK_M
        full_end = (q_first // BLOCK_N) * BLOCK_N
        for n0 in range(0, full_end, BLOCK_N):
            slots = tl.load(tokens + n0 + offs_n).to(tl.int64)
            k = tl.load(
                k_base + slots[None, :] * stride_k_s + offs_d[:, None], mask=mask_d[:, None]
            )
            qk = tl.dot(q_tile, k, input_precision=DOT_PRECISION) * qk_scale
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.math.exp2(qk - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                v_base + slots[:, None] * stride_v_s + offs_d[None, :], mask=mask_d[None, :]
            )
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        # Diagonal blocks: causal mask (row at position prefix + i sees keys <= it).
        q_pos = prefix + offs_m
        end = tl.minimum(seq_len, prefix + (m_block + 1) * BLOCK_M)
        for n0 in range(full_end, end, BLOCK_N):
            offs = n0 + offs_n
            mask_n = offs < end
            slots = tl.load(tokens + offs, mask=mask_n, other=0).to(tl.int64)
            k = tl.load(
                k_base + slots[None, :] * stride_k_s + offs_d[:, None],
                mask=mask_n[None, :] & mask_d[:, None],
                other=0.0,
            )
            qk = tl.dot(q_tile, k, input_precision=DOT_PRECISION) * qk_scale
            visible = (offs[None, :] <= q_pos[:, None]) & mask_n[None, :]
            qk = tl.where(visible, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.math.exp2(qk - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                v_base + slots[:, None] * stride_v_s + offs_d[None, :],
                mask=mask_n[:, None] & mask_d[None, :],
                other=0.0,
            )
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        out = acc / l_i[:, None]
        o_ptrs = o + (row0 + offs_m)[:, None] * stride_o_t + head * stride_o_h + offs_d[None, :]
        tl.store(o_ptrs, out.to(o.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def _extend_config(
    head_dim: int, dtype: torch.dtype, device: torch.device
) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages); measured on an H200 for d128 bf16.

    The Hopper d128 config takes ~161 KiB of shared memory; the others fit in ~97 KiB.
    """
    block_d = max(16, triton.next_power_of_2(head_dim))
    if dtype == torch.float32:
        return (32, 32, 4, 2) if block_d <= 128 else (32, 16, 4, 1)  # tests; tf32x3 dots
    if block_d <= 64:
        return 128, 64, 4, 3
    if block_d <= 128:
        index = device.index if device.index is not None else torch.cuda.current_device()
        return (128, 128, 8, 3) if _capability(index)[0] == 9 else (128, 64, 8, 3)
    return 64, 32, 8, 2


def extend_attention_triton(
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
    """Triton twin of :func:`extend_attention_torch` (flash attention over the paged KV).

    Grid (heads, batch, cdiv(max_extend_len, BLOCK_M)) from host-known sizes only; the
    per-request lengths are read on the device. ``max_extend_len`` may overestimate.
    """
    block_m, block_n, num_warps, num_stages = _extend_config(q.shape[-1], q.dtype, q.device)
    _launch_extend(
        q, o, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, extend_start_loc,
        extend_lens, sm_scale, max_extend_len, block_m, block_n, num_warps, num_stages,
    )  # fmt: skip


def _launch_extend(
    q, o, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, extend_start_loc,
    extend_lens, sm_scale, max_extend_len, block_m, block_n, num_warps, num_stages,
) -> None:  # fmt: skip
    num_tokens, num_heads, head_dim = q.shape
    batch = req_pool_indices.shape[0]
    if num_tokens == 0 or batch == 0 or max_extend_len <= 0:
        return
    num_kv_heads = k_cache.shape[1]
    assert num_heads % num_kv_heads == 0 and k_cache.shape[2] == head_dim
    assert q.stride(-1) == 1 and o.stride(-1) == 1
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    grid = (num_heads, batch, triton.cdiv(max_extend_len, block_m))
    _extend_attention_kernel[grid](
        q,
        o,
        k_cache,
        v_cache,
        req_to_token,
        req_pool_indices,
        seq_lens,
        extend_start_loc,
        extend_lens,
        sm_scale * _LOG2E,
        num_heads // num_kv_heads,
        q.stride(0),
        q.stride(1),
        o.stride(0),
        o.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        req_to_token.stride(0),
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_PRECISION="tf32x3" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
    )
