"""Mixture of experts: routing, token->expert alignment, grouped GEMMs, top-k reduction.

The torch twins are HF's arithmetic (a per-expert loop, as ``Qwen3MoeExperts.forward``);
the CPU runs them. On CUDA, :func:`fused_experts_triton` runs the experts in four or five
launches and a memset (one more for an unfused SiLU), whatever the routing:

1. the alignment: up to ``ALIGN_ONE_MAX_ROWS`` rows, ``_moe_align_one_kernel`` does all of
   it in one program; above, ``_moe_count_kernel`` fills ``sorted_ids`` with the sentinel
   and ranks each row within its expert (its block's rows sorted by expert, then one atomic
   per expert per block for the rows of earlier blocks) and ``_moe_place_kernel``: every
   program recomputes the experts' block-padded offsets from the counts (a scan over E),
   places its rows at ``offset[expert] + rank`` and writes the expert of its share of GEMM
   blocks, so each block of ``BLOCK_M`` sorted rows has one expert;
2. ``_moe_gemm_kernel`` (gate/up, SiLU or tanh-GELU and the product fused in the epilogue;
   or, where the config table says it pays, a plain GEMM and then SiLU-and-mul), then again
   (down, each row scaled by its routing weight) into one row per (token, k), by row id or,
   where the table says so (``sorted_y``), at its sorted position, or (``atomic_sum``) added
   into its token's output row (zeroed first) with atomics, and then no sum kernel runs;
3. ``_moe_sum_kernel``: the top-k rows of each token summed in float32 (with ``sorted_y``
   found through the inverse of the sorted order, which the place kernel writes).

Every buffer is sized from the step's token count (a shape, known on the host): the
padded length is bounded by ``M*K + min(E, M*K) * (BLOCK_M - 1)``, blocks past the live
total (a device scalar) exit at once. No host sync, no ``.item()``: capturable in a graph.

A row's result does not depend on which rows share its block, so the counts' atomics
(which rows land where within an expert) change nothing in the output; ``atomic_sum``'s
adds, in the output's dtype, round in the order they land.

Steps of up to ``BREAKGRAPH_MOE_GEMV`` tokens (default 4; 0 turns it off) take
:func:`fused_experts_gemv_triton` instead: two launches, no alignment.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
from torch.nn import functional as F

from breakgraph.common import envs
from breakgraph.kernels import pdl
from breakgraph.kernels.fused import clamped_silu_mul_triton, silu_and_mul_triton
from breakgraph.kernels.launch import sm_count

try:  # Triton is optional: the CPU-only install runs the torch twins
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    triton = None


def _jit(*dynamic: str):
    """``triton.jit`` that does not specialize on the named integer arguments: those that
    follow the step's token count, so a new count never compiles a new variant."""
    if triton is None:
        return lambda fn: fn
    return lambda fn: triton.jit(fn, do_not_specialize=dynamic)


ACTIVATIONS = ("silu", "gelu_tanh")


# ---------------------------------------------------------------------------- torch twins


def moe_route_torch(
    router_logits: torch.Tensor,
    top_k: int,
    scoring: str = "softmax",
    renormalize: bool = True,
    expert_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's routers: scores in float32 (softmax, sigmoid, or DeepSeek V4's sqrt(softplus)),
    top-k (of the scores plus ``bias`` where given: the weights stay the scores), optionally
    renormalized to sum 1, optionally times a per-expert scale (Gemma 4), times ``factor``.
    Returns (weights float32 [M, K], expert ids int32 [M, K])."""
    scores = _scores(router_logits, scoring)
    if bias is None:
        weights, ids = torch.topk(scores, top_k, dim=-1)
    else:
        ids = torch.topk(scores + bias.float(), top_k, dim=-1).indices
        weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if expert_scale is not None:
        weights = weights * expert_scale[ids].float()
    if factor != 1.0:
        weights = weights * factor
    return weights, ids.to(torch.int32)


SCORINGS = ("softmax", "sigmoid", "sqrtsoftplus")


def _scores(
    router_logits: torch.Tensor, scoring: str, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The router's scores in ``dtype`` (float32, as HF computes them)."""
    if scoring == "softmax":
        return torch.softmax(router_logits, dim=-1, dtype=dtype)
    if scoring == "sigmoid":
        return torch.sigmoid(router_logits.to(dtype))
    if scoring == "sqrtsoftplus":
        return torch.sqrt(F.softplus(router_logits.to(dtype)))
    raise ValueError(f"scoring must be one of {SCORINGS}, not {scoring!r}")


