"""Extend attention on FlashInfer's batch prefill (its Hopper backend, FA3's kernels) over the
paged KV, each slot a page of one token: the candidate for prefill attention at Hopper's
limit where the Triton kernel (kernels/extend_attention.py) stays the portable path.

Chosen by ``BREAKGRAPH_EXTEND_ATTENTION``: ``auto`` (the default) and ``flashinfer`` where
FlashInfer imports and serves the step (CUDA of compute capability 9, bf16 or fp16, head sizes
64, 128 and 256, host lengths known, not inside a capture, no zeroed padding) and the Triton
kernel would not split the step's keys (``ops.plan_extend_attention``), else Triton;
``triton`` never. Through the server on an H100 (Qwen3-0.6B shapes, ``h200_serve.sh
flashinfer``) FlashInfer gave 1.18x Triton's cold 8K x8 input throughput and 0.72x its
64K-prefix hit TTFT; ``bench kernels`` on an H200 measured it 1.40x faster at 8K new tokens,
1.53x at 1K over a 32K prefix, 0.46x at 256 over 32K (where the split-KV path fills the GPU).
The plan is the step's, shared by its layers like ``ExtendPlan``: FlashInfer's ``plan()``
(host scheduling and one non-blocking upload) inside the attention break, then one ``run``
per layer. A wrapper per attention shape lives for the process (its plan buffers), over one
float workspace per device. Where a plan fails (its kernel does not build: no nvcc, say), the
process says why in one line and stays on Triton.

FlashInfer reaches the GPU machine pruned (``benchmarks/flashinfer_bundle.py``) and builds
each kernel variant with the machine's nvcc at its first use (minutes, then cached on disk):
the warm-up's prefill steps take that cost before the server is ready.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Iterator

import numpy as np
import torch

from breakgraph.common import envs
from breakgraph.kernels.attention_meta import AttentionMeta

logger = logging.getLogger(__name__)

HEAD_DIMS = (64, 128, 256)  # the fa3 backend's; 512 (Gemma 4, DeepSeek V4) stays on Triton
WORKSPACE_BYTES = 128 << 20
# Wrappers per attention shape, used in turn. A wrapper's plan() writes the step's schedule
# into the wrapper's page-locked host buffer and enqueues its copy to the device; the copy
# reads the buffer when the stream reaches it. The host runs steps ahead of the GPU (overlap
# scheduling, the eager breaks of a replay), so a plan on the same wrapper before that copy
# ran would hand the earlier step the later one's schedule (an illegal memory access where
# the later step's keys are longer: the chunks of a 64K prompt). Each wrapper waits for its
# last plan's copy (an event) before it plans again; with RING of them that wait is on a
# step RING - 1 behind, which has long run.
RING = 3
_rings: dict[tuple, Iterator[_Slot]] = {}
_workspaces: dict[torch.device, torch.Tensor] = {}


_failed: list[str] = []  # why FlashInfer stopped serving this process, once it has


@functools.cache
def load(asked: bool = False):
    """The ``flashinfer`` module, or None where it does not import (said once: a warning
    where ``asked`` for by name, else an info line)."""
    try:
        import flashinfer
    except ImportError as e:
        log = logger.warning if asked else logger.info
        log(
            "flashinfer does not import (%s): extend attention stays on Triton; on Hopper, "
            "pip install 'breakgraph[flashinfer]' runs it on FA3's kernels (1.4x Triton's "
            "throughput at 8K tokens on an H100)", e,
        )  # fmt: skip
        return None
    return flashinfer


def give_up(error: Exception) -> None:
    """FlashInfer failed to plan (its kernel did not build): Triton from now on, said once."""
    if not _failed:
        _failed.append(f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}")
        logger.warning("flashinfer failed (%s): extend attention stays on Triton", _failed[0])


def usable(q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMeta, zero_pad: bool) -> bool:
    """Whether this step's extend attention runs on FlashInfer (see the module's doc)."""
    mode = envs.EXTEND_ATTENTION.get()
    if mode == "triton" or _failed:
        return False
    return (
        q.is_cuda
        and q.dtype in (torch.bfloat16, torch.float16)
        and k_cache.dtype == q.dtype
        and q.shape[-1] in HEAD_DIMS
        and meta.extend_lens_cpu is not None
        and not zero_pad
        and torch.cuda.get_device_capability(q.device)[0] == 9
        and not torch.cuda.is_current_stream_capturing()
        and load(asked=mode == "flashinfer") is not None
    )


def flat_slots(meta: AttentionMeta, total: int) -> torch.Tensor:
    """Every request's KV slots, request after request (FlashInfer's page indices at one
    token a page): ``req_to_token[req_r, :seq_r]`` concatenated, int32 [total]. Device ops
    sized by the host's ``total`` (the sum of the lengths): no sync."""
    seq = meta.seq_lens.long()
    starts = torch.cumsum(seq, 0) - seq
    rows = torch.repeat_interleave(meta.req_pool_indices, seq, output_size=total)
    first = torch.repeat_interleave(starts, seq, output_size=total)
    cols = torch.arange(total, device=seq.device) - first
    return meta.req_to_token[rows, cols].to(torch.int32)


