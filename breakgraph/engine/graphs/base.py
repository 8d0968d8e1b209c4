"""What every bank of the engine shares: the bucket sizes, the forward context a bucket is
captured in, the guard list and the compile check.

The padding convention, in one place: a bucket's rows past the live ones are padding; their
input ids and positions are 0, their KV slot is 0 (reserved, never part of a real request's
context), decode padding rows belong to the padding request (``pad_req_idx``: its
req_to_token row is all zeros, so slot 0) with ``seq_len`` 1, and their outputs are dropped.
Prefill padding rows belong to no request, so attention leaves them unwritten: the captured
graph zeroes them first (a whole graph's attention kernel writes the zeros itself), so every
padding value stays defined (slot 0 never receives NaN/Inf from uninitialized memory).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from breakgraph.forward_batch import ForwardBatch, ForwardContext
from breakgraph.graph import GraphBank, StaticInput
from breakgraph.kernels import jit_watch, ops


def decode_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to max_bs (SGLang's default shape)."""
    sizes = [b for b in (1, 2, 4, 8) if b <= max_bs]
    sizes += list(range(16, max_bs + 1, 8))
    if max_bs not in sizes:
        sizes.append(max_bs)
    return sorted(set(sizes))


def prefill_token_buckets(max_tokens: int, step: int = 256) -> list[int]:
    """Multiples of ``step`` up to ``max_tokens`` (which is always a bucket)."""
    sizes = list(range(step, max_tokens + 1, step))
    if not sizes or sizes[-1] != max_tokens:
        sizes.append(max_tokens)
    return sizes


@dataclass(frozen=True)
class GraphTarget:
    """What every bank of a rank captures against: the model, its KV pool and request table,
    the padding request's table row, the one memory pool, the address guard's setting."""

    model: nn.Module
    kv_pool: object
    req_to_token: torch.Tensor
    pad_req_idx: int
    pool: object  # torch.cuda.graph_pool_handle()
    check_addresses: bool | None = None  # None: BREAKGRAPH_GRAPH_GUARD
    # the step's hidden rows are an output too (``last_hidden``: NEXTN's MTP layers read them)
    keep_hidden: bool = False


class GraphsBase:
    def __init__(self, target: GraphTarget):
        self.target = target
        self.model = target.model
        self.kv_pool = target.kv_pool
        self.req_to_token = target.req_to_token
        self.pad_req_idx = target.pad_req_idx
        self.device = target.req_to_token.device
        self.last_hidden: torch.Tensor | None = None  # ``keep_hidden``: the last replay's

    def _context(self, batch: ForwardBatch) -> ForwardContext:
        return ForwardContext(batch=batch, kv_pool=self.kv_pool, req_to_token=self.req_to_token)

    def _bank(
        self,
        inputs: list[StaticInput],
        sizes: list[int],
        *,
        name: str,
        split_at_breaks: bool = True,
        capture_context=None,
        fn=None,
    ) -> GraphBank:
        """A bank over ``fn`` (default ``self._forward``), guarded and compile-checked like
        every bank here."""
        return GraphBank(
            fn or self._forward,
            inputs,
            sizes,
            self.device,
            pool=self.target.pool,
            split_at_breaks=split_at_breaks,
            guard_tensors=self._guard_tensors,
            check_addresses=self.target.check_addresses,
            capture_context=capture_context,
            compile_counter=self._compile_counter(),
            name=name,
        )

    def _capture_ctx(self, batch: ForwardBatch, size: int, bank: GraphBank) -> ForwardContext:
        """The context a bucket of ``size`` rows of ``bank`` is captured in: rows past the
        next smaller bucket are the ones a replay may pad (a smaller count takes a smaller
        bucket)."""
        ctx = self._context(batch)
        smaller = [b for b in bank.sizes if b < size]
        ctx.pad_rows_from = smaller[-1] if smaller else 0
        return ctx

    def _guard_tensors(self):
        """Buffers captured kernels read by address: weights, rotary caches, KV, the table,
        kernel workspaces. (cuBLAS's workspaces are allocated inside the captures, in the
        pool: see graph/breakable.py.)"""
        yield from self.model.parameters()
        yield from self.model.buffers()
        yield from self.kv_pool.k_buffers
        yield from self.kv_pool.v_buffers
        yield from self.kv_pool.slot_buffers.values()  # beside the KV (DeepSeek V4's entries)
        yield from self.kv_pool.request_states.values()  # per-request state, read by address
        yield self.req_to_token
        yield from ops.graph_workspaces()

    @staticmethod
    def _compile_counter():
        """JIT compilations (Triton), or None where Triton is absent."""
        return (lambda: jit_watch.stats().total) if jit_watch.install() else None