def _act(x: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return F.silu(x)
    if activation == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    raise ValueError(f"activation must be one of {ACTIVATIONS}, not {activation!r}")


def fused_experts_torch(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    limit: float | None = None,
) -> torch.Tensor:
    """HF's experts loop: x [M, H], gate_up [E, 2I, H] (gate rows first), down [E, H, I],
    routing [M, K] -> [M, H] in x's dtype. Experts in ascending order, each token's rows
    added into the output as HF does (``index_add_``). ``limit`` L: gate clamped to at most
    L and up to [-L, L] before the activation (DeepSeek V4's clamped SwiGLU)."""
    out = torch.zeros_like(x)
    for expert in torch.unique(topk_ids).tolist():
        token, k = torch.where(topk_ids == expert)
        gate, up = F.linear(x[token], gate_up[expert]).chunk(2, dim=-1)
        if limit is not None:
            gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        h = F.linear(_act(gate, activation) * up, down[expert])
        h = h * topk_weights[token, k, None]
        out.index_add_(0, token, h.to(out.dtype))
    return out


# ---------------------------------------------------------------------------- block sizes


class MoEConfig(NamedTuple):
    """One step's launch config. ``block_m`` is shared by the alignment and both GEMMs;
    each GEMM's (BLOCK_N, BLOCK_K, num_warps, num_stages); ``fuse_act``: the activation and
    product in the gate/up GEMM's epilogue (two accumulators per tile), or a plain GEMM
    writing [rows, 2I] and then SiLU-and-mul (SiLU only: GELU is always fused); ``sorted_h``:
    the gate/up GEMM writes its rows in sorted (expert-grouped, padded) order, so the down
    GEMM reads them contiguously instead of gathering them by row id; ``tma``: the GEMMs load
    their expert weight tiles (and the down GEMM its sorted rows) through Hopper's tensor
    memory accelerator (host-built descriptors), not per-thread pointers; ``sorted_y``: the
    down GEMM writes its rows at their sorted positions too (contiguous tiles, not scattered
    rows) and the top-k sum gathers each token's rows through the inverse order;
    ``persistent``: the GEMMs run about one program per SM, each looping over the live
    tiles (none for padding blocks; a flattened loop overlaps a tile's epilogue with the
    next tile's loads); ``half_tail``: a block whose second half is padding runs a tile of
    half the rows (not with ``persistent``; BLOCK_M >= 32); ``atomic_sum``: the down GEMM
    adds each row into its token's output row with atomics in the output's dtype (as HF's
    ``index_add_`` does, in no fixed order), and no top-k sum runs (``sorted_y`` unread)."""

    block_m: int
    group_m: int
    gate_up: tuple[int, int, int, int]
    down: tuple[int, int, int, int]
    fuse_act: bool = True
    sorted_h: bool = False
    tma: bool = False
    sorted_y: bool = False
    persistent: bool = False
    half_tail: bool = False
    atomic_sum: bool = False


# Launch configs by shape class: the mean rows per expert, M * K / E (the first row whose
# bound is not exceeded). Measured on the H200 (2026-12-01) with qwen3-30b-a3b's expert
# shapes (E 128, top-8, hidden 2048, intermediate 768), each config timed by do_bench of the
# eager layer (paced by the GPU from M = 32 on; M <= 8 is launch-bound either way), by
#   breakgraph bench moe --models qwen3-30b-a3b --tokens 1 8 32 64 256 1024 8192 --sweep
# which prints these rows. Gains over the former
# hand-picked table: 7% at M = 8, 3% at M = 64, 4% at M = 8192. Two rows keep the former
# config: M = 1024 (the sweep's best was within noise) and M = 256 (its best gate/up tile,
# BLOCK_N = BLOCK_K = 128, failed the float32 GPU tests; 3% in bf16). A sweep times bf16
# only, so a new row must pass tests/kernels/test_fused_moe.py in both dtypes before it lands.
# Gemma 4's MoE shapes are not swept; its 704 intermediate columns leave the 128-column
# gate/up tile's last one half idle, yet a 64-column tile measured 1.05-1.10x slower at
# M = 2048-8192 (bench moe --ab gate_up=64,64,8,4). sorted_h (the
# intermediate rows in sorted order) from M = 8192: 1.411 vs 1.550 ms per layer there
# (gate/up 0.838 vs 0.915 ms, down 0.465 vs 0.524), equal at M <= 1024 (``bench moe
# --breakdown``).
# tma (weight tiles, and the down GEMM's sorted rows, through TMA descriptors) from M = 256:
# at M = 8192 the sweep with it (``--sweep --sweep-block-m 128 --sweep-table-flags``) found
# 1.301 ms against the table's 1.587 before it (gate/up 0.832 vs 0.919 ms and down 0.433 vs
# 0.490 with the former tiles); at M = 1024, the same tiles, graph 0.390 vs 0.403 ms. Not in
# the table, measured at M = 8192: sorted_y (the down GEMM's rows sorted, the sum
# gathering them) equal (down 0.417 vs 0.422 ms, sum 0.074 vs 0.072); BLOCK_M 64 with TMA
# (``--sweep --sweep-block-m 64 --sweep-table-flags``) 1.430 ms at best against the table's
# 1.415; storing the sorted h tiles through TMA slowed gate/up 0.748 -> 0.922 ms (removed).
# half_tail (a block whose second half is padding runs a 64-row tile) in the 128-row row:
# the layer's graph replay 0.964-0.975x without it at M = 2048, 4096, 8192 on both MoE
# models (qwen3-30b-a3b 8192: 1.434 vs 1.474 ms against dense 0.974), same process, by
#   breakgraph bench moe --models qwen3-30b-a3b gemma-4-26b-a4b --ab half_tail \
#       --tokens 2048 4096 8192
# not in the 64-row row: equal at M = 1024. The down GEMM on 8 warps (the sweep's best with
# it, 2% in its eager times) was even in graph replay, so the down tile stays.
# atomic_sum (the down GEMM adds each row into its token's output row; no sum kernel) over 4
# and up to 256 mean rows (M = 65 to 4096 at top-8 of 128; the 256 bound splits the 128-row
# tiles' row): the layer's graph replay with it against the sum kernel, qwen3-30b-a3b /
# gemma-4-26b-a4b, ms, same process (bench moe --ab atomic_sum): M = 128 0.328 vs 0.331 / 0.408 vs
# 0.412, 256 0.333 vs 0.337 / 0.415 vs 0.420, 1024 0.388 vs 0.400 / 0.492 vs 0.497, 2048 0.481 vs
# 0.510 / 0.631 vs 0.660, 4096 0.783 vs 0.799 / 1.042 vs 1.038; at 8192 slower (1.440 vs 1.404 /
# 1.877 vs 1.848), at M = 8 and 64 even. One atomic_add per element instead of atomic_sum's 16-byte
# reductions was even up to M = 1024, slower at 2048 (0.495) and 4096 (0.799), about even at 8192
# (1.407).
_CONFIGS = (
    (0.5, MoEConfig(16, 1, (32, 128, 4, 4), (64, 64, 4, 3))),  # decode: under a row per expert
    (2.0, MoEConfig(16, 1, (32, 128, 4, 4), (64, 128, 4, 4))),
    (4.0, MoEConfig(16, 1, (32, 128, 4, 4), (128, 128, 8, 3))),
    (16.0, MoEConfig(32, 4, (64, 64, 4, 4), (64, 64, 4, 4), atomic_sum=True)),
    (96.0, MoEConfig(64, 8, (64, 64, 4, 3), (128, 64, 4, 3), tma=True, atomic_sum=True)),
    (256.0, MoEConfig(128, 8, (128, 64, 8, 4), (128, 64, 4, 3), sorted_h=True, tma=True,
                      half_tail=True, atomic_sum=True)),
    (math.inf, MoEConfig(128, 8, (128, 64, 8, 4), (128, 64, 4, 3), sorted_h=True, tma=True,
                         half_tail=True)),
)  # fmt: skip


def moe_config(num_tokens: int, top_k: int, num_experts: int) -> MoEConfig:
    """The launch config of a step of ``num_tokens`` tokens (host values only). Under
    ``BREAKGRAPH_MOE_ATOMIC_SUM=0`` no config adds with atomics: each token's top-k rows are
    then summed in a fixed order, so a prefill's output is the same bits from run to run."""
    mean_rows = num_tokens * top_k / num_experts
    cfg = next(cfg for bound, cfg in _CONFIGS if mean_rows <= bound)
    return cfg if envs.MOE_ATOMIC_SUM.get() else cfg._replace(atomic_sum=False)


def max_padded_rows(num_rows: int, num_experts: int, block_m: int) -> int:
    """Upper bound of the block-padded sorted length: each non-empty expert (at most
    min(E, rows) of them) pads fewer than BLOCK_M rows."""
    bound = num_rows + min(num_experts, num_rows) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


# ---------------------------------------------------------------------------- Triton: routing


@_jit("num_tokens")
def _moe_route_kernel(
    logits,
    expert_scale,
    topk_weights,
    topk_ids,
    num_tokens,
    num_experts,
    stride_lm,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_T: tl.constexpr,
    SIGMOID: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    bias=None,
    factor=1.0,
    SQRTSOFTPLUS: tl.constexpr = False,
    HAS_BIAS: tl.constexpr = False,
    PDL: tl.constexpr = False,  # kernels/pdl.py
):
    pdl.enter(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < num_tokens
    col_ok = cols < num_experts
    mask = row_ok[:, None] & col_ok[None, :]
    x = tl.load(
        logits + rows[:, None].to(tl.int64) * stride_lm + cols[None, :],
        mask=mask,
        other=-float("inf"),
    ).to(tl.float32)
    if SQRTSOFTPLUS:  # softplus as max(x, 0) + log(1 + exp(-|x|)): no overflow
        p = tl.sqrt(tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x))))
    elif SIGMOID:
        p = 1.0 / (1.0 + tl.exp(-x))
    else:
        x = x - tl.max(x, 1)[:, None]
        ex = tl.where(col_ok[None, :], tl.exp(x), 0.0)
        p = ex / tl.sum(ex, 1)[:, None]
    sel = p
    if HAS_BIAS:  # chosen by score + bias, weighted by the score
        sel = p + tl.load(bias + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    sel = tl.where(col_ok[None, :], sel, -float("inf"))  # never picked
    kcols = tl.arange(0, BLOCK_K)
    w = tl.zeros((BLOCK_T, BLOCK_K), tl.float32)
    ids = tl.zeros((BLOCK_T, BLOCK_K), tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(sel, 1)
        # the lowest index among equal maxima
        idx = tl.min(tl.where(sel == best[:, None], cols[None, :], BLOCK_E), 1)
        # a NaN row matches nothing: keep its ids in range (the align kernels index by them)
        idx = tl.minimum(idx, num_experts - 1)
        if HAS_BIAS:
            best = tl.sum(tl.where(cols[None, :] == idx[:, None], p, 0.0), 1)
        w = tl.where(kcols[None, :] == k, best[:, None], w)
        ids = tl.where(kcols[None, :] == k, idx[:, None], ids)
        sel = tl.where(cols[None, :] == idx[:, None], -float("inf"), sel)
    k_ok = kcols[None, :] < TOP_K
    if RENORMALIZE:
        w = w / tl.sum(tl.where(k_ok, w, 0.0), 1)[:, None]
    if HAS_SCALE:
        w = w * tl.load(expert_scale + ids, mask=k_ok, other=1.0).to(tl.float32)
    w = w * factor
    out = rows[:, None] * TOP_K + kcols[None, :]
    out_mask = row_ok[:, None] & k_ok
    tl.store(topk_weights + out, w, mask=out_mask)
    tl.store(topk_ids + out, ids, mask=out_mask)


def moe_route_triton(
    router_logits, top_k, scoring="softmax", renormalize=True, expert_scale=None, bias=None,
    factor=1.0,
):  # fmt: skip
    """Triton twin of :func:`moe_route_torch` (its arguments): scores, top-k, renormalize,
    scale in one launch; ties go to the lowest expert id."""
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, not {scoring!r}")
    m, e = router_logits.shape
    assert router_logits.stride(-1) == 1 and 0 < top_k <= e
    weights = torch.empty((m, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((m, top_k), dtype=torch.int32, device=router_logits.device)
    if m == 0:
        return weights, ids
    block_e = triton.next_power_of_2(e)
    block_t = max(1, min(64, 4096 // block_e, triton.next_power_of_2(m)))
    _moe_route_kernel[(triton.cdiv(m, block_t),)](
        router_logits,
        router_logits if expert_scale is None else expert_scale,
        weights,
        ids,
        m,
        e,
        router_logits.stride(0),
        TOP_K=top_k,
        BLOCK_K=triton.next_power_of_2(top_k),
        BLOCK_E=block_e,
        BLOCK_T=block_t,
        SIGMOID=scoring == "sigmoid",
        RENORMALIZE=renormalize,
        HAS_SCALE=expert_scale is not None,
        bias=router_logits if bias is None else bias,
        factor=float(factor),
        SQRTSOFTPLUS=scoring == "sqrtsoftplus",
        HAS_BIAS=bias is not None,
        num_warps=4 if block_e <= 256 else 8,
        **pdl.launch(router_logits.device),
    )
    return weights, ids


# ---------------------------------------------------------------------------- Triton: alignment


@_jit()
def _padded_ends(counts, BLOCK_M: tl.constexpr):
    """Each expert's region of the sorted list: its rows padded to BLOCK_M, (start, end)."""
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, 0)
    return end - padded, end


@_jit()
def _rank_in_block(expert, ok, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr):
    """The block's rows sorted by expert: (row within the block, its expert, its rank among
    the block's rows of that expert, whether it is a row) per sorted position, and the
    block's count of each expert. A sort of (expert, row) keys and a scan, no atomics."""
    local = tl.arange(0, BLOCK)
    counts = tl.histogram(expert, BLOCK_E, mask=ok)
    key = tl.sort(tl.where(ok, expert, BLOCK_E) * BLOCK + local)
    live = key < BLOCK_E * BLOCK
    key_expert = tl.minimum(key // BLOCK, BLOCK_E - 1)
    rank = local - tl.gather(tl.cumsum(counts, 0) - counts, key_expert, 0)
    return key % BLOCK, key_expert, rank, live, counts


@_jit()
def _block_owners(expert_ids, end, num_experts, num_blocks, first_block,
                  BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr):  # fmt: skip
    """The expert of GEMM blocks [first_block, + BLOCK_B): the experts ending at or before
    a block's first row are behind it; blocks past the live total get -1 (never read)."""
    blocks = first_block + tl.arange(0, BLOCK_B)
    e = tl.arange(0, BLOCK_E)
    behind = (end[None, :] <= blocks[:, None] * BLOCK_M) & (e[None, :] < num_experts)
    owner = tl.sum(behind.to(tl.int32), 1)
    owner = tl.where(owner < num_experts, owner, -1)
    tl.store(expert_ids + blocks, owner, mask=blocks < num_blocks)


@_jit("num_rows", "num_blocks", "max_padded")
def _moe_align_one_kernel(
    topk_ids,
    sorted_ids,
    expert_ids,
    num_post_padded,
    inverse,
    num_rows,
    num_experts,
    num_blocks,
    max_padded,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_B: tl.constexpr,
    INVERSE: tl.constexpr,
):
    """The whole alignment of up to BLOCK rows in one program: counts, offsets, places."""
    for p0 in range(0, max_padded, BLOCK):  # padding slots name the sentinel row num_rows
        p = p0 + tl.arange(0, BLOCK)
        tl.store(sorted_ids + p, tl.full((BLOCK,), 0, tl.int32) + num_rows, mask=p < max_padded)
    offs = tl.arange(0, BLOCK)
    ok = offs < num_rows
    expert = tl.load(topk_ids + offs, mask=ok, other=0)
    row, key_expert, rank, live, counts = _rank_in_block(expert, ok, BLOCK, BLOCK_E)
    start, end = _padded_ends(counts, BLOCK_M)
    tl.store(num_post_padded, tl.sum(end - start, 0))
    dest = tl.gather(start, key_expert, 0) + rank
    tl.debug_barrier()  # the sentinel stores before the rows' (the same slots)
    tl.store(sorted_ids + dest, row, mask=live)
    if INVERSE:  # each row's sorted position
        tl.store(inverse + row, dest, mask=live)
    for b0 in range(0, num_blocks, BLOCK_B):
        _block_owners(expert_ids, end, num_experts, num_blocks, b0, BLOCK_M, BLOCK_E, BLOCK_B)


@_jit("num_rows")
def _moe_count_kernel(
    topk_ids,
    counts,
    ranks,
    sorted_ids,
    num_rows,
    max_padded,
    BLOCK: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Each row's rank within its expert: its rank within this program's block (a sort),
    after the rows of its expert in the blocks whose atomics came first. One atomic per
    expert per block, not one per row queued on the counters' few L2 lines: at 65K rows
    on an H200 the alignment went from 34.5 to 17.7 µs."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    # padding slots of the sorted list name the sentinel row num_rows (the GEMMs mask it)
    tl.store(sorted_ids + offs, tl.full((BLOCK,), 0, tl.int32) + num_rows, mask=offs < max_padded)
    ok = offs < num_rows
    expert = tl.load(topk_ids + offs, mask=ok, other=0)
    row, key_expert, rank, live, block_counts = _rank_in_block(expert, ok, BLOCK, BLOCK_E)
    e = tl.arange(0, BLOCK_E)
    before = tl.atomic_add(counts + e, block_counts, mask=block_counts > 0, sem="relaxed")
    rank += tl.gather(before, key_expert, 0)
    tl.store(ranks + tl.program_id(0) * BLOCK + row, rank, mask=live)


@_jit("num_rows", "num_blocks")
def _moe_place_kernel(
    topk_ids,
    counts,
    ranks,
    sorted_ids,
    expert_ids,
    num_post_padded,
    inverse,
    num_rows,
    num_experts,
    num_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_B: tl.constexpr,
    INVERSE: tl.constexpr,
):
    """Every program recomputes the experts' offsets from the counts (a scan over E),
    places its rows at ``start[expert] + rank`` and writes its share of blocks' experts."""
    pid = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    start, end = _padded_ends(tl.load(counts + e, mask=e < num_experts, other=0), BLOCK_M)
    if pid == 0:
        tl.store(num_post_padded, tl.sum(end - start, 0))
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    ok = offs < num_rows
    expert = tl.load(topk_ids + offs, mask=ok, other=0)
    dest = tl.gather(start, expert, 0) + tl.load(ranks + offs, mask=ok, other=0)
    tl.store(sorted_ids + dest, offs, mask=ok)
    if INVERSE:  # each row's sorted position
        tl.store(inverse + offs, dest, mask=ok)
    _block_owners(expert_ids, end, num_experts, num_blocks, pid * BLOCK_B, BLOCK_M, BLOCK_E,
                  BLOCK_B)  # fmt: skip


# Up to this many (token, expert) rows, the alignment is one program (one launch, no counts
# to zero); above it, a count and a place kernel, each program a block of 256 to 1024 rows.
ALIGN_ONE_MAX_ROWS = 512


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int, inverse: bool = False):
    """Rows (token * K + k) grouped by expert, each expert padded to ``block_m`` rows.

    Returns (sorted_ids [P] int32, padding rows = M*K; expert_ids [P / block_m] int32, -1
    past the live total; num_post_padded [1] int32, the live total) with P the host bound
    :func:`max_padded_rows`; ``inverse``: and each row's sorted position [M*K] int32.
    """
    num_rows = topk_ids.numel()
    device = topk_ids.device
    padded = max_padded_rows(num_rows, num_experts, block_m)
    num_blocks = padded // block_m
    sorted_ids = torch.empty(padded, dtype=torch.int32, device=device)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=device)
    num_post_padded = torch.empty(1, dtype=torch.int32, device=device)
    inv = torch.empty(num_rows, dtype=torch.int32, device=device) if inverse else sorted_ids
    flat = topk_ids.reshape(-1)
    block_e = triton.next_power_of_2(num_experts)
    block_b = max(16, min(256, 8192 // block_e))
    # power-of-two blocks of a few sizes, so that the serving warm-up's buckets compile all
    if num_rows <= ALIGN_ONE_MAX_ROWS:
        _moe_align_one_kernel[(1,)](
            flat, sorted_ids, expert_ids, num_post_padded, inv, num_rows, num_experts,
            num_blocks, padded, BLOCK_M=block_m, BLOCK_E=block_e,
            BLOCK=max(256, triton.next_power_of_2(num_rows)), BLOCK_B=block_b, INVERSE=inverse,
            num_warps=4,
        )  # fmt: skip
    else:  # >= 8 programs of 256-1024 rows (one program's sort of 2048 rows took 25 µs)
        block = min(1024, max(256, triton.next_power_of_2(triton.cdiv(num_rows, 8))))
        counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
        ranks = torch.empty(num_rows, dtype=torch.int32, device=device)
        _moe_count_kernel[(triton.cdiv(padded, block),)](  # padded >= num_rows
            flat, counts, ranks, sorted_ids, num_rows, padded, BLOCK=block, BLOCK_E=block_e,
            num_warps=4,
        )  # fmt: skip
        grid = max(triton.cdiv(num_rows, block), triton.cdiv(num_blocks, block_b))
        _moe_place_kernel[(grid,)](
            flat, counts, ranks, sorted_ids, expert_ids, num_post_padded, inv, num_rows,
            num_experts, num_blocks, BLOCK_M=block_m, BLOCK_E=block_e, BLOCK=block,
            BLOCK_B=block_b, INVERSE=inverse, num_warps=4,
        )  # fmt: skip
    if inverse:
        return sorted_ids, expert_ids, num_post_padded, inv
    return sorted_ids, expert_ids, num_post_padded


# ---------------------------------------------------------------------------- Triton: GEMMs


@_jit()
def _grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Tile index -> (row block, column block) in grouped order: GROUP_M row blocks at a
    time over every column block, so the row blocks of one expert share its weight tiles in
    L2."""
    group = GROUP_M * num_pid_n
    first_m = (tile // group) * GROUP_M
    size_m = min(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % group) % size_m, (tile % group) // size_m


@_jit()
def _gated(acc, acc_up, c, GELU: tl.constexpr, CLAMP: tl.constexpr, limit):
    """act(gate) * up from the fp32 sums, rounded to ``c``'s element type where the twin
    rounds: gate, up, act(gate), the product (the last by the caller's store). ``CLAMP``:
    DeepSeek V4's SwiGLU, gate clamped to at most ``limit`` and up to [-limit, limit] once
    rounded (``fused.clamped_silu_mul``'s arithmetic)."""
    dtype = c.dtype.element_ty
    g = acc.to(dtype).to(tl.float32)
    up = acc_up.to(dtype).to(tl.float32)
    if CLAMP:
        g = tl.minimum(g, limit).to(dtype).to(tl.float32)
        up = tl.minimum(tl.maximum(up, -limit), limit).to(dtype).to(tl.float32)
    if GELU:  # tanh via exp: tanh(y) = 1 - 2 / (1 + exp(2y))
        y = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        act = 0.5 * g * (2.0 - 2.0 / (1.0 + tl.exp(2.0 * y)))
    else:
        act = g / (1.0 + tl.exp(-g))
    return act.to(dtype).to(tl.float32) * up


@_jit()
def _red_add_v8(ptrs, vals, mask, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``vals`` [BLOCK_M, BLOCK_N] (bfloat16) added at ``ptrs`` [BLOCK_M, BLOCK_N / 8],
    each the address of 8 columns (16-byte aligned), by one vector reduction per 8 columns
    (``red.global.add.noftz.v8``, sm_90): 8x fewer atomics than one per element, and no
    result to wait for."""
    # the columns 8j + i of each row as eight [BLOCK_M, BLOCK_N / 8] tensors (by splits)
    even, odd = tl.split(tl.reshape(vals, (BLOCK_M, BLOCK_N // 8, 4, 2)))
    e04, e26 = tl.split(tl.reshape(even, (BLOCK_M, BLOCK_N // 8, 2, 2)))
    o15, o37 = tl.split(tl.reshape(odd, (BLOCK_M, BLOCK_N // 8, 2, 2)))
    c0, c4 = tl.split(e04)
    c2, c6 = tl.split(e26)
    c1, c5 = tl.split(o15)
    c3, c7 = tl.split(o37)
    args = [ptrs.to(tl.int64, bitcast=True), mask.to(tl.int32)] + [
        h.to(tl.int16, bitcast=True) for h in (c0, c1, c2, c3, c4, c5, c6, c7)
    ]
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p red.global.add.noftz.v8.bf16 [$1], "
        "{$3, $4, $5, $6, $7, $8, $9, $10}; mov.b32 $0, 0; }",
        "=r,l,r,h,h,h,h,h,h,h,h", args, dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@_jit()
def _moe_gemm_tile(pid_m, pid_n, expert_block, a, b, c, topk_weights, sorted_ids, expert_ids,
    num_rows, n_out, k_in, top_k, stride_am, stride_be, stride_bn, stride_bk, stride_cm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, A_PER_TOKEN: tl.constexpr,
    A_SORTED: tl.constexpr, C_SORTED: tl.constexpr, GATED: tl.constexpr, GELU: tl.constexpr,
    MUL_WEIGHT: tl.constexpr, IEEE: tl.constexpr, B_TMA: tl.constexpr = False,
    A_TMA: tl.constexpr = False, C_ATOMIC: tl.constexpr = False, RED_V8: tl.constexpr = False,
    CLAMP: tl.constexpr = False, limit=0.0
):  # fmt: skip
    """One tile of :func:`_moe_gemm_kernel`: row block ``pid_m`` of the sorted rows (in
    units of this tile's BLOCK_M), column block ``pid_n``, the expert of alignment block
    ``expert_block``."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(sorted_ids + offs_m)
    row_ok = rows < num_rows
    expert = tl.load(expert_ids + expert_block).to(tl.int64)
    if A_SORTED:
        a_rows = offs_m
        a_ok = offs_m >= 0  # every sorted position is a row of a
    elif A_PER_TOKEN:
        a_rows = rows // top_k
        a_ok = row_ok
    else:
        a_rows = rows
        a_ok = row_ok
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n_out
    offs_k = tl.arange(0, BLOCK_K)
    if not A_TMA:
        a_ptrs = a + a_rows[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    if B_TMA:
        b_row = expert.to(tl.int32) * (stride_be // stride_bn) + pid_n * BLOCK_N
    else:
        b_ptrs = b + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if GATED:
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        k_ok = offs_k < k_in - k0
        if A_TMA:
            x = a.load([pid_m * BLOCK_M, k0])
        else:
            x = tl.load(a_ptrs, mask=a_ok[:, None] & k_ok[None, :], other=0.0)
        if B_TMA:
            w = b.load([b_row, k0]).T
        else:
            w = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
        if GATED:
            if B_TMA:
                w_up = b.load([b_row + n_out, k0]).T
            else:
                w_up = tl.load(
                    b_ptrs + n_out * stride_bn, mask=k_ok[:, None] & n_ok[None, :], other=0.0
                )
            if IEEE:
                acc_up += tl.dot(x, w_up, input_precision="ieee")
            else:
                acc_up += tl.dot(x, w_up)
        if not A_TMA:
            a_ptrs += BLOCK_K
        if not B_TMA:
            b_ptrs += BLOCK_K * stride_bk

    dtype = c.dtype.element_ty
    if GATED:
        out = _gated(acc, acc_up, c, GELU, CLAMP, limit)
    else:
        out = acc.to(dtype).to(tl.float32)
    if MUL_WEIGHT:
        out = out * tl.load(topk_weights + rows, mask=row_ok, other=0.0)[:, None]
    if C_ATOMIC:  # the top-k sum: each row added into its token's row of c, in c's dtype
        token_row = (rows // top_k)[:, None].to(tl.int64) * stride_cm
        if RED_V8:
            cols8 = pid_n * BLOCK_N + 8 * tl.arange(0, BLOCK_N // 8)
            mask8 = row_ok[:, None] & (cols8 < n_out)[None, :]
            _red_add_v8(c + token_row + cols8[None, :], out.to(dtype), mask8, BLOCK_M, BLOCK_N)
        else:
            mask = row_ok[:, None] & n_ok[None, :]
            tl.atomic_add(c + token_row + offs_n[None, :], out.to(dtype), mask=mask, sem="relaxed")
    elif C_SORTED:
        c_ptrs = c + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, out.to(dtype), mask=n_ok[None, :])
    else:
        c_ptrs = c + rows[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, out.to(dtype), mask=row_ok[:, None] & n_ok[None, :])


@_jit("num_rows")
def _moe_gemm_kernel(
    a,
    a_half,
    b,
    c,
    topk_weights,
    sorted_ids,
    expert_ids,
    num_post_padded,
    num_rows,
    max_padded,
    n_out,
    k_in,
    top_k,
    stride_am,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    A_PER_TOKEN: tl.constexpr,
    A_SORTED: tl.constexpr,
    C_SORTED: tl.constexpr,
    GATED: tl.constexpr,
    GELU: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    IEEE: tl.constexpr,
    B_TMA: tl.constexpr = False,  # b: a descriptor of [E * rows, k_in], [BLOCK_N, BLOCK_K] tiles
    A_TMA: tl.constexpr = False,  # with A_SORTED, a: a descriptor, [BLOCK_M, BLOCK_K] tiles
    PERSISTENT: tl.constexpr = False,  # a grid of about one program per SM looping over tiles
    HALF_TAIL: tl.constexpr = False,  # a block half padding runs a [BLOCK_M / 2, BLOCK_N] tile
    C_ATOMIC: tl.constexpr = False,  # c: [tokens, n_out], each row added into its token's row
    RED_V8: tl.constexpr = False,  # C_ATOMIC by 16-byte vector reductions (sm_90, bf16 c)
    CLAMP: tl.constexpr = False,  # GATED: the clamped SwiGLU (_gated), at ``limit``
    limit=0.0,
):
    """One [BLOCK_M, BLOCK_N] tile of ``c[row] = a[row] @ b[expert].T`` over one expert's
    block of sorted rows. GATED: b holds gate rows [0, n_out) and up rows [n_out, 2 n_out);
    c = act(gate) * up. MUL_WEIGHT: c scaled by the row's routing weight. A_SORTED / C_SORTED:
    a's / c's rows are in sorted order (row i of the tile is sorted position i), not row ids;
    a padding position's c row holds act(0) * 0 or whatever its a row held, and no
    row-id-indexed output ever reads it. Through a descriptor (B_TMA, A_TMA), a tile past
    the tensor's rows or K reads zeros, and one past ``n_out`` (another expert's or the up
    half's rows) lands in columns that are never stored. PERSISTENT: each program loops over
    the live tiles (those of the device's live total, none for padding blocks) in grouped
    order, the loop flattened so that the next tile's loads overlap this one's epilogue.
    HALF_TAIL (not with PERSISTENT): a block whose second half is padding (an expert's last
    block, half the time) runs a tile of its first half only, loading its A rows through
    ``a_half`` (with A_TMA a descriptor of [BLOCK_M / 2, BLOCK_K] tiles; else ``a``), so at
    most BLOCK_M / 2 padding rows per expert cost tensor-core time. Such a block's second
    half of c is not written (C_SORTED); the next GEMM, on the same sorted ids, takes the
    same branch and does not read it."""
    num_pid_n = tl.cdiv(n_out, BLOCK_N)
    if PERSISTENT:
        live_m = tl.load(num_post_padded) // BLOCK_M
        num_tiles = live_m * num_pid_n
        for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=True):
            pid_m, pid_n = _grouped_tile(tile, live_m, num_pid_n, GROUP_M)
            _moe_gemm_tile(pid_m, pid_n, pid_m, a, b, c, topk_weights, sorted_ids, expert_ids,
                num_rows, n_out, k_in, top_k, stride_am, stride_be, stride_bn, stride_bk,
                stride_cm, BLOCK_M, BLOCK_N, BLOCK_K, A_PER_TOKEN, A_SORTED, C_SORTED, GATED,
                GELU, MUL_WEIGHT, IEEE, B_TMA, A_TMA, C_ATOMIC, RED_V8, CLAMP, limit)  # fmt: skip
    else:
        pid_m, pid_n = _grouped_tile(tl.program_id(0), max_padded // BLOCK_M, num_pid_n, GROUP_M)
        if pid_m * BLOCK_M < tl.load(num_post_padded):  # blocks past the live total: nothing
            # an expert's padding rows close its last block, so when the second half's first
            # row is padding, the whole second half is: a tile of the first half does it
            full = True
            if HALF_TAIL:  # (static: without it the half tile is not compiled)
                if tl.load(sorted_ids + pid_m * BLOCK_M + BLOCK_M // 2) >= num_rows:
                    full = False
                    _moe_gemm_tile(2 * pid_m, pid_n, pid_m, a_half, b, c, topk_weights,
                        sorted_ids, expert_ids, num_rows, n_out, k_in, top_k, stride_am,
                        stride_be, stride_bn, stride_bk, stride_cm, BLOCK_M // 2, BLOCK_N,
                        BLOCK_K, A_PER_TOKEN, A_SORTED, C_SORTED, GATED, GELU, MUL_WEIGHT, IEEE,
                        B_TMA, A_TMA, C_ATOMIC, RED_V8, CLAMP, limit)  # fmt: skip
            if full:
                _moe_gemm_tile(pid_m, pid_n, pid_m, a, b, c, topk_weights, sorted_ids,
                    expert_ids, num_rows, n_out, k_in, top_k, stride_am, stride_be, stride_bn,
                    stride_bk, stride_cm, BLOCK_M, BLOCK_N, BLOCK_K, A_PER_TOKEN, A_SORTED,
                    C_SORTED, GATED, GELU, MUL_WEIGHT, IEEE, B_TMA, A_TMA, C_ATOMIC, RED_V8,
                    CLAMP, limit)  # fmt: skip


_SMEM_PIPELINE_BYTES = 200 * 1024  # the pipeline's shared memory, under the H200's 227 KB


def _tma_ok(t: torch.Tensor) -> bool:
    """Whether a TMA descriptor can tile ``t``: contiguous, its base and rows 16-byte
    aligned (else the GEMM loads it through pointers)."""
    return t.is_contiguous() and t.data_ptr() % 16 == 0 and t.shape[-1] * t.element_size() % 16 == 0


@functools.cache
def _sm90(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (9, 0)


def _red_v8_ok(c: torch.Tensor, block_n: int) -> bool:
    """Whether atomic_sum's 16-byte reductions (one per 8 columns, ``red...v8``) can add
    into ``c``: bfloat16 on an sm_90+ GPU, rows of whole 16-byte groups, 16-byte aligned.
    Elsewhere Triton's atomic_add, one per element."""
    return (
        c.is_cuda
        and c.dtype == torch.bfloat16
        and _sm90(c.device)
        and block_n % 8 == 0
        and c.shape[1] % 8 == 0
        and c.stride(0) % 8 == 0
        and c.data_ptr() % 16 == 0
    )


def _launch_gemm(
    a, b, c, topk_weights, align, top_k, n_out, block_m, group_m, cfg, tma=False,
    persistent=False, half_tail=False, **flags,
):  # fmt: skip
    sorted_ids, expert_ids, num_post_padded = align[:3]
    block_n, block_k, warps, stages = cfg
    # the table's tiles are sized for 2-byte inputs: float32 keeps them with fewer stages
    stage_bytes = (block_m + block_n * (2 if flags["GATED"] else 1)) * block_k * a.element_size()
    while stages > 2 and stage_bytes * stages > _SMEM_PIPELINE_BYTES:
        stages -= 1
    max_padded = sorted_ids.shape[0]
    assert a.stride(-1) == 1 and c.stride(-1) == 1
    grid = (max_padded // block_m * triton.cdiv(n_out, block_n),)
    if persistent:  # about one program per SM (the live tiles are a device value); the
        # interpreter runs a few programs, each looping
        grid = (min(grid[0], sm_count(a.device, interpreted=4)),)
    half_tail = half_tail and not persistent and block_m >= 32  # a half tile's dot: >= 16 rows
    a_arg, b_arg = a, b
    tma = tma and _tma_ok(b) and (_tma_ok(a) or not flags["A_SORTED"])
    if tma:  # the weights as one [E * rows, K] matrix; the sorted rows where they are a's
        b_arg = TensorDescriptor.from_tensor(b.view(-1, b.shape[2]), [block_n, block_k])
        if flags["A_SORTED"]:
            a_arg = TensorDescriptor.from_tensor(a, [block_m, block_k])
    if flags.get("C_ATOMIC"):  # 16-byte vector reductions where c allows them
        flags["RED_V8"] = _red_v8_ok(c, block_n)
    a_half = a_arg
    if half_tail and tma and flags["A_SORTED"]:
        a_half = TensorDescriptor.from_tensor(a, [block_m // 2, block_k])
    _moe_gemm_kernel[grid](
        a_arg,
        a_half,
        b_arg,
        c,
        topk_weights,
        sorted_ids,
        expert_ids,
        num_post_padded,
        topk_weights.numel(),
        max_padded,
        n_out,
        b.shape[2],
        top_k,
        a.stride(0),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        c.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_M=group_m,
        IEEE=a.dtype == torch.float32,
        B_TMA=tma,
        A_TMA=tma and flags["A_SORTED"],
        PERSISTENT=persistent,
        HALF_TAIL=half_tail,
        num_warps=warps,
        num_stages=stages,
        **flags,
    )


# ---------------------------------------------------------------------------- Triton: GEMV path
#
# A decode step of a few tokens gives each of its M * K (token, expert) rows a weight matrix of
# its own: the grouped GEMM pads each row to a BLOCK_M tile on the tensor cores behind an
# alignment (count, place) and a top-k sum, five launches for a few rows (at M = 1 on an H200,
# qwen3-30b-a3b's shapes: 0.051-0.053 ms against the 0.018 ms its experts' bytes take to read).
# Here two launches and no alignment: gate/up as one GEMV per (row, column block) on the CUDA
# cores, then down as one per (token, column block) that sums the token's K rows in fp32 itself
# (each rounded, scaled by its weight and rounded again, as the grouped path's down GEMM stores
# it). Steps of up to BREAKGRAPH_MOE_GEMV tokens take it (0 turns it off). Measured on an H200
# (bench decode --variants, one process), the decode step on it against the grouped path:
# batch 1 0.862x (qwen3-30b-a3b) and 0.925x (gemma-4-26b-a4b), batch 2 0.900x / 0.956x
# (--variants moegemv0 base), batch 3 0.954x / 0.946x and batch 4 0.946x / 0.947x (--variants
# base moegemv4, its kernels under PDL); at 8 tokens the layer alone is 0.99-1.04x the grouped
# one, so 4 is the default. The route and GEMV kernels take part in programmatic dependent
# launch (kernels/pdl.py) inside small decode graphs; the grouped path's kernels under it
# measured 0.98-1.02x at batch 3-4, so they launch plainly.


class MoEGemvConfig(NamedTuple):
    """(BLOCK_N, BLOCK_K, num_warps) of the gate/up GEMV and of the down GEMV."""

    gate_up: tuple[int, int, int] = (4, 1024, 2)
    down: tuple[int, int, int] = (8, 1024, 2)


# (up to M tokens, config), each kernel timed alone as a graph of launches on distinct experts
# (an H200, 2026-12-02, µs per launch, qwen3-30b-a3b / gemma-4-26b-a4b against the former
# table's (4, 1024, 2-4) / (8, 1024, 2) rows):
#   breakgraph bench moe --models qwen3-30b-a3b gemma-4-26b-a4b --tokens 1 2 4 8 --gemv-kernels
# M = 1: gate/up 14.35 / 18.02 (was 14.44 / 19.98), down 10.43 / 11.92 (11.83 / 13.46);
# M = 2: gate/up 25.74 / 32.43 (26.08 / 34.09), down 17.70 / 20.50 (18.22 / 21.08);
# M = 4: gate/up 48.30 / 61.23 (48.40 / 61.78), down 30.90 / 36.31 (36.16 / 38.38);
# M = 8: gate/up 93.60 / 117.22 (kept), down 53.84 / 69.23 (80.98 / 105.89).
# Each row is the config best for both models together (each one's own best is <= 7% faster).
# The decode step at batch 8 on the path with each model's own bests measured 0.978x /
# 0.990x the grouped path's (bench decode --variants base moegemv8
# moegemv8+moetable=...), too close to move BREAKGRAPH_MOE_GEMV's default past 4.
GEMV_TABLE: tuple[tuple[int, MoEGemvConfig], ...] = (
    (1, MoEGemvConfig(gate_up=(1, 1024, 1), down=(1, 256, 1))),
    (2, MoEGemvConfig(gate_up=(1, 512, 1), down=(2, 256, 1))),
    (4, MoEGemvConfig(gate_up=(1, 512, 1), down=(16, 256, 8))),
    (8, MoEGemvConfig(down=(2, 256, 2))),
)
GEMV_CONFIG: MoEGemvConfig | None = None  # one config at every M (the benches' searches)


def gemv_config(m: int) -> MoEGemvConfig:
    """The GEMV path's config for a step of ``m`` tokens."""
    if GEMV_CONFIG is not None:
        return GEMV_CONFIG
    return next((cfg for bound, cfg in GEMV_TABLE if m <= bound), GEMV_TABLE[-1][1])


@_jit()
def _moe_gemv_gate_up_kernel(
    x,
    w,
    h,
    topk_ids,
    inter,
    hidden,
    stride_xm,
    stride_we,
    stride_wn,
    stride_hm,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_CHUNKS: tl.constexpr,
    GELU: tl.constexpr,
    CLAMP: tl.constexpr = False,  # clamped SwiGLU (_gated), at ``limit``
    limit=0.0,
    PDL: tl.constexpr = False,  # kernels/pdl.py
):
    """h[row] = act(x[token] G^T) * (x[token] U^T) for row = token * TOP_K + k over its
    expert's gate rows G and up rows U: BLOCK_N columns per program, fp32 sums; the K chunks
    unrolled (straight-line code: every chunk's loads may be in flight at once)."""
    pdl.enter(PDL)
    row = tl.program_id(0)
    token = row // TOP_K
    expert = tl.load(topk_ids + row).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    gate_rows = w + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
    up_rows = gate_rows + inter * stride_wn
    acc = tl.zeros((BLOCK_N,), tl.float32)
    acc_up = tl.zeros((BLOCK_N,), tl.float32)
    for c in tl.static_range(K_CHUNKS):
        ks = c * BLOCK_K + offs_k
        k_ok = ks < hidden
        xk = tl.load(x + token * stride_xm + ks, mask=k_ok, other=0.0).to(tl.float32)
        mask = n_ok[:, None] & k_ok[None, :]
        g = tl.load(gate_rows + ks[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(up_rows + ks[None, :], mask=mask, other=0.0).to(tl.float32)
        acc += tl.sum(g * xk[None, :], 1)
        acc_up += tl.sum(u * xk[None, :], 1)
    out = _gated(acc, acc_up, h, GELU, CLAMP, limit)
    tl.store(h + row * stride_hm + offs_n, out.to(h.dtype.element_ty), mask=n_ok)


@_jit()
def _moe_gemv_down_kernel(
    h,
    w,
    topk_weights,
    topk_ids,
    out,
    hidden,
    inter,
    stride_hm,
    stride_we,
    stride_wn,
    stride_om,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_CHUNKS: tl.constexpr,
    PDL: tl.constexpr = False,  # kernels/pdl.py
):
    """out[token] = the sum over its K rows of weight * (h[row] D^T) over the row's expert's
    down rows D: BLOCK_N columns per program; the rows and K chunks unrolled."""
    pdl.enter(PDL)
    token = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    dtype = out.dtype.element_ty
    total = tl.zeros((BLOCK_N,), tl.float32)
    for k in tl.static_range(TOP_K):
        row = token * TOP_K + k
        expert = tl.load(topk_ids + row).to(tl.int64)
        rows = w + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
        acc = tl.zeros((BLOCK_N,), tl.float32)
        for c in tl.static_range(K_CHUNKS):
            ks = c * BLOCK_K + offs_k
            k_ok = ks < inter
            hk = tl.load(h + row * stride_hm + ks, mask=k_ok, other=0.0).to(tl.float32)
            d = tl.load(rows + ks[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc += tl.sum(d.to(tl.float32) * hk[None, :], 1)
        y = acc.to(dtype).to(tl.float32) * tl.load(topk_weights + row)
        total += y.to(dtype).to(tl.float32)
    tl.store(out + token * stride_om + offs_n, total.to(dtype), mask=n_ok)


def fused_experts_gemv_triton(
    x, gate_up, down, topk_weights, topk_ids, activation="silu", cfg=None, limit=None
):
    """The experts of a few tokens in two launches (the GEMV path's note above); the inputs
    as :func:`fused_experts_triton` takes them (the weights' rows unit-strided), ``cfg`` a
    :class:`MoEGemvConfig` (default: :func:`gemv_config`'s)."""
    x = x.contiguous()
    cfg = cfg or gemv_config(x.shape[0])
    assert gate_up.stride(2) == 1 and down.stride(2) == 1
    ids = topk_ids.to(torch.int32).contiguous()
    h = gemv_gate_up(x, gate_up, ids, cfg.gate_up, activation, limit)
    return gemv_down(h, down, topk_weights.float().contiguous(), ids, cfg.down)


def gemv_gate_up(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    ids: torch.Tensor,
    cfg: tuple[int, int, int],
    activation: str = "silu",
    limit: float | None = None,
) -> torch.Tensor:
    """The GEMV path's first launch: act(gate) * up of each (token, expert) row, [M * K, I];
    ``x`` contiguous, ``ids`` int32 [M, K], ``cfg`` (BLOCK_N, BLOCK_K, num_warps); ``limit``:
    the clamped SwiGLU's."""
    m, hidden = x.shape
    inter = gate_up.shape[1] // 2
    top_k = ids.shape[1]
    h = torch.empty((m * top_k, inter), dtype=x.dtype, device=x.device)
    bn, bk, warps = cfg
    bk = min(bk, triton.next_power_of_2(hidden))
    _moe_gemv_gate_up_kernel[(m * top_k, triton.cdiv(inter, bn))](
        x, gate_up, h, ids, inter, hidden, x.stride(0), gate_up.stride(0), gate_up.stride(1),
        h.stride(0), TOP_K=top_k, BLOCK_N=bn, BLOCK_K=bk, K_CHUNKS=triton.cdiv(hidden, bk),
        GELU=activation == "gelu_tanh", CLAMP=limit is not None,
        limit=0.0 if limit is None else float(limit), num_warps=warps, **pdl.launch(x.device),
    )  # fmt: skip
    return h


def gemv_down(
    h: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    cfg: tuple[int, int, int],
) -> torch.Tensor:
    """The GEMV path's second launch: each token's K rows of ``h`` through their experts'
    down weights, scaled by ``weights`` (float32 [M, K]) and summed, [M, hidden]."""
    m, top_k = ids.shape
    _, hidden, inter = down.shape
    out = torch.empty((m, hidden), dtype=h.dtype, device=h.device)
    bn, bk, warps = cfg
    bk = min(bk, triton.next_power_of_2(inter))
    _moe_gemv_down_kernel[(m, triton.cdiv(hidden, bn))](
        h, down, weights, ids, out, hidden, inter, h.stride(0), down.stride(0), down.stride(1),
        out.stride(0), TOP_K=top_k, BLOCK_N=bn, BLOCK_K=bk, K_CHUNKS=triton.cdiv(inter, bk),
        num_warps=warps, **pdl.launch(h.device),
    )  # fmt: skip
    return out


# ---------------------------------------------------------------------------- Triton: reduction


@_jit()
def _moe_sum_kernel(
    rows,
    inverse,
    out,
    hidden,
    stride_r,
    stride_o,
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
    SORTED: tl.constexpr,
):
    """out[token] = the sum of its TOP_K rows: rows token * TOP_K + k, or (SORTED) the rows
    at those rows' sorted positions."""
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < hidden
    acc = tl.zeros((BLOCK,), tl.float32)
    for k in tl.static_range(TOP_K):
        if SORTED:
            row = tl.load(inverse + token * TOP_K + k).to(tl.int64)
        else:
            row = token * TOP_K + k
        acc += tl.load(rows + row * stride_r + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out + token * stride_o + offs, acc.to(out.dtype.element_ty), mask=ok)


def fused_experts_triton(x, gate_up, down, topk_weights, topk_ids, activation="silu", limit=None):
    """Triton twin of :func:`fused_experts_torch` (its arguments; float32 top-k sum, one
    rounding). Capturable on CUDA: no host sync, buffers sized by the token count. With
    ``limit`` (clamped SwiGLU) both paths clamp in the gate/up GEMM's epilogue (where the
    table unfuses the activation, a kernel of its own clamps and multiplies)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, not {activation!r}")
    if limit is not None and activation != "silu":
        raise ValueError(f"a clamped gate (limit) is SwiGLU's: activation silu, not {activation!r}")
    m, hidden = x.shape
    num_experts, two_inter, _ = gate_up.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    assert gate_up.shape[2] == hidden and down.shape == (num_experts, hidden, inter)
    x = x.contiguous()  # before out: the sum kernel writes rows of contiguous hidden
    gemv_ok = gate_up.stride(2) == 1 and down.stride(2) == 1
    if 0 < m <= envs.MOE_GEMV.get() and gemv_ok:
        return fused_experts_gemv_triton(
            x, gate_up, down, topk_weights, topk_ids, activation, limit=limit
        )
    out = torch.empty_like(x)
    if m == 0:
        return out
    topk_weights = topk_weights.float().contiguous()
    cfg = moe_config(m, top_k, num_experts)
    block_m, group_m = cfg.block_m, cfg.group_m
    sorted_y = cfg.sorted_y and not cfg.atomic_sum
    align = moe_align(topk_ids.to(torch.int32).contiguous(), num_experts, block_m, inverse=sorted_y)
    rows = m * top_k
    padded = align[0].shape[0]
    h_rows = padded if cfg.sorted_h else rows
    gelu = activation == "gelu_tanh"
    where = dict(A_SORTED=False, C_SORTED=cfg.sorted_h)
    if cfg.fuse_act or gelu:
        h = torch.empty((h_rows, inter), dtype=x.dtype, device=x.device)
        clamp = {} if limit is None else dict(CLAMP=True, limit=float(limit))
        _launch_gemm(
            x, gate_up, h, topk_weights, align, top_k, inter, block_m, group_m, cfg.gate_up,
            A_PER_TOKEN=True, GATED=True, GELU=gelu, MUL_WEIGHT=False, tma=cfg.tma,
            persistent=cfg.persistent, half_tail=cfg.half_tail, **where, **clamp,
        )  # fmt: skip
    else:
        h2 = torch.empty((h_rows, 2 * inter), dtype=x.dtype, device=x.device)
        _launch_gemm(
            x, gate_up, h2, topk_weights, align, top_k, 2 * inter, block_m, group_m, cfg.gate_up,
            A_PER_TOKEN=True, GATED=False, GELU=False, MUL_WEIGHT=False, tma=cfg.tma,
            persistent=cfg.persistent, half_tail=cfg.half_tail, **where,
        )  # fmt: skip
        if limit is None:
            h = silu_and_mul_triton(h2)
        else:
            gate, up = h2.chunk(2, dim=-1)
            h = clamped_silu_mul_triton(gate, up, limit)
    if cfg.atomic_sum:  # the down GEMM sums each token's rows into out itself
        out.zero_()
        y = out
    else:
        y = torch.empty((padded if sorted_y else rows, hidden), dtype=x.dtype, device=x.device)
    _launch_gemm(
        h, down, y, topk_weights, align, top_k, hidden, block_m, group_m, cfg.down,
        A_PER_TOKEN=False, A_SORTED=cfg.sorted_h, C_SORTED=sorted_y, GATED=False,
        GELU=False, MUL_WEIGHT=True, tma=cfg.tma, persistent=cfg.persistent,
        half_tail=cfg.half_tail, C_ATOMIC=cfg.atomic_sum,
    )  # fmt: skip
    if cfg.atomic_sum:
        return out
    block = min(1024, triton.next_power_of_2(hidden))
    inverse = align[3] if sorted_y else align[0]  # (unread without sorted_y)
    _moe_sum_kernel[(m, triton.cdiv(hidden, block))](
        y, inverse, out, hidden, y.stride(0), out.stride(0), TOP_K=top_k, BLOCK=block,
        SORTED=sorted_y, num_warps=4,
    )  # fmt: skip
    return out
