"""Kernel dispatch: the Triton kernel when the tensors are on CUDA and Triton imports, else
the torch twin. Set ``BREAKGRAPH_DISABLE_TRITON=1`` to force the twins (debugging)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from breakgraph.common import envs
from breakgraph.kernels import decode_attention as _decode
from breakgraph.kernels import extend_attention as _extend
from breakgraph.kernels import fused as _fused
from breakgraph.kernels import fused_moe as _moe
from breakgraph.kernels import kv_store as _kv_store
from breakgraph.kernels import skinny_gemm as _skinny
from breakgraph.kernels import workspace as _workspace
from breakgraph.kernels.attention_meta import AttentionMeta
from breakgraph.kernels.decode_attention import DecodeWorkspace
from breakgraph.kernels.kv_store import KVWrite

__all__ = [
    "AttentionMeta",
    "DecodeWorkspace",
    "KVWrite",
    "decode_attention",
    "extend_attention",
    "fused_experts",
    "graph_workspaces",
    "moe_route",
    "plan_extend_attention",
    "fused_add_rms_norm",
    "gelu_tanh_and_mul",
    "gelu_tanh_mul",
    "gemma_qk_norm_rope",
    "gemma_rms_norm",
    "linear",
    "linear_act_and_mul",
    "norm_linear",
    "qk_norm_rope",
    "rms_norm",
    "rope",
    "silu_and_mul",
    "store_kv",
    "triton_available",
]


def triton_available() -> bool:
    """Triton imported (the kernel modules import it guarded) and not disabled."""
    return _kv_store.triton is not None and not envs.DISABLE_TRITON.get()


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and triton_available()


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Write k/v [T, Hkv, D] into the slots [T] of the caches; padding rows use slot 0."""
    fn = _kv_store.store_kv_triton if _use_triton(k) else _kv_store.store_kv_torch
    fn(k_cache, v_cache, slots, k, v)


def extend_attention(
    q: torch.Tensor,
    o: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMeta,
    sm_scale: float,
    sliding_window: int | None = None,
) -> None:
    """Causal prefill attention over the paged KV (prefix + new tokens) into ``o`` [T, H, D].

    ``meta.max_seq_len`` (a host-known upper bound of ``seq_lens``) lets the Triton kernel
    split long prefixes; the twin ignores it. ``sliding_window`` W: a row at position p
    attends to keys p - W + 1 .. p only (None: the whole context).
    """
    plan_extend_attention(q, k_cache, meta, sm_scale, sliding_window)(q, o, k_cache, v_cache)


def plan_extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    meta: AttentionMeta,
    sm_scale: float,
    sliding_window: int | None = None,
    zero_pad: bool = False,
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]:
    """:func:`extend_attention` split in two: the step's part, computed once, returns a
    ``plan(q, o, k_cache, v_cache)`` that each layer of the same shape, scale and window
    calls (same result, less host work). ``zero_pad`` (one request): o's rows past the
    request's get zeros (``ExtendPlan``)."""
    if _use_triton(q):
        return _extend.ExtendPlan(
            q, k_cache, meta, sm_scale, sliding_window=sliding_window, zero_pad=zero_pad
        )

    def plan(q, o, k_cache, v_cache):
        if zero_pad:
            o.zero_()
        _extend.extend_attention_torch(q, o, k_cache, v_cache, meta, sm_scale, sliding_window)

    return plan


