"""Extend (prefill) attention over the paged KV: cached prefix plus the new tokens, causal, GQA."""

from __future__ import annotations

import functools
import math

import torch
from torch.nn import functional as F

from breakgraph.kernels.attention_meta import AttentionMeta
from breakgraph.kernels.launch import Launch, sm_count

try:  # Triton is optional: the CPU-only install runs the torch twin
    import triton
    import triton.language as tl
except ImportError:
    triton = None

_jit = triton.jit if triton is not None else (lambda fn: fn)
# the split path's counts follow the step (splits, query blocks): no variant per value class
# (1, multiple of 16, other), so a new prefix length never compiles after the warm-up
_jit_split = (
    (lambda fn: triton.jit(fn, do_not_specialize=["num_splits", "num_m_blocks"]))
    if triton is not None
    else (lambda fn: fn)
)
_LOG2E = math.log2(math.e)


# query rows per chunk of the twin: one chunk's scores take at most this many bytes
_TWIN_CHUNK_SCORE_BYTES = 64 << 20


def extend_attention_torch(
    q: torch.Tensor,
    o: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMeta,
    sm_scale: float,
    sliding_window: int | None = None,
) -> None:
    """Causal prefill attention over the paged KV (prefix + new tokens): q/o [T, H, D]; the
    new tokens' k/v are already stored in the cache.

    Request r's query rows ``extend_start_loc[r] : +extend_lens[r]`` sit at positions
    ``seq_lens[r] - extend_lens[r] + i``; its keys are ``req_to_token[req, :seq_lens[r]]``.
    Row i at position p sees keys 0 .. p, or with ``sliding_window`` W only p - W + 1 .. p
    (HF's sliding mask). Float32 math. Rows go through SDPA in chunks, each reading only
    the keys its rows can see, so memory stays bounded (``_TWIN_CHUNK_SCORE_BYTES`` of
    scores) and time grows with the visible keys: the twin is also the CPU serving path.
    The meta's launch bounds are unused.
    """
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
    gqa = num_heads != num_kv_heads
    for req, seq_len, start, ext in zip(
        meta.req_pool_indices.tolist(),
        meta.seq_lens.tolist(),
        meta.extend_start_loc.tolist(),
        meta.extend_lens.tolist(),
        strict=True,
    ):
        if ext == 0:
            continue
        prefix = seq_len - ext
        first = 0 if sliding_window is None else max(0, prefix - sliding_window + 1)
        slots = meta.req_to_token[req, first:seq_len].long()
        k = k_cache[slots].float().transpose(0, 1)  # [Hkv, S, D]
        v = v_cache[slots].float().transpose(0, 1)
        chunk = max(1, _TWIN_CHUNK_SCORE_BYTES // (4 * num_heads * max(seq_len - first, 1)))
        for c0 in range(0, ext, chunk):
            c1 = min(ext, c0 + chunk)
            # keys the rows at positions prefix + c0 .. prefix + c1 - 1 can see
            lo = first if sliding_window is None else max(first, prefix + c0 - sliding_window + 1)
            hi = prefix + c1
            q_pos = torch.arange(prefix + c0, prefix + c1, device=q.device)[:, None]
            k_pos = torch.arange(lo, hi, device=q.device)[None, :]
            visible = k_pos <= q_pos
            if sliding_window is not None:
                visible &= k_pos > q_pos - sliding_window
            out = F.scaled_dot_product_attention(
                q[start + c0 : start + c1].float().transpose(0, 1),  # [H, C, D]
                k[:, lo - first : hi - first],
                v[:, lo - first : hi - first],
                attn_mask=visible,
                scale=sm_scale,
                enable_gqa=gqa,
            )
            o[start + c0 : start + c1] = out.transpose(0, 1).to(o.dtype)


@_jit
def merge_partial(acc, total, m, part, lse):
    """Fold one split's normalized rows ``part`` [R, D] with their base-2 log-sum-exp ``lse``
    [R] into a running merge (``acc`` [R, D], ``total`` and max ``m`` [R]); returns all three.
    Divide ``acc`` by ``total`` at the end."""
    m_new = tl.maximum(m, lse)
    alpha = tl.math.exp2(m - m_new)
    w = tl.math.exp2(lse - m_new)
    return acc * alpha[:, None] + part * w[:, None], total * alpha + w, m_new


@_jit
def _attend_block(
    q_tile,
    acc,
    m_i,
    l_i,
    k_base,
    v_base,
    slots,
    key_mask,
    visible,
    offs_d,
    mask_d,
    offs_dv,
    mask_dv,
    qk_scale,
    stride_k_s,
    stride_v_s,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One key block of the base-2 online softmax, shared by every attention kernel here.

    ``slots`` [N] are the block's KV slots; with ``MASKED``, ``key_mask`` [N] marks the keys
    that exist and ``visible`` [M, N] which row sees which key (unused otherwise: every key
    of the block is seen by every row). The scores take every dimension (``offs_d``); the
    output ``acc`` only the value columns ``offs_dv`` (all of them, or a program's share
    under the one-pass kernel's value split). Returns the updated ``(acc, m_i, l_i)``.
    """
    k_ptrs = k_base + slots[None, :] * stride_k_s + offs_d[:, None]
    v_ptrs = v_base + slots[:, None] * stride_v_s + offs_dv[None, :]
    if MASKED:
        k = tl.load(k_ptrs, mask=key_mask[None, :] & mask_d[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs, mask=mask_d[:, None])
    qk = tl.dot(q_tile, k, input_precision=DOT_PRECISION) * qk_scale
    if MASKED:
        qk = tl.where(visible, qk, float("-inf"))
    p, alpha, m_new, l_i = _softmax_step(qk, m_i, l_i)
    if MASKED:
        v = tl.load(v_ptrs, mask=key_mask[:, None] & mask_dv[None, :], other=0.0)
    else:
        v = tl.load(v_ptrs, mask=mask_dv[None, :])
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@_jit
def _value_share(HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """The value split: BLOCK_D // BLOCK_DV programs per head along the grid's first axis,
    each computing the whole scores and its share of the output columns (an accumulator a
    wide head's large tiles can hold in registers, each dot recomputed once per share).
    This program's ``(head, value columns, their mask)``."""
    shares: tl.constexpr = BLOCK_D // BLOCK_DV
    offs_dv = (tl.program_id(0) % shares) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    return tl.program_id(0) // shares, offs_dv, offs_dv < HEAD_DIM


@_jit
def _softmax_step(qk, m_i, l_i):
    """The online softmax over one block's scores ``qk`` [M, N] (base 2): the block's
    weights ``p``, the rescale ``alpha`` of what came before, and the new max and sum."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.math.exp2(qk - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@_jit
def _attend_loaded(q_tile, acc, m_i, l_i, k, v, visible, qk_scale, DOT_PRECISION: tl.constexpr):
    """:func:`_attend_block` (masked) on a block already loaded: ``k`` [D, N], ``v`` [N, D]
    (zeros where no key is), ``visible`` [M, N]; the same arithmetic in the same order."""
    qk = tl.dot(q_tile, k, input_precision=DOT_PRECISION) * qk_scale
    p, alpha, m_new, l_i = _softmax_step(tl.where(visible, qk, float("-inf")), m_i, l_i)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


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
    window,  # sliding window W (with SLIDING): a row at position p sees keys p-W+1 .. p
    num_rows,  # o's rows (with ZERO_PAD; 0 otherwise, so that it specializes nothing)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SLIDING: tl.constexpr,
    ZERO_PAD: tl.constexpr,  # one request: its block's rows past it, up to num_rows, get 0
    BLOCK_DV: tl.constexpr,  # value columns per program: BLOCK_D, or a share of them
):
    head, offs_dv, mask_dv = _value_share(HEAD_DIM, BLOCK_D, BLOCK_DV)
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
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

        # Keys before the block's first query position are visible to every row and lie
        # inside the sequence: whole key blocks there need no mask at all. With a sliding
        # window, blocks before ``win_lo`` are seen by no row (skipped, never read) and
        # blocks in [win_lo, full_lo) by some rows only (masked).
        q_first = prefix + m_block * BLOCK_M
        full_end = (q_first // BLOCK_N) * BLOCK_N
        q_pos = prefix + offs_m
        end = tl.minimum(seq_len, prefix + (m_block + 1) * BLOCK_M)
        full_lo = 0
        if SLIDING:
            q_last = prefix + (m_block + 1) * BLOCK_M - 1
            win_lo = (tl.maximum(q_first - window + 1, 0) // BLOCK_N) * BLOCK_N
            full_lo = tl.minimum(
                tl.cdiv(tl.maximum(q_last - window + 1, 0), BLOCK_N) * BLOCK_N, full_end
            )
            for n0 in range(win_lo, full_lo, BLOCK_N):
                offs = n0 + offs_n
                slots = tl.load(tokens + offs).to(tl.int64)
                seen = (offs[None, :] <= q_pos[:, None]) & (offs[None, :] > q_pos[:, None] - window)
                acc, m_i, l_i = _attend_block(
                    q_tile, acc, m_i, l_i, k_base, v_base, slots, offs < end, seen, offs_d,
                    mask_d, offs_dv, mask_dv, qk_scale, stride_k_s, stride_v_s, True,
                    DOT_PRECISION,
                )  # fmt: skip
        for n0 in range(full_lo, full_end, BLOCK_N):
            slots = tl.load(tokens + n0 + offs_n).to(tl.int64)
            acc, m_i, l_i = _attend_block(
                q_tile, acc, m_i, l_i, k_base, v_base, slots, mask_d, mask_d, offs_d, mask_d,
                offs_dv, mask_dv, qk_scale, stride_k_s, stride_v_s, False, DOT_PRECISION,
            )  # fmt: skip

        # Diagonal blocks: causal mask (row at position prefix + i sees keys <= it).
        for n0 in range(full_end, end, BLOCK_N):
            offs = n0 + offs_n
            mask_n = offs < end
            slots = tl.load(tokens + offs, mask=mask_n, other=0).to(tl.int64)
            visible = (offs[None, :] <= q_pos[:, None]) & mask_n[None, :]
            if SLIDING:
                visible = visible & (offs[None, :] > q_pos[:, None] - window)
            acc, m_i, l_i = _attend_block(
                q_tile, acc, m_i, l_i, k_base, v_base, slots, mask_n, visible, offs_d, mask_d,
                offs_dv, mask_dv, qk_scale, stride_k_s, stride_v_s, True, DOT_PRECISION,
            )  # fmt: skip

        out = acc / l_i[:, None]
        o_ptrs = o + (row0 + offs_m)[:, None] * stride_o_t + head * stride_o_h + offs_dv[None, :]
        if ZERO_PAD:  # the rows past the request's are padding: zeros
            out = tl.where(mask_m[:, None], out, 0.0)
            mask_m = (row0 + offs_m) < num_rows
        tl.store(o_ptrs, out.to(o.dtype.element_ty), mask=mask_m[:, None] & mask_dv[None, :])
    else:
        if ZERO_PAD:  # a block of padding rows only
            row0 = tl.load(extend_start_loc + b).to(tl.int64)
            rows = row0 + m_block * BLOCK_M + tl.arange(0, BLOCK_M)
            o_ptrs = o + rows[:, None] * stride_o_t + head * stride_o_h + offs_dv[None, :]
            zeros = tl.zeros([BLOCK_M, BLOCK_DV], dtype=o.dtype.element_ty)
            tl.store(o_ptrs, zeros, mask=(rows < num_rows)[:, None] & mask_dv[None, :])


@_jit_split
def _extend_split_kernel(
    q,
    o,
    k_cache,
    v_cache,
    req_to_token,
    req_pool_indices,
    seq_lens,
    extend_start_loc,
    extend_lens,
    part_o,
    part_lse,
    qk_scale,  # sm_scale * log2(e): the softmax runs in base 2
    group,  # query heads per kv head
    num_splits,
    num_m_blocks,  # query blocks per request: cdiv(max_extend_len, BLOCK_M)
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
    DIRECT: tl.constexpr,  # one split: normalize and store into ``o``, no workspace
    BLOCK_DV: tl.constexpr,  # value columns per program (the value split, as one-pass)
):
    """Split-KV stage 1: one (head, request, query block, key split).

    Query block m of a request sees keys ``0 .. kv_end`` (``kv_end`` = its last row's
    position + 1); that range is cut into ``num_splits`` runs of whole key blocks. Writes
    the split's normalized output and base-2 log-sum-exp per row into the fp32 workspace
    ``part_o [S, H, B * num_m_blocks * BLOCK_M, D]``, ``part_lse [S, H, B * ... ]``; a row
    that sees no key of the split gets lse -inf. Empty splits write nothing (stage 2 skips
    them by the same arithmetic). With ``DIRECT`` (one split) it is a one-pass kernel.
    """
    head, offs_dv, mask_dv = _value_share(HEAD_DIM, BLOCK_D, BLOCK_DV)
    pid = tl.program_id(1)
    split = tl.program_id(2)
    b = pid // num_m_blocks
    # The last query blocks see the most keys: launch them first for a better tail.
    m_block = num_m_blocks - 1 - pid % num_m_blocks
    extend_len = tl.load(extend_lens + b)
    if m_block * BLOCK_M < extend_len:
        seq_len = tl.load(seq_lens + b)
        prefix = seq_len - extend_len
        kv_end = tl.minimum(seq_len, prefix + (m_block + 1) * BLOCK_M)
        split_len = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
        lo = split * split_len
        hi = tl.minimum(lo + split_len, kv_end)
        if lo < hi:
            row0 = tl.load(extend_start_loc + b).to(tl.int64)
            req = tl.load(req_pool_indices + b).to(tl.int64)
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
            acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

            # Whole key blocks before the block's first query position: no mask.
            q_first = prefix + m_block * BLOCK_M
            full_end = tl.minimum((q_first // BLOCK_N) * BLOCK_N, hi)
            for n0 in range(lo, full_end, BLOCK_N):
                slots = tl.load(tokens + n0 + offs_n).to(tl.int64)
                acc, m_i, l_i = _attend_block(
                    q_tile, acc, m_i, l_i, k_base, v_base, slots, mask_d, mask_d, offs_d,
                    mask_d, offs_dv, mask_dv, qk_scale, stride_k_s, stride_v_s, False,
                    DOT_PRECISION,
                )  # fmt: skip

            # The rest of the split: causal mask and the split's end.
            q_pos = prefix + offs_m
            for n0 in range(tl.maximum(lo, full_end), hi, BLOCK_N):
                offs = n0 + offs_n
                mask_n = offs < hi
                slots = tl.load(tokens + offs, mask=mask_n, other=0).to(tl.int64)
                visible = (offs[None, :] <= q_pos[:, None]) & mask_n[None, :]
                acc, m_i, l_i = _attend_block(
                    q_tile, acc, m_i, l_i, k_base, v_base, slots, mask_n, visible, offs_d,
                    mask_d, offs_dv, mask_dv, qk_scale, stride_k_s, stride_v_s, True,
                    DOT_PRECISION,
                )  # fmt: skip

            if DIRECT:  # every row sees key 0: l_i > 0
                out = acc / l_i[:, None]
                o_ptrs = (
                    o + (row0 + offs_m)[:, None] * stride_o_t + head * stride_o_h + offs_dv[None, :]
                )
                tl.store(
                    o_ptrs, out.to(o.dtype.element_ty), mask=mask_m[:, None] & mask_dv[None, :]
                )
            else:
                seen = l_i > 0.0
                out = acc / tl.where(seen, l_i, 1.0)[:, None]
                lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
                ws_len = tl.num_programs(1) * BLOCK_M  # workspace rows per (split, head)
                heads = tl.num_programs(0) // (BLOCK_D // BLOCK_DV)  # without the shares
                ws_rows = (split * heads + head).to(tl.int64) * ws_len + (
                    b * num_m_blocks * BLOCK_M + offs_m
                )
                tl.store(
                    part_o + ws_rows[:, None] * HEAD_DIM + offs_dv[None, :],
                    out,
                    mask=mask_m[:, None] & mask_dv[None, :],
                )
                # (every share of the columns has the same log-sum-exp: each stores it)
                tl.store(part_lse + ws_rows, lse, mask=mask_m)


@_jit_split
def _extend_merge_kernel(
    part_o,
    part_lse,
    o,
    seq_lens,
    extend_start_loc,
    extend_lens,
    num_splits,
    num_m_blocks,
    stride_o_t,
    stride_o_h,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,  # stage 1's query block
    BLOCK_N: tl.constexpr,  # stage 1's key block
    MERGE_M: tl.constexpr,  # rows per program here; divides BLOCK_M
):
    """Split-KV stage 2: one (head, request, MERGE_M rows); log-sum-exp merge into ``o``."""
    head = tl.program_id(0)
    pid = tl.program_id(1)
    sub_blocks: tl.constexpr = BLOCK_M // MERGE_M
    b = pid // (num_m_blocks * sub_blocks)
    r0 = (pid % (num_m_blocks * sub_blocks)) * MERGE_M
    extend_len = tl.load(extend_lens + b)
    if r0 < extend_len:
        seq_len = tl.load(seq_lens + b)
        prefix = seq_len - extend_len
        m_block = r0 // BLOCK_M
        kv_end = tl.minimum(seq_len, prefix + (m_block + 1) * BLOCK_M)
        split_len = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
        used = tl.cdiv(kv_end, split_len)  # the non-empty splits
        row0 = tl.load(extend_start_loc + b).to(tl.int64)
        offs_m = r0 + tl.arange(0, MERGE_M)
        offs_d = tl.arange(0, BLOCK_D)
        mask_m = offs_m < extend_len
        mask = mask_m[:, None] & (offs_d[None, :] < HEAD_DIM)
        ws_len = tl.num_programs(1) * MERGE_M  # workspace rows per (split, head)
        base_rows = head.to(tl.int64) * ws_len + b * num_m_blocks * BLOCK_M + offs_m
        m = tl.full([MERGE_M], -1.0e30, dtype=tl.float32)
        total = tl.zeros([MERGE_M], dtype=tl.float32)
        acc = tl.zeros([MERGE_M, BLOCK_D], dtype=tl.float32)
        split_stride = tl.num_programs(0).to(tl.int64) * ws_len
        rows = base_rows
        for _ in range(0, used):
            lse = tl.load(part_lse + rows, mask=mask_m, other=float("-inf"))
            part = tl.load(
                part_o + rows[:, None] * HEAD_DIM + offs_d[None, :], mask=mask, other=0.0
            )
            acc, total, m = merge_partial(acc, total, m, part, lse)
            rows += split_stride
        out = acc / tl.maximum(total, 1.0e-30)[:, None]
        o_ptrs = o + (row0 + offs_m)[:, None] * stride_o_t + head * stride_o_h + offs_d[None, :]
        tl.store(o_ptrs, out.to(o.dtype.element_ty), mask=mask)


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def _block_d(head_dim: int) -> int:
    """The kernels' head tile: ``head_dim`` up to a power of two, at least 16."""
    return max(16, triton.next_power_of_2(head_dim))


def _extend_config(head_dim: int, dtype: torch.dtype, device: torch.device) -> tuple[int, ...]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages[, BLOCK_DV]); measured on an H200 for d128
    bf16, on an H100 for d512 (``bench kernels --tflops 512 --sweep``).

    The Hopper d128 config takes ~161 KiB of shared memory; the others fit in ~97 KiB.
    """
    block_d = _block_d(head_dim)
    if dtype == torch.float32:
        return (32, 32, 4, 2) if block_d <= 128 else (32, 16, 4, 1)  # tests; tf32x3 dots
    if block_d <= 64:
        return 128, 64, 4, 3
    if block_d <= 128:
        index = device.index if device.index is not None else torch.cuda.current_device()
        return (128, 128, 8, 3) if _capability(index)[0] == 9 else (128, 64, 8, 3)
    if block_d <= 256:
        return 64, 32, 8, 2
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _capability(index)[0] == 9:
        # d512 (Gemma 4's full layers) on Hopper: 128-row tiles, each program half the value
        # columns (an accumulator of 128 x 256 fp32, the scores computed once per half). An
        # H100 (8 heads over 1, one request): 8K causal 2.29 ms against 6.76 for (32, 32, 8,
        # 2), 1K over 16K 1.32 against 4.30; the best of 21 tiles, 240 TFLOP/s (31% of the
        # matrix rate). 128 x 64 and 256 x 32 tiles exceed its shared memory.
        return 128, 32, 8, 2, 256
    return _SPLIT_WIDE_CONFIG  # d512 elsewhere: unmeasured


_SPLIT_WIDE_CONFIG = (32, 32, 8, 2)  # d512: an fp32 accumulator of 32 rows, all columns


def _value_shares(config: tuple[int, ...], head_dim: int) -> int:
    """Programs per head under ``config``'s value split (its fifth entry, BLOCK_DV)."""
    return _block_d(head_dim) // config[4] if len(config) > 4 else 1


def split_config(config: tuple[int, ...], head_dim: int, splits: int) -> tuple[int, ...]:
    """The split kernel's tile at ``splits`` key splits where the one-pass kernel's is
    ``config``: the same, except that a value split's tile gives way to
    :data:`_SPLIT_WIDE_CONFIG` when the kernel writes the workspace (``splits > 1``). Unsplit
    (one launch writing ``o``) it keeps the value split: at d512 on an H100, 1K new over 16K
    cached in 1.34 ms at (128, 32, 8, 2, 256), as the one-pass kernel, against 4.30 at the
    wide tile. Split, the 128-row tile (by count 224 of the H100's 227 KiB of shared memory)
    has not run on a GPU, and a tile past the chip's resources would fail a request."""
    if splits > 1 and _value_shares(config, head_dim) > 1:
        return _SPLIT_WIDE_CONFIG
    return config


# Split-KV path (flash-decoding style) for grids too small to fill the GPU: few query
# blocks, each facing a long cached prefix.
_SPLIT_MIN_KEYS = 512  # each split walks at least this many keys of the longest sequence
_SPLIT_MAX = 64
_SPLIT_COST = 0.01  # per split, as a fraction of the one-pass time: workspace and merge
# Small grids over this many keys take the split kernel even unsplit (one launch, no
# workspace). On an H200 at 1024 new over 32K it matched the one-pass kernel (0.816 vs
# 0.819 ms); an earlier variant that walked the query blocks in ascending order measured
# 0.768 ms there, including the merge: a lead for this path. Below it, small grids (P=0
# prefills up to 2K tokens) keep the one-pass kernel.
DIRECT_MIN_KEYS = 8192
# contexts shorter than this take the one-pass kernel whatever the grid (no split keeps
# _SPLIT_MIN_KEYS keys, and the unsplit split kernel starts at DIRECT_MIN_KEYS)
ONE_PASS_MAX_KEYS = 2 * _SPLIT_MIN_KEYS - 1
_MERGE_M = 16  # rows per merge program


def num_kv_splits(
    num_heads: int,
    batch: int,
    max_extend_len: int,
    max_seq_len: int | None,
    block_m: int,
    num_sms: int,
) -> int:
    """Which kernel and how many key splits, from host-known sizes only.

    0: the one-pass kernel. ``S >= 1``: the split-KV kernel with ``S`` key splits per
    query block (``S == 1``: one launch writing ``o`` directly).

    The one-pass grid has ``heads * batch * cdiv(max_extend_len, BLOCK_M)`` programs, each
    walking up to ``max_seq_len`` keys. When that is under two waves, splitting the keys
    ``S`` ways changes the critical path from ``ceil(programs / SMs)`` program times to
    ``ceil(programs * S / SMs) / S`` (one program per SM at the Hopper config), plus a
    small cost per split for the fp32 workspace and the merge; the cheapest ``S`` wins.
    Splits keep at least ``_SPLIT_MIN_KEYS`` keys each, and the split programs stay
    within ~8 waves (the workspace is ``S * programs * BLOCK_M * D`` fp32).
    """
    if max_seq_len is None or max_extend_len <= 0 or batch == 0:
        return 0
    programs = num_heads * batch * triton.cdiv(max_extend_len, block_m)
    if programs >= 2 * num_sms:
        return 0
    best, best_cost = 1, float(triton.cdiv(programs, num_sms))
    # at most ~8 waves of split programs: bounds the workspace (~66 MiB at d128 bf16)
    most = min(_SPLIT_MAX, max_seq_len // _SPLIT_MIN_KEYS, 8 * num_sms // programs)
    for splits in range(2, most + 1):
        cost = triton.cdiv(programs * splits, num_sms) / splits + _SPLIT_COST * splits
        if cost < best_cost - 1e-9:
            best, best_cost = splits, cost
    if best == 1 and max_seq_len < DIRECT_MIN_KEYS:
        return 0
    return best


def extend_attention_triton(q, o, k_cache, v_cache, meta, sm_scale, sliding_window=None) -> None:
    """Triton twin of :func:`extend_attention_torch` (its arguments; flash attention over the
    paged KV).

    Grid (heads, batch, cdiv(max_extend_len, BLOCK_M)) from host-known sizes only; the
    per-request lengths are read on the device. ``meta.max_extend_len`` may overestimate.
    ``meta.max_seq_len``, a host-known upper bound of ``seq_lens``, lets a grid too small to
    fill the GPU (few query blocks over a long prefix) split the keys: partial results in
    an fp32 workspace, merged by a second launch (see :func:`num_kv_splits`). Without it,
    always the one-pass kernel.
    """
    ExtendPlan(q, k_cache, meta, sm_scale, sliding_window=sliding_window)(q, o, k_cache, v_cache)


class ExtendPlan:
    """Everything about one step's extend-attention launch but the per-layer tensors.

    Every layer of a step shares the metadata, the shapes, the kernel choice, the grid and
    the split workspace, so the attention break computes them once per step and each layer
    pays only its launches: ``plan(q, o, k_cache, v_cache)``, past the first layer through
    the compiled kernels' own launchers (:class:`~breakgraph.kernels.launch.Launch`).
    Host-known values only.
    """

    def __init__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        meta: AttentionMeta,
        sm_scale: float,
        *,
        config: tuple[int, int, int, int] | None = None,
        splits: int | None = None,
        sliding_window: int | None = None,
        zero_pad: bool = False,
    ):
        """``config`` (BLOCK_M, BLOCK_N, warps, stages[, BLOCK_DV]) and ``splits`` override the
        choices (benchmark sweeps and tests); BLOCK_DV, the value columns per program (the
        value split), defaults to all of them. ``sliding_window`` W: a row at position p sees
        keys p-W+1 .. p; the one-pass kernel skips the key blocks outside every row's window,
        so a long prefix costs the window, not the prefix (no key split is needed).
        ``zero_pad`` (one request): every row of ``o`` past the request's gets zeros, by the
        one-pass kernel's blocks past it (``max_extend_len`` must cover ``o``'s rows), or by
        a fill before the split kernel; otherwise rows of no request are left untouched."""
        num_tokens, num_heads, head_dim = q.shape
        batch = meta.req_pool_indices.shape[0]
        num_kv_heads = k_cache.shape[1]
        max_extend_len = meta.max_extend_len
        if zero_pad and (batch != 1 or max_extend_len < num_tokens):
            raise ValueError("zero_pad needs one request whose extend bound covers o's rows")
        self.zero_pad = zero_pad  # the split path: a fill before its launches
        self.num_rows = num_tokens if zero_pad else 0  # the one-pass kernel's bound
        self.empty = num_tokens == 0 or batch == 0 or max_extend_len <= 0
        if self.empty:
            return
        assert num_heads % num_kv_heads == 0 and k_cache.shape[2] == head_dim
        assert q.stride(-1) == 1 and k_cache.stride(-1) == 1
        cfg = config or _extend_config(head_dim, q.dtype, q.device)
        block_d = _block_d(head_dim)
        if sliding_window is not None:
            assert sliding_window >= 1 and splits in (None, 0), "a window takes the one-pass kernel"
            splits = 0
        elif splits is None:  # the one-pass kernel's grid decides
            splits = num_kv_splits(
                num_heads * _value_shares(cfg, head_dim), batch, max_extend_len,
                meta.max_seq_len, cfg[0], sm_count(q.device),
            )  # fmt: skip
        if splits and config is None:
            cfg = split_config(cfg, head_dim, splits)
        block_m, block_n, num_warps, num_stages = cfg[:4]
        programs_per_head = _value_shares(cfg, head_dim)
        block_dv = block_d // programs_per_head
        assert block_dv * programs_per_head == block_d, "the value split takes powers of two"
        self.splits = splits
        self.window = sliding_window or 0
        num_m_blocks = triton.cdiv(max_extend_len, block_m)
        # the kernels' metadata arguments, in their order, unpacked once per step
        self.meta_args = (
            meta.req_to_token, meta.req_pool_indices, meta.seq_lens, meta.extend_start_loc,
            meta.extend_lens,
        )  # fmt: skip
        self.scale_group = (sm_scale * _LOG2E, num_heads // num_kv_heads)
        self.table_stride = meta.req_to_token.stride(0)
        self.consts = dict(
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            DOT_PRECISION="tf32x3" if q.dtype == torch.float32 else "tf32",
            BLOCK_DV=block_dv,
            num_warps=num_warps,
            num_stages=num_stages,
        )
        if splits == 0:
            self.grid = (num_heads * programs_per_head, batch, num_m_blocks)
            self.consts["SLIDING"] = sliding_window is not None
            self.consts["ZERO_PAD"] = zero_pad
            self.attend = Launch(_extend_attention_kernel, self.grid, **self.consts)
            return
        assert block_m % _MERGE_M == 0
        self.grid = (num_heads * programs_per_head, batch * num_m_blocks, splits)
        self.split_args = (splits, num_m_blocks)
        self.consts["DIRECT"] = splits == 1
        self.part_o = self.part_lse = None  # direct: the kernel writes o
        if splits > 1:
            ws_len = batch * num_m_blocks * block_m  # rows: (request, row) padded to blocks
            self.part_o = torch.empty(
                splits, num_heads, ws_len, head_dim, dtype=torch.float32, device=q.device
            )
            self.part_lse = torch.empty(
                splits, num_heads, ws_len, dtype=torch.float32, device=q.device
            )
            self.merge_grid = (num_heads, batch * num_m_blocks * (block_m // _MERGE_M))
            self.merge_consts = dict(
                HEAD_DIM=head_dim,
                BLOCK_D=block_d,
                BLOCK_M=block_m,
                BLOCK_N=block_n,
                MERGE_M=_MERGE_M,
                num_warps=4 if block_d <= 128 else 8,
            )
            self.merge = Launch(_extend_merge_kernel, self.merge_grid, **self.merge_consts)
        self.split = Launch(_extend_split_kernel, self.grid, **self.consts)

    def __call__(
        self, q: torch.Tensor, o: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> None:
        if self.empty:
            return
        strides = (
            q.stride(0), q.stride(1), o.stride(0), o.stride(1), k_cache.stride(0),
            k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), self.table_stride,
        )  # fmt: skip
        if self.splits == 0:
            self.attend(
                q, o, k_cache, v_cache, *self.meta_args, *self.scale_group, *strides, self.window,
                self.num_rows,
            )  # fmt: skip
            return
        if self.zero_pad:
            o.zero_()
        part_o = o if self.part_o is None else self.part_o
        part_lse = o if self.part_lse is None else self.part_lse
        self.split(
            q, o, k_cache, v_cache, *self.meta_args, part_o, part_lse, *self.scale_group,
            *self.split_args, *strides,
        )  # fmt: skip
        if self.part_o is None:
            return
        self.merge(
            self.part_o, self.part_lse, o, *self.meta_args[2:], *self.split_args, o.stride(0),
            o.stride(1),
        )  # fmt: skip
