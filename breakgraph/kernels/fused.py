"""Fused elementwise kernels (RMSNorm, residual add + RMSNorm, SiLU/GELU-and-mul, RoPE) and their twins.

Two RMSNorm flavours: Llama's (normalize in fp32, round, then scale by the weight) and Gemma's
(normalize and scale in fp32, round once; optionally no weight, and optionally added to a
residual afterwards: Gemma's norms sit after their sublayer).

The twins follow HF transformers' arithmetic step by step, including where it rounds to
the activation dtype; the Triton kernels round at the same points (FMA contraction off),
so bf16 outputs match to the last bit but for rare ties of fp32 reduction order.
"""

from __future__ import annotations

import torch

from breakgraph.kernels import pdl
from breakgraph.kernels.kv_store import KVWrite, store_kv_torch, store_kv_triton

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
    """[..., 2I] -> [..., I]: ``silu(gate) * up`` in the input dtype, gate the first half."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def gelu_tanh_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] -> [..., I]: ``gelu_tanh(gate) * up`` in the input dtype, gate the first half
    (Gemma's GeGLU)."""
    return gelu_tanh_mul_torch(*gate_up.chunk(2, dim=-1))


def gelu_tanh_mul_torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` of two [T, I] tensors, in their dtype."""
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


def clamped_silu_mul_torch(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """DeepSeek V4's clamped SwiGLU: ``silu(gate clamped to at most L) * (up clamped to
    [-L, L])`` in the input dtype (HF's arithmetic)."""
    return torch.nn.functional.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def gemma_rms_norm_torch(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """HF Gemma4RMSNorm over the last dim (normalized and scaled in fp32, cast back once; no
    scale without a weight); with ``residual``, ``residual + norm(x)`` (a sublayer's
    post-norm and the residual add after it), then times ``scale`` (one element) if given
    (a Gemma 4 layer's ``layer_scalar``)."""
    h = x.float()
    # torch.pow as HF writes it (ATen computes pow(x, -0.5) as rsqrt, as the kernels do)
    h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        h = h * weight.float()
    h = h.type_as(x)
    if residual is not None:
        h = residual + h
    return h if scale is None else h * scale


def unweighted_rms_norm_torch(x: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's DeepseekV4UnweightedRMSNorm over the last dim: the scale computed in float32,
    rounded to x's dtype and applied there."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF ``apply_rotary_pos_emb`` on x [T, H, D] with cos/sin [T, D], in x's dtype (cos/sin
    cast to it); a new tensor."""
    c, s = cos.to(x.dtype)[:, None, :], sin.to(x.dtype)[:, None, :]
    return x * c + _rotate_half(x) * s


def rope_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    store: KVWrite | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`apply_rope_torch` on q [T, H, D] and k [T, Hkv, D]; new tensors. With
    ``store``, k and ``store.v`` go to the KV cache and k is not returned (None)."""
    return _stored(apply_rope_torch(q, cos, sin), apply_rope_torch(k, cos, sin), store)


def _stored(q: torch.Tensor, k: torch.Tensor | None, store: KVWrite | None):
    if store is None or k is None:
        return q, k
    store_kv_torch(store.k_cache, store.v_cache, store.slots, k, store.v)
    return q, None


def qk_norm_rope_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    store: KVWrite | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Qwen3: per-head RMSNorm of q and k (weights [D]), then RoPE; returns new tensors
    (k stored instead with ``store``, as :func:`rope_torch`)."""
    q, k = rms_norm_torch(q, q_weight, eps), rms_norm_torch(k, k_weight, eps)
    return rope_torch(q, k, cos, sin, store)


def gemma_qk_norm_rope_torch(
    q: torch.Tensor,
    k: torch.Tensor | None,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    store: KVWrite | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gemma 4: per-head Gemma RMSNorm of q (and k, None on a KV-shared layer), then RoPE
    (k stored instead with ``store``, as :func:`rope_torch`)."""
    q = apply_rope_torch(gemma_rms_norm_torch(q, q_weight, eps), cos, sin)
    if k is None:
        return q, None
    return _stored(q, apply_rope_torch(gemma_rms_norm_torch(k, k_weight, eps), cos, sin), store)


def rope_tail_torch(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    inverse: bool = False,
    in_place: bool = False,
) -> torch.Tensor:
    """Interleaved RoPE on the trailing ``2 * cos.shape[-1]`` channels of x [T, D] or
    [T, H, D] (neighbouring channels rotate as pairs; in float32, cast back), the others
    copied; cos/sin [T, r / 2] float32. ``inverse``: the rotation undone (sin negated).
    ``in_place``: x's tail rotated where it is (the other channels neither read nor
    written) and x returned. DeepSeek V4's partial RoPE, as HF writes it."""
    sin = -sin if inverse else sin
    r = 2 * cos.shape[-1]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (r // 2,)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    rope = x[..., -r:].float().unflatten(-1, (-1, 2))
    x1, x2 = rope[..., 0], rope[..., 1]
    rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    if in_place:
        x[..., -r:] = rotated.to(x.dtype)
        return x
    return torch.cat([x[..., :-r], rotated.to(x.dtype)], dim=-1)


def norm_rope_tail_torch(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: torch.Tensor | None = None,
    loc: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """DeepSeek V4's normed, roped rows: :func:`gemma_rms_norm_torch` with the float32
    ``weight`` (its kv norm), or with ``weight`` None :func:`unweighted_rms_norm_torch` (its
    q norm), then :func:`rope_tail_torch`. With ``cache`` (contiguous [S, D] or [S, 1, D])
    the rows [T, D] go to its slots ``loc`` [T] (cast to its dtype) and nothing is
    returned; float32 rows are cast to the cache's dtype first (a compressor's pooled
    entries: HF casts them before the norm)."""
    if cache is not None:
        x = x.to(cache.dtype)
    if weight is None:
        normed = unweighted_rms_norm_torch(x, eps)
    else:
        normed = gemma_rms_norm_torch(x, weight, eps)
    out = rope_tail_torch(normed, cos, sin)
    if cache is None:
        return out
    cache.view(cache.shape[0], -1)[loc] = out.to(cache.dtype)
    return None


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
    PDL: tl.constexpr = False,  # kernels/pdl.py
):
    pdl.enter(PDL)
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
        **pdl.launch(x.device),
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
def _gemma_rms_norm_kernel(
    x,
    weight,
    residual,
    scale,
    out,
    inner,  # rows of x are (outer, inner) pairs: x [outer, inner, n_cols] with its strides
    stride_x0,
    stride_x1,
    stride_r0,
    stride_r1,
    n_cols,
    eps,
    HAS_WEIGHT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,  # kernels/pdl.py
):
    pdl.enter(PDL)
    pid = tl.program_id(0).to(tl.int64)
    i0 = pid // inner
    i1 = pid % inner
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    xv = tl.load(x + i0 * stride_x0 + i1 * stride_x1 + offs, mask=mask, other=0.0)
    h = xv.to(tl.float32)
    variance = tl.sum(h * h, 0) / n_cols
    y = h * tl.rsqrt(variance + eps)  # torch's pow(x, -0.5) on CUDA is rsqrt
    if HAS_WEIGHT:
        y = y * tl.load(weight + offs, mask=mask, other=0.0).to(tl.float32)
    y = y.to(xv.dtype)  # type_as(x): the norm's one rounding
    if HAS_RESIDUAL:  # residual + norm(x), rounded once as torch's add
        r = tl.load(residual + i0 * stride_r0 + i1 * stride_r1 + offs, mask=mask, other=0.0)
        y = (r.to(tl.float32) + y.to(tl.float32)).to(r.dtype)
    if HAS_SCALE:  # times a one-element tensor of the same dtype, rounded once
        y = (y.to(tl.float32) * tl.load(scale).to(tl.float32)).to(xv.dtype)
    tl.store(out + pid * n_cols + offs, y, mask=mask)


def _outer_inner(x: torch.Tensor) -> tuple[int, int, int, int]:
    """x [..., D] as (outer, inner) rows with strides, without a copy where x is a strided
    view of rank <= 3 (a head slice of a fused qkv output)."""
    if x.dim() == 1:
        return 1, 1, 0, 0
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    if x.dim() == 3:
        return x.shape[0], x.shape[1], x.stride(0), x.stride(1)
    raise ValueError("gemma_rms_norm takes tensors of at most 3 dims")


def gemma_rms_norm_triton(x, weight, eps, residual=None, scale=None) -> torch.Tensor:
    """Triton twin of :func:`gemma_rms_norm_torch` (its arguments): one launch, residual add
    and scale included."""
    n_cols = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    outer, inner, sx0, sx1 = _outer_inner(x)
    if out.numel() == 0:
        return out
    assert x.stride(-1) == 1
    if weight is not None:
        assert weight.is_contiguous() and weight.shape[-1] == n_cols
    r = x
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        assert residual.stride(-1) == 1
        r = residual
    _, _, sr0, sr1 = _outer_inner(r)
    if scale is not None:
        assert scale.numel() == 1 and scale.dtype == x.dtype
    block = triton.next_power_of_2(n_cols)
    _gemma_rms_norm_kernel[(outer * inner,)](
        x, x if weight is None else weight, r, x if scale is None else scale, out,
        inner, sx0, sx1, sr0, sr1, n_cols, eps,
        HAS_WEIGHT=weight is not None, HAS_RESIDUAL=residual is not None,
        HAS_SCALE=scale is not None, BLOCK=block,
        num_warps=_row_warps(block), enable_fp_fusion=False,
        **pdl.launch(x.device),
    )  # fmt: skip
    return out


@_jit
def _act_and_mul_kernel(
    gate_ptr,
    up_ptr,
    out,
    stride_gate,
    stride_up,
    stride_out,
    n_cols,
    limit,  # with CLAMP: gate clamped to at most L, up to [-L, L] (in their dtype)
    BLOCK: tl.constexpr,
    GELU: tl.constexpr,
    CLAMP: tl.constexpr = False,
    PDL: tl.constexpr = False,  # kernels/pdl.py
):
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    gate = tl.load(gate_ptr + row * stride_gate + offs, mask=mask, other=0.0)
    up = tl.load(up_ptr + row * stride_up + offs, mask=mask, other=0.0)
    if CLAMP:  # torch clamps with the limit in the tensor's dtype: exact either way
        gate = tl.minimum(gate.to(tl.float32), limit).to(gate_ptr.dtype.element_ty)
        up = tl.minimum(tl.maximum(up.to(tl.float32), -limit), limit)
        up = up.to(up_ptr.dtype.element_ty)
    y = act_and_mul(gate, up, GELU)
    tl.store(out + row * stride_out + offs, y.to(out.dtype.element_ty), mask=mask)


@_jit
def act_and_mul(gate, up, GELU: tl.constexpr):
    """``act(gate) * up`` of two tiles in their (16-bit or fp32) dtype, rounded as torch does:
    the activation (SiLU, or tanh-approximate GELU) to the dtype, then the product (fp32
    result, to be cast to the dtype by the caller)."""
    g = gate.to(tl.float32)
    if GELU:  # tanh-approximate GELU, tanh via exp: tanh(y) = 1 - 2 / (1 + exp(2y))
        y = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        act = 0.5 * g * (2.0 - 2.0 / (1.0 + tl.exp(2.0 * y)))
    else:
        act = g / (1.0 + tl.exp(-g))
    act = act.to(gate.dtype)  # torch's activation, rounded to the dtype before the product
    return act.to(tl.float32) * up.to(tl.float32)


def silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """Triton twin of :func:`silu_and_mul_torch`."""
    return _launch_gated(gate_up, gelu=False)


def gelu_tanh_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """Triton twin of :func:`gelu_tanh_and_mul_torch`."""
    return _launch_gated(gate_up, gelu=True)


def gelu_tanh_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Triton twin of :func:`gelu_tanh_mul_torch` (2D, rows may be strided views)."""
    assert gate.shape == up.shape and gate.dim() == 2 and gate.dtype == up.dtype
    return _launch_act_and_mul(gate, up, gelu=True)


def clamped_silu_mul_triton(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """Triton twin of :func:`clamped_silu_mul_torch` (2D, rows may be strided views): one
    launch for the two clamps, the activation and the product."""
    assert gate.shape == up.shape and gate.dim() == 2 and gate.dtype == up.dtype
    return _launch_act_and_mul(gate, up, gelu=False, limit=limit)


def _launch_gated(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
    """[..., 2I] (gate first) -> [..., I]."""
    shape = gate_up.shape
    n_cols = shape[-1] // 2
    x = gate_up.reshape(-1, shape[-1])
    out = _launch_act_and_mul(x[:, :n_cols], x[:, n_cols:], gelu)
    return out.view(*shape[:-1], n_cols)


def _launch_act_and_mul(
    gate: torch.Tensor, up: torch.Tensor, gelu: bool, limit: float | None = None
) -> torch.Tensor:
    rows, n_cols = gate.shape
    out = torch.empty((rows, n_cols), dtype=gate.dtype, device=gate.device)
    if rows == 0:
        return out
    assert gate.stride(-1) == 1 and up.stride(-1) == 1
    block = min(1024, triton.next_power_of_2(n_cols))
    grid = (rows, triton.cdiv(n_cols, block))
    _act_and_mul_kernel[grid](
        gate, up, out, gate.stride(0), up.stride(0), out.stride(0), n_cols,
        0.0 if limit is None else float(limit), BLOCK=block, GELU=gelu,
        CLAMP=limit is not None, num_warps=4, enable_fp_fusion=False,
        **pdl.launch(gate.device),
    )  # fmt: skip
    return out


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
    GEMMA_NORM: tl.constexpr,
):
    """Norm (optional: Llama's, or Gemma's with GEMMA_NORM) and rotate_half RoPE of heads
    head0 .. head0 + BLOCK_H of one token."""
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
        w1 = tl.load(weight + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(weight + HALF + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
        rstd = tl.rsqrt(variance + eps)[:, None]
        if GEMMA_NORM:  # normalized and scaled in fp32, one rounding
            x1 = (f1 * rstd * w1).to(odt)
            x2 = (f2 * rstd * w2).to(odt)
        else:
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
    k_out,  # with STORE_KV: the k cache, rows are slots
    q_weight,
    k_weight,
    cos,
    sin,
    v,  # STORE_KV only: v rows copied to v_cache at the same slots
    v_cache,
    slots,
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
    stride_v_t,
    stride_v_h,
    stride_vc_s,
    stride_vc_h,
    num_q_heads,
    num_k_heads,
    eps,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
    GEMMA_NORM: tl.constexpr,
    STORE_KV: tl.constexpr,
    PDL: tl.constexpr = False,  # kernels/pdl.py
):
    pdl.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)  # head blocks: q's first, then k's
    q_blocks = tl.cdiv(num_q_heads, BLOCK_H)
    cos_t = cos + t * stride_cos
    sin_t = sin + t * stride_sin
    if hb < q_blocks:
        _norm_rope_heads(
            q + t * stride_q_t, q_out + t * stride_qo_t, q_weight, cos_t, sin_t,
            stride_q_h, stride_qo_h, hb * BLOCK_H, num_q_heads, eps,
            HEAD_DIM, BLOCK_H, BLOCK_HALF, HAS_NORM, GEMMA_NORM,
        )  # fmt: skip
    else:
        head0 = (hb - q_blocks) * BLOCK_H
        out_row = t
        if STORE_KV:  # k (rotated) and v straight into their cache slot
            out_row = tl.load(slots + t).to(tl.int64)
            _copy_heads(
                v + t * stride_v_t, v_cache + out_row * stride_vc_s, stride_v_h, stride_vc_h,
                head0, num_k_heads, HEAD_DIM, BLOCK_H, BLOCK_HALF,
            )  # fmt: skip
        _norm_rope_heads(
            k + t * stride_k_t, k_out + out_row * stride_ko_t, k_weight, cos_t, sin_t,
            stride_k_h, stride_ko_h, head0, num_k_heads, eps,
            HEAD_DIM, BLOCK_H, BLOCK_HALF, HAS_NORM, GEMMA_NORM,
        )  # fmt: skip


@_jit
def _copy_heads(
    x, out, stride_h, stride_oh, head0, num_heads,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    """Heads head0 .. head0 + BLOCK_H of one token, cast to out's dtype."""
    HALF: tl.constexpr = HEAD_DIM // 2
    offs_h = head0 + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h < num_heads)[:, None] & (offs_d < HALF)[None, :]
    src = x + offs_h[:, None] * stride_h + offs_d[None, :]
    dst = out + offs_h[:, None] * stride_oh + offs_d[None, :]
    odt = out.dtype.element_ty
    tl.store(dst, tl.load(src, mask=mask).to(odt), mask=mask)
    tl.store(dst + HALF, tl.load(src + HALF, mask=mask).to(odt), mask=mask)


def _launch_qk_rope(q, k, q_weight, k_weight, eps, cos, sin, gemma=False, store=None):
    """q [T, H, D] and k [T, Hkv, D] (None: q only) normed (with weights) and rotated; with
    ``store`` (a KVWrite), k and v written to the cache in the same launch, k not returned."""
    num_tokens, num_q_heads, head_dim = q.shape
    no_k = k is None
    if no_k:  # q only (a KV-shared layer): zero k heads, q stands in for k's pointers
        k, k_weight = q[:, :0], q_weight
    num_k_heads = k.shape[1]
    assert head_dim % 2 == 0 and k.shape[2] == head_dim and cos.shape[-1] == head_dim
    has_norm = q_weight is not None
    if has_norm and not gemma:  # Llama's norm scales in the weight's dtype: it promotes
        q_dtype = torch.promote_types(q_weight.dtype, q.dtype)
        k_dtype = torch.promote_types(k_weight.dtype, k.dtype)
    else:  # Gemma's norm casts back to the input's dtype
        q_dtype, k_dtype = q.dtype, k.dtype
    # stored in the same launch when the cache holds k's dtype (else rounded twice: store after)
    fuse_store = store is not None and not no_k and store.k_cache.dtype == k_dtype
    q_out = torch.empty(q.shape, dtype=q_dtype, device=q.device)
    k_out = store.k_cache if fuse_store else torch.empty(k.shape, dtype=k_dtype, device=k.device)
    v, v_cache, slots = (store.v, store.v_cache, store.slots) if fuse_store else (q, q, q)
    if num_tokens == 0:
        return q_out, None if no_k or store is not None else k_out
    for t in (q, k, cos, sin, v, k_out, v_cache):
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
        v,
        v_cache,
        slots,
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
        v.stride(0),
        v.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        num_q_heads,
        num_k_heads,
        eps,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        HAS_NORM=has_norm,
        GEMMA_NORM=gemma,
        STORE_KV=fuse_store,
        num_warps=4,
        # Without this, LLVM contracts x*cos - rotate_half(x)*sin into one bf16 FMA and
        # skips the rounding of a product that HF (and the twin) performs.
        enable_fp_fusion=False,
        **pdl.launch(q.device),
    )
    if store is not None and not no_k and not fuse_store:
        store_kv_triton(store.k_cache, store.v_cache, store.slots, k_out, store.v)
    return q_out, None if no_k or store is not None else k_out


def rope_triton(q, k, cos, sin, store=None):
    """Triton twin of :func:`rope_torch` (its arguments): one launch for q and k (and the KV
    store)."""
    return _launch_qk_rope(q, k, None, None, 0.0, cos, sin, store=store)


def qk_norm_rope_triton(q, k, q_weight, k_weight, eps, cos, sin, store=None):
    """Triton twin of :func:`qk_norm_rope_torch` (its arguments): one launch for q and k (and
    the KV store)."""
    assert q_weight.is_contiguous() and k_weight.is_contiguous()
    return _launch_qk_rope(q, k, q_weight, k_weight, eps, cos, sin, store=store)


def gemma_qk_norm_rope_triton(q, k, q_weight, k_weight, eps, cos, sin, store=None):
    """Triton twin of :func:`gemma_qk_norm_rope_torch` (its arguments): one launch for q and k
    (and the KV store)."""
    assert q_weight.is_contiguous() and (k_weight is None or k_weight.is_contiguous())
    return _launch_qk_rope(q, k, q_weight, k_weight, eps, cos, sin, gemma=True, store=store)


@_jit
def _rotate_pairs(v, partner, cos, sin, rel, even, tail, INVERSE: tl.constexpr):
    """float32 values and their pair partners rotated, as the twin (the products and the sum
    each rounded: no FMA): x1' = x1 cos - x2 sin at the even channel, x2' = x2 cos + x1 sin;
    ``cos``/``sin`` the token's rows."""
    c = tl.load(cos + rel // 2, mask=tail, other=1.0)
    s = tl.load(sin + rel // 2, mask=tail, other=0.0)
    if INVERSE:
        s = -s
    return tl.where(even, v * c - partner * s, v * c + partner * s)


@_jit
def _rope_tail_in_place_kernel(
    x, cos, sin, n_rows, inner, stride_x0, stride_x1, stride_c, start,
    HALF: tl.constexpr, INVERSE: tl.constexpr, ROWS: tl.constexpr,
    PDL: tl.constexpr = False,  # kernels/pdl.py
):  # fmt: skip
    """ROWS rows (token, head) a program: only their last 2 * HALF channels (from ``start``)
    read, rotated in neighbouring pairs in float32 and written back."""
    pdl.enter(PDL)
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = r < n_rows
    i0 = r // inner
    rows = x + i0 * stride_x0 + (r % inner) * stride_x1 + start
    rel = tl.arange(0, 2 * HALF)
    even = rel % 2 == 0
    at = tl.where(even, rel + 1, rel - 1)
    m = live[:, None] & (rel[None, :] >= 0)
    xv = tl.load(rows[:, None] + rel[None, :], mask=m, other=0.0)
    partner = tl.load(rows[:, None] + at[None, :], mask=m, other=0.0)
    rotated = _rotate_pairs(
        xv.to(tl.float32), partner.to(tl.float32), cos + i0[:, None] * stride_c,
        sin + i0[:, None] * stride_c, rel[None, :], even[None, :], m, INVERSE,
    )  # fmt: skip
    tl.store(rows[:, None] + rel[None, :], rotated.to(xv.dtype), mask=m)


@_jit
def _norm_rope_tail_kernel(
    x, weight, cos, sin, out, loc, n_rows, inner, stride_x0, stride_x1, stride_c, stride_o,
    n_cols, eps, HALF: tl.constexpr, BLOCK: tl.constexpr, WEIGHTED: tl.constexpr,
    STORE: tl.constexpr, ROUND_IN: tl.constexpr = False, ROWS: tl.constexpr = 1,
    PDL: tl.constexpr = False,  # kernels/pdl.py
):  # fmt: skip
    """ROWS rows (token, head) a program: Gemma's norm (WEIGHTED) or V4's unweighted one,
    then each row's last 2 * HALF channels rotated in neighbouring pairs, each value rounded
    where the two kernels it replaces round (``_gemma_rms_norm_kernel``,
    ``_rope_tail_in_place_kernel``); the partner channel normed from its own load. STORE: to
    ``out``'s row ``loc[token]``. ROUND_IN: x (float32) rounded to ``out``'s dtype first, the
    cast the twin makes."""
    pdl.enter(PDL)
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = r < n_rows
    i0 = r // inner
    row = x + i0 * stride_x0 + (r % inner) * stride_x1
    offs = tl.arange(0, BLOCK)
    in_row = offs < n_cols
    start = n_cols - 2 * HALF
    in_tail = in_row & (offs >= start)
    rel = tl.where(in_tail, offs - start, 0)
    even = rel % 2 == 0
    at = tl.where(even, offs + 1, offs - 1)  # the pair partner
    mask = live[:, None] & in_row[None, :]
    tail = live[:, None] & in_tail[None, :]
    xv = tl.load(row[:, None] + offs[None, :], mask=mask, other=0.0)
    pv = tl.load(row[:, None] + at[None, :], mask=tail, other=0.0)
    if ROUND_IN:
        xv = xv.to(out.dtype.element_ty)
        pv = pv.to(out.dtype.element_ty)
    h = xv.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, 1) / n_cols + eps)[:, None]
    pv = pv.to(tl.float32)
    if WEIGHTED:  # normalized and scaled in fp32, one rounding
        w = tl.load(weight + offs, mask=in_row, other=0.0)[None, :]
        wp = tl.load(weight + at, mask=in_tail, other=0.0)[None, :]
        y = (h * rstd * w).to(xv.dtype)
        p = (pv * rstd * wp).to(xv.dtype)
    else:  # the scale rounded to the dtype, the product too
        scale = rstd.to(xv.dtype).to(tl.float32)
        y = (h * scale).to(xv.dtype)
        p = (pv * scale).to(xv.dtype)
    rotated = _rotate_pairs(
        y.to(tl.float32), p.to(tl.float32), cos + i0[:, None] * stride_c,
        sin + i0[:, None] * stride_c, rel[None, :], even[None, :], tail, False,
    )  # fmt: skip
    y = tl.where(tail, rotated.to(xv.dtype), y)
    if STORE:
        dst = tl.load(loc + i0, mask=live, other=0).to(tl.int64)
    else:
        dst = r
    tl.store(out + dst[:, None] * stride_o + offs[None, :], y.to(out.dtype.element_ty), mask=mask)


# channels a program of ``norm_rope_tail`` covers: whole rows, as many as fit (V4's q: 4 heads
# of 512). A row a program took 0.7 ms for V4-Flash's q at 8K tokens on an H100 (512K
# programs of 1 KB: 42% of the bandwidth its 1 GB of traffic needs)
NORM_ROPE_TILE = 2048


def norm_rope_tail_triton(x, weight, eps, cos, sin, cache=None, loc=None, in_place=False):
    """Triton twin of :func:`norm_rope_tail_torch` (its arguments): one launch for the norm,
    the rotation and (with ``cache``) the store. ``in_place``: into ``x`` (contiguous; each
    program loads its rows whole before it writes them), returned."""
    n_cols, half = x.shape[-1], cos.shape[-1]
    outer, inner, sx0, sx1 = _outer_inner(x)
    store = cache is not None
    round_in = store and x.dtype != cache.dtype
    if store:
        assert x.dim() == 2 and cache.is_contiguous() and cache[0].numel() == n_cols
        assert not round_in or x.dtype == torch.float32, "a cast in: float32 rows only"
        out, stride_o = cache, cache.stride(0)
    else:
        assert not in_place or x.is_contiguous(), "in place: contiguous rows only"
        out = x if in_place else torch.empty(x.shape, dtype=x.dtype, device=x.device)
        stride_o = n_cols
    if x.numel() == 0:
        return None if store else out
    cos, sin = cos.contiguous(), sin.contiguous()
    assert x.stride(-1) == 1 and 2 * half <= n_cols and cos.shape[0] == x.shape[0]
    if weight is not None:
        assert weight.is_contiguous() and weight.dtype == torch.float32
    block = triton.next_power_of_2(n_cols)
    rows = max(1, NORM_ROPE_TILE // block)
    _norm_rope_tail_kernel[(triton.cdiv(outer * inner, rows),)](
        x, x if weight is None else weight, cos, sin, out, loc if store else cos, outer * inner,
        inner, sx0, sx1, cos.stride(0), stride_o, n_cols, eps, HALF=half, BLOCK=block,
        WEIGHTED=weight is not None, STORE=store, ROUND_IN=round_in, ROWS=rows,
        num_warps=_row_warps(block * rows), enable_fp_fusion=False, **pdl.launch(x.device),
    )  # fmt: skip
    return None if store else out


def rope_tail_triton(x, cos, sin, inverse=False, in_place=False) -> torch.Tensor:
    """Triton twin of :func:`rope_tail_torch` (its arguments): in place, one launch that
    moves only the tail's channels (V4's 64 of 512: an eighth of the bytes); else the same
    on a copy of x."""
    if not in_place:
        return rope_tail_triton(x.clone(), cos, sin, inverse, in_place=True)
    n_cols, half = x.shape[-1], cos.shape[-1]
    outer, inner, sx0, sx1 = _outer_inner(x)
    cos, sin = cos.contiguous(), sin.contiguous()
    assert x.stride(-1) == 1
    assert 2 * half <= n_cols and cos.shape[0] == x.shape[0]
    assert half & (half - 1) == 0, "a tail of a power of 2 channels"
    if x.numel():
        rows = max(1, 2048 // (2 * half))  # a tile of ~2K channels a program
        _rope_tail_in_place_kernel[(triton.cdiv(outer * inner, rows),)](
            x, cos, sin, outer * inner, inner, sx0, sx1, cos.stride(0), n_cols - 2 * half,
            HALF=half, INVERSE=inverse, ROWS=rows, num_warps=4, enable_fp_fusion=False,
            **pdl.launch(x.device),
        )  # fmt: skip
    return x
