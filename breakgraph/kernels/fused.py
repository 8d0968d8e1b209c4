"""Fused elementwise kernels (RMSNorm, residual add + RMSNorm, SiLU-and-mul, RoPE) and their twins.

The twins follow HF transformers' arithmetic step by step, including where it rounds to
the activation dtype; the Triton kernels round at the same points (FMA contraction off),
so bf16 outputs match to the last bit but for rare ties of fp32 reduction order.
"""

from __future__ import annotations

import torch

try:  # Triton is optional: the CPU-only install runs the torch twins
    import triton
    import triton.language as tl
except ImportError:
    triton = None

_jit = triton.jit if triton is not None else (lambda fn: fn)


# ---------------------------------------------------------------------------- torch twins


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: normalize in fp32, cast back to x's dtype, then scale by weight."""
    input_dtype = x.dtype
    h = x.float()
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


def fused_add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``new_residual = x + residual`` (HF's ``residual + hidden_states``, in the input dtype);
    returns ``(rms_norm(new_residual), new_residual)``. The inputs are not modified."""
    new_residual = x + residual
    return rms_norm_torch(new_residual, weight, eps), new_residual


def silu_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I]: ``silu(gate) * up`` in the input dtype, gate the first half."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF ``apply_rotary_pos_emb`` on x [T, H, D] with cos/sin [T, D], in x's dtype (cos/sin
    cast to it); a new tensor."""
    c, s = cos.to(x.dtype)[:, None, :], sin.to(x.dtype)[:, None, :]
    return x * c + _rotate_half(x) * s


def rope_torch(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`apply_rope_torch` on q [T, H, D] and k [T, Hkv, D]; new tensors."""
    return apply_rope_torch(q, cos, sin), apply_rope_torch(k, cos, sin)


def qk_norm_rope_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3: per-head RMSNorm of q and k (weights [D]), then RoPE; returns new tensors."""
    return rope_torch(rms_norm_torch(q, q_weight, eps), rms_norm_torch(k, k_weight, eps), cos, sin)


# ---------------------------------------------------------------------------- Triton


def _row_warps(block: int) -> int:
    return 4 if block <= 2048 else (8 if block <= 8192 else 16)


@_jit
def _rms_norm_kernel(
    x,
    residual,
    weight,
    out,
    res_out,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    h = tl.load(x + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual + row * stride_r + offs, mask=mask, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(r.dtype)  # one rounding, as torch's add
        tl.store(res_out + row * stride_ro + offs, h, mask=mask)
    hf = h.to(tl.float32)
    variance = tl.sum(hf * hf, 0) / n_cols
    normed = (hf * tl.rsqrt(variance + eps)).to(h.dtype)
    w = tl.load(weight + offs, mask=mask, other=0.0)
    y = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out + row * stride_o + offs, y.to(out.dtype.element_ty), mask=mask)


def _launch_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(normed, new_residual or None); one program per row of the last dim."""
    shape = x.shape
    n_cols = shape[-1]
    x2 = x.reshape(-1, n_cols)
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    r2 = x2 if residual is None else residual.reshape(-1, n_cols)
    res_out = None if residual is None else torch.empty(r2.shape, dtype=r2.dtype, device=x.device)
    rows = x2.shape[0]
    if rows == 0:
        return out.view(shape), None if res_out is None else res_out.view(shape)
    assert x2.stride(-1) == 1 and r2.stride(-1) == 1 and weight.is_contiguous()
    block = triton.next_power_of_2(n_cols)
    _rms_norm_kernel[(rows,)](
        x2,
        r2,
        weight,
        out,
        x2 if res_out is None else res_out,  # unused without a residual
        x2.stride(0),
        r2.stride(0),
        out.stride(0),
        out.stride(0) if res_out is None else res_out.stride(0),
        n_cols,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=_row_warps(block),
        enable_fp_fusion=False,  # no FMA contraction: round where the twin rounds
    )
    return out.view(shape), None if res_out is None else res_out.view(shape)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton twin of :func:`rms_norm_torch` (over the last dim, one program per row)."""
    return _launch_rms_norm(x, None, weight, eps)[0]


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`fused_add_rms_norm_torch`: both outputs from one launch."""
    assert residual.dtype == x.dtype and residual.shape == x.shape
    return _launch_rms_norm(x, residual, weight, eps)


@_jit
def _silu_and_mul_kernel(gate_up, out, stride_in, stride_out, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    gate = tl.load(gate_up + row * stride_in + offs, mask=mask, other=0.0)
    up = tl.load(gate_up + row * stride_in + n_cols + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # torch's silu, rounded to the dtype
    y = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out + row * stride_out + offs, y.to(out.dtype.element_ty), mask=mask)


def silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """Triton twin of :func:`silu_and_mul_torch`."""
    shape = gate_up.shape
    n_cols = shape[-1] // 2
    x = gate_up.reshape(-1, shape[-1])
    out = torch.empty((x.shape[0], n_cols), dtype=gate_up.dtype, device=gate_up.device)
    if x.shape[0] == 0:
        return out.view(*shape[:-1], n_cols)
    assert x.stride(-1) == 1
    block = min(1024, triton.next_power_of_2(n_cols))
    grid = (x.shape[0], triton.cdiv(n_cols, block))
    _silu_and_mul_kernel[grid](
        x, out, x.stride(0), out.stride(0), n_cols, BLOCK=block, num_warps=4, enable_fp_fusion=False
    )
    return out.view(*shape[:-1], n_cols)


@_jit
def _norm_rope_heads(
    x,  # this token's first head
    out,
    weight,
    cos,  # this token's cos/sin rows
    sin,
    stride_h,
    stride_oh,
    head0,
    num_heads,
    eps,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    """Norm (optional) and rotate_half RoPE of heads head0 .. head0 + BLOCK_H of one token."""
    HALF: tl.constexpr = HEAD_DIM // 2
    offs_h = head0 + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    mask = (offs_h < num_heads)[:, None] & mask_d[None, :]
    ptrs = x + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(ptrs, mask=mask, other=0.0)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0)
    odt = out.dtype.element_ty
    if HAS_NORM:
        f1 = x1.to(tl.float32)
        f2 = x2.to(tl.float32)
        variance = (tl.sum(f1 * f1, 1) + tl.sum(f2 * f2, 1)) / HEAD_DIM
        rstd = tl.rsqrt(variance + eps)[:, None]
        w1 = tl.load(weight + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(weight + HALF + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
        x1 = (w1 * (f1 * rstd).to(x1.dtype).to(tl.float32)).to(odt)
        x2 = (w2 * (f2 * rstd).to(x2.dtype).to(tl.float32)).to(odt)
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    c1 = tl.load(cos + offs_d, mask=mask_d, other=0.0).to(odt).to(tl.float32)[None, :]
    c2 = tl.load(cos + HALF + offs_d, mask=mask_d, other=0.0).to(odt).to(tl.float32)[None, :]
    s1 = tl.load(sin + offs_d, mask=mask_d, other=0.0).to(odt).to(tl.float32)[None, :]
    s2 = tl.load(sin + HALF + offs_d, mask=mask_d, other=0.0).to(odt).to(tl.float32)[None, :]
    # x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]; each product is rounded
    # to the dtype before the sum, as in the torch twin.
    o1 = (a1 * c1).to(odt).to(tl.float32) - (a2 * s1).to(odt).to(tl.float32)
    o2 = (a2 * c2).to(odt).to(tl.float32) + (a1 * s2).to(odt).to(tl.float32)
    out_ptrs = out + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptrs, o1.to(odt), mask=mask)
    tl.store(out_ptrs + HALF, o2.to(odt), mask=mask)


@_jit
def _qk_norm_rope_kernel(
    q,
    k,
    q_out,
    k_out,
    q_weight,
    k_weight,
    cos,
    sin,
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    stride_qo_t,
    stride_qo_h,
    stride_ko_t,
    stride_ko_h,
    stride_cos,
    stride_sin,
    num_q_heads,
    num_k_heads,
    eps,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)  # head blocks: q's first, then k's
    q_blocks = tl.cdiv(num_q_heads, BLOCK_H)
    cos_t = cos + t * stride_cos
    sin_t = sin + t * stride_sin
    if hb < q_blocks:
        _norm_rope_heads(
            q + t * stride_q_t, q_out + t * stride_qo_t, q_weight, cos_t, sin_t,
            stride_q_h, stride_qo_h, hb * BLOCK_H, num_q_heads, eps,
            HEAD_DIM, BLOCK_H, BLOCK_HALF, HAS_NORM,
        )  # fmt: skip
    else:
        _norm_rope_heads(
            k + t * stride_k_t, k_out + t * stride_ko_t, k_weight, cos_t, sin_t,
            stride_k_h, stride_ko_h, (hb - q_blocks) * BLOCK_H, num_k_heads, eps,
            HEAD_DIM, BLOCK_H, BLOCK_HALF, HAS_NORM,
        )  # fmt: skip


def _launch_qk_rope(q, k, q_weight, k_weight, eps, cos, sin):
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    assert head_dim % 2 == 0 and k.shape[2] == head_dim and cos.shape[-1] == head_dim
    has_norm = q_weight is not None
    q_dtype = torch.promote_types(q_weight.dtype, q.dtype) if has_norm else q.dtype
    k_dtype = torch.promote_types(k_weight.dtype, k.dtype) if has_norm else k.dtype
    q_out = torch.empty(q.shape, dtype=q_dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k_dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    for t in (q, k, cos, sin):
        assert t.stride(-1) == 1
    block_half = triton.next_power_of_2(head_dim // 2)
    block_h = max(1, min(triton.next_power_of_2(max(num_q_heads, num_k_heads)), 4096 // block_half))
    grid = (num_tokens, triton.cdiv(num_q_heads, block_h) + triton.cdiv(num_k_heads, block_h))
    _qk_norm_rope_kernel[grid](
        q,
        k,
        q_out,
        k_out,
        q_weight if has_norm else q,  # unused without the norm
        k_weight if has_norm else k,
        cos,
        sin,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        cos.stride(0),
        sin.stride(0),
        num_q_heads,
        num_k_heads,
        eps,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        HAS_NORM=has_norm,
        num_warps=4,
        # Without this, LLVM contracts x*cos - rotate_half(x)*sin into one bf16 FMA and
        # skips the rounding of a product that HF (and the twin) performs.
        enable_fp_fusion=False,
    )
    return q_out, k_out


def rope_triton(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`rope_torch`: one launch for q and k."""
    return _launch_qk_rope(q, k, None, None, 0.0, cos, sin)


def qk_norm_rope_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`qk_norm_rope_torch`: one launch for q and k."""
    assert q_weight.is_contiguous() and k_weight.is_contiguous()
    return _launch_qk_rope(q, k, q_weight, k_weight, eps, cos, sin)
