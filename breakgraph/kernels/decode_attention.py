"""Decode attention: each query row over its request's paged KV up to its own position (one row
per request, or a verify step's several rows of one request)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

from breakgraph.kernels import pdl
from breakgraph.kernels.attention_meta import AttentionMeta
from breakgraph.kernels.extend_attention import _attend_loaded, extend_attention_torch
from breakgraph.kernels.launch import sm_count
from breakgraph.kernels.workspace import Workspace

try:  # Triton is optional: the CPU-only install runs the torch twin
    import triton
    import triton.language as tl
except ImportError:
    triton = None

_jit = triton.jit if triton is not None else (lambda fn: fn)
_LOG2E = math.log2(math.e)


def decode_attention_torch(
    q: torch.Tensor,
    o: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMeta,
    sm_scale: float,
    num_kv_splits: int | None = None,
    workspace: DecodeWorkspace | None = None,
    sliding_window: int | None = None,
) -> None:
    """One query row per request: q/o [B, H, D]; request b's keys are
    ``req_to_token[req, :seq_lens[b]]`` (with ``sliding_window`` W, only its last W). Reads
    the meta's key side only: query row b is request b's, whatever its extend fields say.
    ``num_kv_splits`` and ``workspace`` tune the Triton twin only (ignored here)."""
    rows = AttentionMeta.decode(meta.req_to_token, meta.req_pool_indices, meta.seq_lens)
    extend_attention_torch(q, o, k_cache, v_cache, rows, sm_scale, sliding_window=sliding_window)


class DecodeWorkspace(Workspace):
    """fp32 scratch for the split-KV partials (outputs and log-sum-exp), grown lazily
    (kernels/workspace.py: an outgrown buffer stays alive for the graphs captured with it).
    Grow it to the largest batch before capture."""

    def get(
        self, batch: int, num_heads: int, num_splits: int, head_dim: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``(partial_o [B, H, S, D], partial_lse [B, H, S])``."""
        rows = batch * num_heads * num_splits
        buf = self.buffer("partials", rows * (head_dim + 1), torch.float32, device)
        part_o = buf[: rows * head_dim].view(batch, num_heads, num_splits, head_dim)
        part_lse = buf[rows * head_dim :].view(batch, num_heads, num_splits)
        return part_o, part_lse


_DEFAULT_WORKSPACE = DecodeWorkspace(graph_held=True)

# Two launches: the split kernel, then the merge kernel (one program per head, every split
# loaded at once). Merging in each kv head's last split to finish (one launch) measured
# 1.04-1.13x slower at every batch on an H200, and one pass (no split) where the batch alone
# fills the GPU 0.93-1.03x, one pass over long contexts being the slow case: both removed.


# A step over a long context at batch 1 runs more, smaller programs: keys in blocks of 64 over
# 128 splits (the decode graphs capture this variant once more for batch 1 and replay it when
# the step's longest sequence has LONG_CONTEXT_MIN_TOKENS keys or more: engine/graphs/dispatch.py).
# On an H200 (the two captures timed in 7 interleaved rounds in one process), batch 1,
# Llama-3.1-8B / Qwen3-0.6B: 1K 1.022x / 1.014x (a loss), 2K 0.990x / 0.999x, 4K 0.975x /
# 0.944x, 8K 0.969x / 0.947-0.966x (two runs), 16K 0.984x / 0.991x; at batch 2 and more it
# gained little or lost (0.99-1.03x).
LONG_CONTEXT_BLOCK_N = 64
LONG_CONTEXT_SPLITS = 128
LONG_CONTEXT_MIN_TOKENS = 4096
_long_context = False  # set while the long-context variant is captured


@contextlib.contextmanager
def long_context() -> Iterator[None]:
    """Launches in this scope take the long-context variant (:data:`LONG_CONTEXT_BLOCK_N`,
    :data:`LONG_CONTEXT_SPLITS`) where it has smaller key blocks than the default."""
    global _long_context
    saved, _long_context = _long_context, True
    try:
        yield
    finally:
        _long_context = saved


def default_num_kv_splits(batch: int, num_kv_heads: int, device: torch.device) -> int:
    """Enough splits for ~16 programs per SM (many waves: a small tail); host sizes only."""
    sms = sm_count(device)
    want = triton.cdiv(16 * sms, max(1, batch * num_kv_heads))
    return min(64, max(2, triton.next_power_of_2(want)))


def _decode_block_n(head_dim: int, dtype: torch.dtype) -> int:
    """Keys per iteration: 128 was fastest for d128 bf16 on an H200 (1.03x the floor)."""
    if dtype == torch.float32:
        return 32
    return 128 if head_dim <= 128 else 32


