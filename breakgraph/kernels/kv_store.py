"""KV store: write the new tokens' k and v rows into their slots of the paged pool."""

from __future__ import annotations

from typing import NamedTuple

import torch

from breakgraph.kernels import pdl

try:  # Triton is optional: the CPU-only install runs the torch twin
    import triton
    import triton.language as tl
except ImportError:
    triton = None

_jit = triton.jit if triton is not None else (lambda fn: fn)


class KVWrite(NamedTuple):
    """Where a kernel that produces a layer's new k rows also stores them: k into
    ``k_cache[slots]``, ``v`` [T, Hkv, D] into ``v_cache[slots]`` (the fused RoPE kernels)."""

    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slots: torch.Tensor


def store_kv_torch(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """k_cache/v_cache [num_slots, kv_heads, head_dim]; k/v [T, kv_heads, head_dim]; slots [T].

    Padding rows carry slot 0, which is reserved and never read as real KV.
    """
    k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.to(v_cache.dtype))


@_jit
def _store_kv_kernel(
    k_cache,
    v_cache,
    slots,
    k,
    v,
    stride_kc_s,
    stride_kc_h,
    stride_vc_s,
    stride_vc_h,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    HEAD_DIM: tl.constexpr,
    ROW: tl.constexpr,  # kv_heads * head_dim
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,  # kernels/pdl.py
):
    pdl.enter(PDL)
    t = tl.program_id(0)
    slot = tl.load(slots + t).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < ROW
    h = offs // HEAD_DIM
    d = offs % HEAD_DIM
    t64 = t.to(tl.int64)
    kx = tl.load(k + t64 * stride_k_t + h * stride_k_h + d, mask=mask)
    vx = tl.load(v + t64 * stride_v_t + h * stride_v_h + d, mask=mask)
    tl.store(
        k_cache + slot * stride_kc_s + h * stride_kc_h + d,
        kx.to(k_cache.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        v_cache + slot * stride_vc_s + h * stride_vc_h + d,
        vx.to(v_cache.dtype.element_ty),
        mask=mask,
    )


def store_kv_triton(k_cache, v_cache, slots, k, v) -> None:
    """Triton twin of :func:`store_kv_torch` (its arguments): one launch writes both k and v.

    k/v may be strided views (e.g. slices of a fused qkv output) as long as the last dim is
    contiguous. Several padding rows may write slot 0 concurrently; its content is garbage.
    """
    num_tokens, kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    row = kv_heads * head_dim
    block = min(triton.next_power_of_2(row), 2048)
    grid = (num_tokens, triton.cdiv(row, block))
    _store_kv_kernel[grid](
        k_cache,
        v_cache,
        slots,
        k,
        v,
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        HEAD_DIM=head_dim,
        ROW=row,
        BLOCK=block,
        num_warps=4,
        **pdl.launch(k.device),
    )