def decode_attention(
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
    """One query row per request into ``o`` [B, H, D]; CUDA-graph capturable on CUDA.

    Reads the meta's key side only (``req_to_token``, ``req_pool_indices``, ``seq_lens``).
    ``num_kv_splits`` and ``workspace`` only tune the Triton kernel (the twin ignores them);
    ``sliding_window`` W: each request attends to its last W keys only.
    """
    if _use_triton(q):
        _decode.decode_attention_triton(
            q, o, k_cache, v_cache, meta, sm_scale, num_kv_splits, workspace, sliding_window
        )
    else:
        _decode.decode_attention_torch(q, o, k_cache, v_cache, meta, sm_scale, sliding_window)


def graph_workspaces() -> list[torch.Tensor]:
    """Workspaces that captured kernels write by address (split partials and counters), in
    allocation order: a list taken at capture is a prefix of any later one."""
    return _workspace.graph_held()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``x W^T (+ bias)``: the skinny-GEMM kernel for decode's few rows where the H200 table
    measured it faster than cuBLAS (kernels/skinny_gemm.py), else ``F.linear``."""
    cfg = _skinny_config(x, weight)
    if cfg is not None:
        return _skinny.skinny_gemm_triton(x, weight, bias, cfg)
    return torch.nn.functional.linear(x, weight, bias)


def linear_act_and_mul(x: torch.Tensor, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(x G^T) * (x U^T)`` for ``gate_up = [G; U]`` (``activation``: "silu" or
    "gelu_tanh"): one skinny-GEMM launch where the table sends ``gate_up``'s shape to it
    (the activation in its epilogue), else the GEMM and the activation kernel."""
    cfg = _skinny_config(x, gate_up)
    if cfg is not None:
        return _skinny.skinny_gemm_triton(x, gate_up, None, cfg, activation=activation)
    act = silu_and_mul if activation == "silu" else gelu_tanh_and_mul
    return act(torch.nn.functional.linear(x, gate_up))


def norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's RMSNorm of ``x + residual`` (of x without one) and the projection after it
    (gate/up's activation too, with ``activation``); returns ``(y, new_residual)``, the new
    residual x itself without one. One skinny-GEMM launch with the norm as its prologue where
    the table sends the projection's shape there (and keeps ``fuse_norm``); else the norm
    kernel, then the projection."""
    cfg = _skinny_config(x, weight)
    if cfg is not None and cfg.fuse_norm and not cfg.gemv and x.is_contiguous():
        if residual is None or residual.is_contiguous():
            y, new_residual = _skinny.skinny_norm_gemm_triton(
                x, residual, norm_weight, eps, weight, cfg, None, activation, bias
            )
            return y, x if new_residual is None else new_residual
    if residual is None:
        h, new_residual = rms_norm(x, norm_weight, eps), x
    else:
        h, new_residual = fused_add_rms_norm(x, residual, norm_weight, eps)
    if activation is not None:
        return linear_act_and_mul(h, weight, activation), new_residual
    return linear(h, weight, bias), new_residual


def _skinny_config(x: torch.Tensor, weight: torch.Tensor):
    """The table's config for this projection, or None (cuBLAS): also for a layout the
    kernel does not take (rows not unit-strided, a weight view)."""
    if x.dim() != 2 or x.shape[0] > _skinny.MAX_M or not _use_triton(x):
        return None
    if x.stride(-1) != 1 or not weight.is_contiguous():
        return None
    return _skinny.table_config(x.shape[0], weight.shape[0], weight.shape[1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm over the last dim; returns a new tensor."""
    fn = _fused.rms_norm_triton if _use_triton(x) else _fused.rms_norm_torch
    return fn(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``; the inputs are not modified."""
    fn = _fused.fused_add_rms_norm_triton if _use_triton(x) else _fused.fused_add_rms_norm_torch
    return fn(x, residual, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] -> [..., I]: ``silu(gate) * up``, gate the first half."""
    fn = _fused.silu_and_mul_triton if _use_triton(gate_up) else _fused.silu_and_mul_torch
    return fn(gate_up)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] -> [..., I]: ``gelu_tanh(gate) * up``, gate the first half (GeGLU)."""
    fn = _fused.gelu_tanh_and_mul_triton if _use_triton(gate_up) else _fused.gelu_tanh_and_mul_torch
    return fn(gate_up)


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` of two [T, I] tensors (Gemma 4's per-layer input gate)."""
    fn = _fused.gelu_tanh_mul_triton if _use_triton(gate) else _fused.gelu_tanh_mul_torch
    return fn(gate, up)


def gemma_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gemma's RMSNorm over the last dim (fp32 scale, one rounding; no weight: no scale);
    with ``residual``, ``residual + norm(x)``, then times the one-element ``scale`` if given,
    all in the same launch. A new tensor."""
    fn = _fused.gemma_rms_norm_triton if _use_triton(x) else _fused.gemma_rms_norm_torch
    return fn(x, weight, eps, residual, scale)


def gemma_qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor | None,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    store: KVWrite | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gemma 4's per-head RMSNorm of q and k (k None: q only), then RoPE; new tensors (with
    ``store``, k and v go to the KV cache in the same launch and k comes back None)."""
    fn = _fused.gemma_qk_norm_rope_triton if _use_triton(q) else _fused.gemma_qk_norm_rope_torch
    return fn(q, k, q_weight, k_weight, eps, cos, sin, store)


def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    store: KVWrite | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """rotate_half RoPE of q [T, H, D] and k [T, Hkv, D] with cos/sin [T, D]; new tensors
    (with ``store``, k and v go to the KV cache in the same launch and k comes back None)."""
    fn = _fused.rope_triton if _use_triton(q) else _fused.rope_torch
    return fn(q, k, cos, sin, store)


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    store: KVWrite | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Qwen3's per-head RMSNorm of q and k, then RoPE; new tensors (``store``: as rope)."""
    fn = _fused.qk_norm_rope_triton if _use_triton(q) else _fused.qk_norm_rope_torch
    return fn(q, k, q_weight, k_weight, eps, cos, sin, store)


# ---- mixture of experts (kernels/fused_moe.py)


def moe_route(
    router_logits: torch.Tensor,
    top_k: int,
    scoring: str = "softmax",
    renormalize: bool = True,
    expert_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights float32 [T, K], expert ids int32 [T, K]): float32
    softmax or sigmoid, top-k, optionally renormalized, optionally times ``expert_scale[id]``."""
    fn = _moe.moe_route_triton if _use_triton(router_logits) else _moe.moe_route_torch
    return fn(router_logits, top_k, scoring, renormalize, expert_scale)


def fused_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
) -> torch.Tensor:
    """x [T, H] through its top-k experts (``gate_up`` [E, 2I, H], ``down`` [E, H, I]),
    weighted and summed -> [T, H]. Capturable on CUDA: no host sync, buffers sized by T."""
    fn = _moe.fused_experts_triton if _use_triton(x) else _moe.fused_experts_torch
    return fn(x, gate_up, down, topk_weights, topk_ids, activation)
