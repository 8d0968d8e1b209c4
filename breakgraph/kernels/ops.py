"""Kernel dispatch: the Triton kernel when the tensors are on CUDA and Triton imports, else
the torch twin. Set ``BREAKGRAPH_DISABLE_TRITON=1`` to force the twins (debugging)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from breakgraph.common import envs
from breakgraph.kernels import compressed_attention as _compressed
from breakgraph.kernels import decode_attention as _decode
from breakgraph.kernels import extend_attention as _extend
from breakgraph.kernels import flashinfer_extend as _flashinfer
from breakgraph.kernels import fused as _fused
from breakgraph.kernels import fused_moe as _moe
from breakgraph.kernels import hyper_connection as _hc
from breakgraph.kernels import kv_store as _kv_store
from breakgraph.kernels import penalties as _penalties
from breakgraph.kernels import skinny_gemm as _skinny
from breakgraph.kernels import workspace as _workspace
from breakgraph.kernels.attention_meta import AttentionMeta
from breakgraph.kernels.decode_attention import DecodeWorkspace
from breakgraph.kernels.kv_store import KVWrite

__all__ = [
    "AttentionMeta",
    "apply_penalties",
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
    "rope_tail",
    "clamped_silu_mul",
    "hc_collapse",
    "hc_mixes",
    "hc_expand",
    "indexer_scores",
    "linear",
    "linear_act_and_mul",
    "norm_linear",
    "norm_rope_tail",
    "pool_windows",
    "qk_norm_rope",
    "rms_norm",
    "rope",
    "silu_and_mul",
    "sparse_attention",
    "store_kv",
    "triton_available",
    "window_score",
]


def triton_available() -> bool:
    """Triton imported (the kernel modules import it guarded) and not disabled."""
    return _kv_store.triton is not None and not envs.DISABLE_TRITON.get()


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and triton_available()


_F = TypeVar("_F", bound=Callable[..., Any])


def _twin(torch_fn: _F, triton_fn: Callable[..., Any]) -> _F:
    """The op of a Triton kernel and its torch twin (same arguments): the kernel where the
    first argument is a CUDA tensor and Triton is usable, else the twin, whose name,
    signature and docstring the op carries. One Python call and the check over the kernel's
    own: ops run per layer per eager step."""

    @functools.wraps(torch_fn)
    def op(*args, **kwargs):
        return (triton_fn if _use_triton(args[0]) else torch_fn)(*args, **kwargs)

    op.__name__ = op.__qualname__ = torch_fn.__name__.removesuffix("_torch")
    op.__module__ = __name__
    return op


# ---- attention and the KV store (kernels/{kv_store,extend_attention,decode_attention}.py)

store_kv = _twin(_kv_store.store_kv_torch, _kv_store.store_kv_triton)
extend_attention = _twin(_extend.extend_attention_torch, _extend.extend_attention_triton)
decode_attention = _twin(_decode.decode_attention_torch, _decode.decode_attention_triton)


def plan_extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    meta: AttentionMeta,
    sm_scale: float,
    sliding_window: int | None = None,
    zero_pad: bool = False,
    decode_rows: bool = True,
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]:
    """:func:`extend_attention` split in two: the step's part, computed once, returns a
    ``plan(q, o, k_cache, v_cache)`` that each layer of the same shape, scale and window
    calls (same result, less host work). ``zero_pad`` (one request): o's rows past the
    request's get zeros (``ExtendPlan``).

    The step's last requests of one query row each (a mixed step's decode rows, after the
    prefill rows: engine/prefill.py) go to the decode kernel: the extend kernels give each a
    whole query tile over its keys (:func:`_plan_with_decode_rows`). ``decode_rows=False``
    keeps the whole step on one extend launch (``bench kernels --mixed``'s reference)."""
    if not _use_triton(q):

        def plan(q, o, k_cache, v_cache):
            if zero_pad:
                o.zero_()
            _extend.extend_attention_torch(q, o, k_cache, v_cache, meta, sm_scale, sliding_window)

        return plan
    one_row = _decode_tail(meta) if decode_rows and not zero_pad else 0
    if one_row:
        return _plan_with_decode_rows(q, k_cache, meta, sm_scale, sliding_window, one_row)
    return _plan_extend_kernel(q, k_cache, meta, sm_scale, sliding_window, zero_pad)


def _plan_extend_kernel(q, k_cache, meta, sm_scale, sliding_window, zero_pad):
    """The step on one extend kernel: Triton's, or FlashInfer's where it serves the step."""
    plan = _extend.ExtendPlan(
        q, k_cache, meta, sm_scale, sliding_window=sliding_window, zero_pad=zero_pad
    )
    # FlashInfer where the Triton kernel would not split keys: many query rows (an H200
    # measured it 1.40x faster at 8K new tokens, 1.53x at 1K over a 32K prefix; 0.46x at
    # 256 over 32K, where the split-KV path fills the GPU)
    if not plan.empty and plan.splits <= 1 and _flashinfer.usable(q, k_cache, meta, zero_pad):
        try:
            return _flashinfer.FlashInferPlan(q, k_cache, meta, sm_scale, sliding_window)
        except Exception as e:  # its kernel did not build: Triton, said once
            _flashinfer.give_up(e)
    return plan


def _decode_tail(meta: AttentionMeta) -> int:
    """How many of the step's last requests have one query row each (host lengths known)."""
    lens = meta.extend_lens_cpu
    n = 0
    if lens is not None:
        while n < len(lens) and lens[-1 - n] == 1:
            n += 1
    return n


def _plan_with_decode_rows(q, k_cache, meta, sm_scale, sliding_window, n):
    """The step's last ``n`` requests, one query row each, on the decode kernel (split-KV
    over their keys, the query row alone); the requests before them on the extend kernel.

    In a mixed step those are the running requests' decode rows; in Gemma 4's KV-shared
    tail, every request's last row. An extend kernel gives each its own query tile (Triton's
    d128 tile: 128 rows, one of them real) per query head over all of its keys: 128x the
    matmul work, and the keys read once per query head, where the decode kernel reads them
    once per KV head (grouped heads together) at the bandwidth's pace. By count on
    Llama-3.1-8B's heads, 64 such rows of 4K keys are 0.18 TFLOP a layer on the tiles
    (about 0.5 ms at 360 TFLOP/s) against 1.07 GB of keys and values (0.32 ms at 3.35 TB/s).
    ``bench kernels --mixed`` times the two."""
    lens, seqs = meta.extend_lens_cpu, meta.seq_lens_cpu
    b = len(lens) - n
    rows = sum(lens[:b])
    # the step's own meta where every request has one row (Gemma 4's KV-shared tail)
    decode_meta = meta
    head = None
    if b:
        decode_meta = AttentionMeta.decode(
            meta.req_to_token, meta.req_pool_indices[b:], meta.seq_lens[b:]
        )
        head_meta = AttentionMeta(
            meta.req_to_token, meta.req_pool_indices[:b], meta.seq_lens[:b],
            meta.extend_start_loc[:b], meta.extend_lens[:b], max_extend_len=max(lens[:b]),
            max_seq_len=meta.max_seq_len if seqs is None else max(seqs[:b]),
            extend_lens_cpu=lens[:b],
            seq_lens_cpu=None if seqs is None else seqs[:b],
        )  # fmt: skip
        head = _plan_extend_kernel(q[:rows], k_cache, head_meta, sm_scale, sliding_window, False)
    end = rows + n

    def plan(q, o, k_cache, v_cache):
        if head is not None:
            head(q[:rows], o[:rows], k_cache, v_cache)
        _decode.decode_attention_triton(
            q[rows:end], o[rows:end], k_cache, v_cache, decode_meta, sm_scale,
            sliding_window=sliding_window,
        )  # fmt: skip

    return plan


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


# ---- norms, activations, RoPE (kernels/fused.py)

rms_norm = _twin(_fused.rms_norm_torch, _fused.rms_norm_triton)
fused_add_rms_norm = _twin(_fused.fused_add_rms_norm_torch, _fused.fused_add_rms_norm_triton)
gemma_rms_norm = _twin(_fused.gemma_rms_norm_torch, _fused.gemma_rms_norm_triton)
silu_and_mul = _twin(_fused.silu_and_mul_torch, _fused.silu_and_mul_triton)
gelu_tanh_and_mul = _twin(_fused.gelu_tanh_and_mul_torch, _fused.gelu_tanh_and_mul_triton)
gelu_tanh_mul = _twin(_fused.gelu_tanh_mul_torch, _fused.gelu_tanh_mul_triton)
rope = _twin(_fused.rope_torch, _fused.rope_triton)
qk_norm_rope = _twin(_fused.qk_norm_rope_torch, _fused.qk_norm_rope_triton)
gemma_qk_norm_rope = _twin(_fused.gemma_qk_norm_rope_torch, _fused.gemma_qk_norm_rope_triton)
rope_tail = _twin(_fused.rope_tail_torch, _fused.rope_tail_triton)
norm_rope_tail = _twin(_fused.norm_rope_tail_torch, _fused.norm_rope_tail_triton)
clamped_silu_mul = _twin(_fused.clamped_silu_mul_torch, _fused.clamped_silu_mul_triton)


# ---- compressed attention (DeepSeek V4; kernels/compressed_attention.py)

pool_windows = _twin(_compressed.pool_windows_torch, _compressed.pool_windows_triton)
window_score = _twin(_compressed.window_score_torch, _compressed.window_score_triton)
indexer_scores = _twin(_compressed.indexer_scores_torch, _compressed.indexer_scores_triton)
sparse_attention = _twin(_compressed.sparse_attention_torch, _compressed.sparse_attention_triton)


# ---- hyper-connections (DeepSeek V4's mHC; kernels/hyper_connection.py)

hc_mixes = _twin(_hc.hc_mixes_torch, _hc.hc_mixes_triton)
hc_collapse = _twin(_hc.hc_collapse_torch, _hc.hc_collapse_triton)
hc_expand = _twin(_hc.hc_expand_torch, _hc.hc_expand_triton)


# ---- mixture of experts (kernels/fused_moe.py)


moe_route = _twin(_moe.moe_route_torch, _moe.moe_route_triton)
fused_experts = _twin(_moe.fused_experts_torch, _moe.fused_experts_triton)


# ---- sampling (kernels/penalties.py)

apply_penalties = _twin(_penalties.apply_penalties_torch, _penalties.apply_penalties_triton)