@_jit
def _decode_split_kernel(
    q,
    k_cache,
    v_cache,
    req_to_token,
    req_pool_indices,
    seq_lens,
    part_o,
    part_lse,
    qk_scale,  # sm_scale * log2(e): the softmax runs in base 2
    group,  # query heads per kv head
    stride_q_b,
    stride_q_h,
    stride_k_s,
    stride_k_h,
    stride_v_s,
    stride_v_h,
    stride_req,
    window,  # sliding window W (with SLIDING): only the last W keys are attended
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SLIDING: tl.constexpr,
    PDL: tl.constexpr = False,  # kernels/pdl.py
):
    """Stage 1: one (row run, kv head, split); all query heads of the kv head at once.

    A run is up to ``BLOCK_H // group`` consecutive rows of one request at consecutive
    positions (a verify step's rows, ``ForwardBatch.as_decode_rows``): its first row's
    program loads each key block once for all of them, row i of the run masking the keys
    past its own position, and the others' programs return at once. Runs are cut where
    the row index is a multiple of the rows a tile holds, so that every program finds its
    run from its neighbours alone (a replay in pieces included). One row per request (a
    plain decode step, padding rows at length 1) is a run of one: the tile's first
    ``group`` rows, as before.

    The lengths and the table indices are read before PDL's wait: no predecessor writes
    them (the kernel before writes q and the newest key and value). Loading the split's
    first key block then too (all but the newest key) was measured slower on the H200
    (Qwen3-0.6B at 8K, batch 4: 2.08 -> 2.41 ms per step): 255 registers, fewer programs
    resident.
    """
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    batch = tl.num_programs(0)
    offs_n = tl.arange(0, BLOCK_N)
    offs_t = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    k_base = k_cache + kv_head * stride_k_h
    v_base = v_cache + kv_head * stride_v_h
    seq_len = tl.load(seq_lens + b)
    req = tl.load(req_pool_indices + b)
    # the run: this row and the next ones of the same request, one position apart, up to the
    # tile's next multiple of rows (every program computes the same cut)
    per_tile = BLOCK_H // group
    prev = tl.maximum(b - 1, 0)
    leads = (b == 0) | (b % per_tile == 0) | (tl.load(req_pool_indices + prev) != req)
    leads = leads | (tl.load(seq_lens + prev) + 1 != seq_len)
    nxt = b + offs_t
    near = (offs_t > 0) & (offs_t < per_tile - b % per_tile) & (nxt < batch)
    same = (tl.load(req_pool_indices + nxt, mask=near, other=-1) == req) & near
    same = same & (tl.load(seq_lens + nxt, mask=near, other=-1) == seq_len + offs_t)
    run = tl.min(tl.where(same | (offs_t == 0), BLOCK_H, offs_t), 0)  # first row not in it
    if leads:  # (the others' rows: an earlier row's program attends for them)
        # tile row t: the run's row t // group, query head t % group of this kv head
        row_t = offs_t // group
        live_t = row_t < run
        heads = kv_head * group + offs_t % group
        end_t = seq_len + row_t  # each row's keys end at its own position
        start = 0
        start_t = 0
        if SLIDING:
            start = tl.maximum(seq_len - window, 0)
            start_t = tl.maximum(end_t - window, 0)
        # Splits are whole key blocks of the run's keys [start, its last row's end); a split
        # past them (a short sequence's) writes an empty partial (log-sum-exp -1e30).
        last = seq_len + run - 1
        split_len = tl.cdiv(tl.cdiv(last - start, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = start + split * split_len
        hi = tl.minimum(lo + split_len, last)
        tokens = req_to_token + req.to(tl.int64) * stride_req
        pdl.enter(PDL)
        # partial_o [B, H, S, D] and partial_lse [B, H, S], contiguous: split 0's rows
        rows = ((b + row_t).to(tl.int64) * tl.num_programs(1) * group + heads) * NUM_SPLITS + split
        if lo < hi:
            q_ptrs = q + (b + row_t).to(tl.int64)[:, None] * stride_q_b
            q_ptrs = q_ptrs + heads[:, None] * stride_q_h + offs_d[None, :]
            q_tile = tl.load(q_ptrs, mask=live_t[:, None] & mask_d[None, :], other=0.0)
            m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
            l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
            acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
            for n0 in range(lo, hi, BLOCK_N):
                offs = n0 + offs_n
                mask_n = offs < hi
                slots = tl.load(tokens + offs, mask=mask_n, other=0).to(tl.int64)
                # keys as [N, D] rows (each row's D contiguous: vector loads, few registers)
                mask_kv = mask_n[:, None] & mask_d[None, :]
                k_ptrs = k_base + slots[:, None] * stride_k_s + offs_d[None, :]
                k = tl.load(k_ptrs, mask=mask_kv, other=0.0)
                v = tl.load(
                    v_base + slots[:, None] * stride_v_s + offs_d[None, :], mask=mask_kv, other=0.0
                )
                visible = offs[None, :] < end_t[:, None]
                if SLIDING:
                    visible = visible & (offs[None, :] >= start_t[:, None])
                acc, m_i, l_i = _attend_loaded(
                    q_tile, acc, m_i, l_i, tl.trans(k), v, visible, qk_scale, DOT_PRECISION
                )
            # a row of the run whose keys all lie before this split (or past its window) saw none
            seen = l_i > 0
            o_ptrs = part_o + rows[:, None] * HEAD_DIM + offs_d[None, :]
            out = acc / tl.where(seen, l_i, 1.0)[:, None]
            tl.store(o_ptrs, out, mask=live_t[:, None] & mask_d[None, :])
            lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), -1.0e30)
            tl.store(part_lse + rows, lse, mask=live_t)
        else:
            tl.store(part_lse + rows, tl.full([BLOCK_H], -1.0e30, tl.float32), mask=live_t)