class _Slot:
    """One wrapper of a ring and the event recorded after its last plan's copy."""

    def __init__(self, wrapper):
        self.wrapper, self.copied = wrapper, torch.cuda.Event()

    def ready(self) -> object:
        """The wrapper, once its last plan's host buffer has been copied (host wait; none
        before its first plan: an event never recorded is complete)."""
        self.copied.synchronize()
        return self.wrapper

    def mark_planned(self) -> None:
        self.copied.record()


def _next_slot(key: tuple, device: torch.device) -> _Slot:
    """The next wrapper in turn of the ring for ``key`` (its RING made on first use)."""
    ring = _rings.get(key)
    if ring is None:
        workspace = _workspaces.get(device)
        if workspace is None:
            workspace = _workspaces[device] = torch.empty(
                WORKSPACE_BYTES, dtype=torch.uint8, device=device
            )
        make = load().BatchPrefillWithPagedKVCacheWrapper
        heads, kv_heads, head_dim, window_left = key[:4]
        logger.info(
            "extend attention: FlashInfer's fa3 prefill for %d query / %d kv heads of %d%s "
            "(BREAKGRAPH_EXTEND_ATTENTION=triton keeps Triton's)", heads, kv_heads, head_dim,
            "" if window_left < 0 else f", window {window_left + 1}",
        )  # fmt: skip
        ring = _rings[key] = itertools.cycle(
            [_Slot(make(workspace, "NHD", backend="fa3")) for _ in range(RING)]
        )
    return next(ring)


class FlashInferPlan:
    """One step's extend attention on FlashInfer, ``ExtendPlan``'s interface: planned here
    (host lengths from ``meta``), then ``plan(q, o, k_cache, v_cache)`` per layer writes
    the live rows of ``o`` (the rows of a bucket past them are left as they are)."""

    def __init__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        meta: AttentionMeta,
        sm_scale: float,
        sliding_window: int | None = None,
    ):
        ext = np.asarray(meta.extend_lens_cpu, dtype=np.int64)
        seq = np.asarray(meta.seq_lens_cpu, dtype=np.int64)
        self.rows = int(ext.sum())
        if self.rows == 0:
            return
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = k_cache.shape[1]
        window_left = -1 if sliding_window is None else sliding_window - 1
        key = (num_heads, num_kv_heads, head_dim, window_left, q.dtype, q.device)
        slot = _next_slot(key, q.device)
        self.wrapper = slot.ready()
        indptr = [torch.from_numpy(np.concatenate(([0], np.cumsum(a)))).int() for a in (ext, seq)]
        self.wrapper.plan(
            indptr[0], indptr[1], flat_slots(meta, int(seq.sum())),
            torch.from_numpy((seq > 0).astype(np.int32)), num_heads, num_kv_heads, head_dim, 1,
            causal=True, sm_scale=sm_scale, window_left=window_left, q_data_type=q.dtype,
            kv_data_type=k_cache.dtype,
        )  # fmt: skip
        slot.mark_planned()

    def __call__(
        self, q: torch.Tensor, o: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> None:
        if self.rows:
            n = self.rows
            self.wrapper.run(q[:n], (k_cache, v_cache), out=o[:n])