@_jit
def _merge_head(
    part_o, part_lse, row0, offs_d, mask_d, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):  # fmt: skip
    """One head's output [BLOCK_D] (fp32): its splits' partials (rows ``row0`` on) merged by
    log-sum-exp (base 2), every split loaded at once (one round trip, not one per split).
    An empty split's log-sum-exp is -1e30 and its output is not read; a row that saw no
    key gives zeros."""
    offs_s = tl.arange(0, BLOCK_S)
    lse = tl.load(
        part_lse + row0 + offs_s, mask=offs_s < NUM_SPLITS, other=-1.0e30, cache_modifier=".cg"
    )
    live = lse > -1.0e29
    part = tl.load(
        part_o + (row0 + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
        mask=live[:, None] & mask_d[None, :], other=0.0, cache_modifier=".cg",
    )  # fmt: skip
    w = tl.math.exp2(lse - tl.max(lse, 0))  # 0 for the empty splits (1 when all are)
    return tl.sum(part * w[:, None], 0) / tl.sum(w, 0)


@_jit
def _decode_reduce_kernel(
    part_o,
    part_lse,
    o,
    stride_o_b,
    stride_o_h,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr = False,  # kernels/pdl.py
):
    """Stage 2: one (row, head); merges the non-empty splits by log-sum-exp (base 2)."""
    pdl.enter(PDL)
    b = tl.program_id(0)
    head = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    row0 = (b.to(tl.int64) * tl.num_programs(1) + head) * NUM_SPLITS
    out = _merge_head(part_o, part_lse, row0, offs_d, mask_d, HEAD_DIM, NUM_SPLITS, BLOCK_S)
    o_ptrs = o + b.to(tl.int64) * stride_o_b + head * stride_o_h + offs_d
    tl.store(o_ptrs, out.to(o.dtype.element_ty), mask=mask_d)


def decode_attention_triton(
    q, o, k_cache, v_cache, meta, sm_scale, num_kv_splits=None, workspace=None, sliding_window=None
) -> None:
    """Triton twin of :func:`decode_attention_torch` (its arguments): split-KV (flash
    decoding), the partials merged by a second launch (one program per head). Inside
    :func:`long_context`, smaller key blocks over more splits (unless ``num_kv_splits``).

    CUDA-graph capturable: the grids depend on the batch size, head counts and
    ``num_kv_splits`` only (default: from the SM count); sequence lengths are read on the
    device. ``workspace`` defaults to a module-wide one, so addresses stay stable. Reads
    the meta's key side only (one query row per request).
    """
    block_n = _decode_block_n(q.shape[-1], q.dtype)
    if _long_context and block_n > LONG_CONTEXT_BLOCK_N:
        block_n, num_kv_splits = LONG_CONTEXT_BLOCK_N, num_kv_splits or LONG_CONTEXT_SPLITS
    _launch_decode(
        q, o, k_cache, v_cache, meta, sm_scale, num_kv_splits, workspace,
        block_n=block_n, num_warps=4, num_stages=2, sliding_window=sliding_window,
    )  # fmt: skip


def _launch_decode(
    q, o, k_cache, v_cache, meta, sm_scale, num_kv_splits, workspace, block_n, num_warps,
    num_stages, sliding_window=None,
) -> None:  # fmt: skip
    batch, num_heads, head_dim = q.shape
    if batch == 0:
        return
    num_kv_heads = k_cache.shape[1]
    assert num_heads % num_kv_heads == 0 and k_cache.shape[2] == head_dim
    assert q.stride(-1) == 1 and o.stride(-1) == 1
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    group = num_heads // num_kv_heads
    splits = num_kv_splits or default_num_kv_splits(batch, num_kv_heads, q.device)
    ws = workspace if workspace is not None else _DEFAULT_WORKSPACE
    part_o, part_lse = ws.get(batch, num_heads, splits, head_dim, q.device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_s = triton.next_power_of_2(splits)  # the merge loads every split at once
    _decode_split_kernel[(batch, num_kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        meta.req_to_token,
        meta.req_pool_indices,
        meta.seq_lens,
        part_o,
        part_lse,
        sm_scale * _LOG2E,
        group,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        meta.req_to_token.stride(0),
        sliding_window or 0,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_H=max(16, triton.next_power_of_2(group)),  # tl.dot needs M >= 16
        BLOCK_N=block_n,
        NUM_SPLITS=splits,
        DOT_PRECISION="tf32x3" if q.dtype == torch.float32 else "tf32",
        SLIDING=sliding_window is not None,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl.launch(q.device),
    )
    _decode_reduce_kernel[(batch, num_heads)](
        part_o,
        part_lse,
        o,
        o.stride(0),
        o.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        NUM_SPLITS=splits,
        BLOCK_S=block_s,
        num_warps=4,  # every split's [D] partial at once: 64 x 128 fp32 over 128 threads
        **pdl.launch(q.device),
    )
