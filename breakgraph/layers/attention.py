"""The attention front: where a layer's new k/v go, and the paged-attention call.

A model stores the step's new k/v rows with the kernel that produces k (the fused RoPE
kernels take ``Attention.kv_write(v)``): the store only needs the step's slots, which graphs
keep in a static buffer, so it is part of a captured segment. ``paged_attention`` then reads
the live step's metadata (forward context) and runs extend or decode attention over the
paged cache, writing into the output tensor it is given: it is the eager break of the
prefill graphs (decode graphs capture it inline).

A layer reads and writes the pool's KV layer ``kv_layer_id`` (its own layer id unless the
model shares KV: then the KV-shared layers store nothing and read their source's KV).
"""

from __future__ import annotations

import torch
from torch import nn

from breakgraph.forward_batch import ForwardMode, get_forward_context
from breakgraph.graph import eager_break
from breakgraph.kernels import ops


@eager_break
def paged_attention(
    q: torch.Tensor,
    o: torch.Tensor,
    kv_layer_id: int,
    scaling: float,
    sliding_window: int | None = None,
) -> None:
    """q/o [T, H, D] over the paged KV of the live step. Writes o's rows of requests only."""
    ctx = get_forward_context()
    batch = ctx.batch
    k_cache = ctx.kv_pool.k_buffers[kv_layer_id]
    v_cache = ctx.kv_pool.v_buffers[kv_layer_id]
    if batch.mode is ForwardMode.DECODE:
        meta = batch.attention_meta(ctx.req_to_token)
        ops.decode_attention(q, o, k_cache, v_cache, meta, scaling, sliding_window=sliding_window)
    else:
        # a step's launch plan is shared by every layer of its shape, scale and window:
        # computed at the first such layer, cached on the batch
        key = (q.shape[1], *k_cache.shape[1:], scaling, sliding_window)
        plan = batch.attention_plans.get(key)
        if plan is None:
            meta = batch.attention_meta(ctx.req_to_token)
            plan = batch.attention_plans[key] = ops.plan_extend_attention(
                q, k_cache, meta, scaling, sliding_window=sliding_window,
                zero_pad=ctx.attention_zeroes_padding,
            )  # fmt: skip
        plan(q, o, k_cache, v_cache)


class Attention(nn.Module):
    """Paged attention of one layer.

    ``scaling`` defaults to ``head_dim ** -0.5``; ``sliding_window`` W limits each row to its
    last W keys (None: the whole context); ``kv_layer_id`` is the pool's KV layer this layer
    reads and writes (default: ``layer_id``).
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        layer_id: int,
        *,
        scaling: float | None = None,
        sliding_window: int | None = None,
        kv_layer_id: int | None = None,
    ):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.layer_id = layer_id
        self.kv_layer_id = layer_id if kv_layer_id is None else kv_layer_id
        self.scaling = head_dim**-0.5 if scaling is None else scaling
        self.sliding_window = sliding_window

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        """q [T, H, D] -> [T, H * D] over the KV stored in this layer's KV layer: the step's
        own rows stored by the caller (``self.kv_write(v)`` to the kernel producing k), or
        written by another layer (KV sharing)."""
        o = torch.empty_like(q)
        ctx = get_forward_context()
        pad_from = ctx.pad_rows_from
        if pad_from is not None and pad_from < o.shape[0] and not ctx.attention_zeroes_padding:
            # captured: padding rows get a defined value (the kernels skip rows of no request)
            o[pad_from:].zero_()
        paged_attention(q, o, self.kv_layer_id, self.scaling, self.sliding_window)
        return o.view(q.shape[0], self.num_heads * self.head_dim)

    def kv_write(self, v: torch.Tensor) -> ops.KVWrite:
        """Where the live step's new k/v rows of this layer go (padding rows carry slot 0),
        with its new v rows, for the kernel that stores k as it produces it.

        Capturable: inside a prefill graph ``out_cache_loc`` is the bank's static, padded
        buffer, so the store is part of the segment rather than a launch in the break.
        """
        ctx = get_forward_context()
        pool = ctx.kv_pool
        k_cache, v_cache = pool.k_buffers[self.kv_layer_id], pool.v_buffers[self.kv_layer_id]
        return ops.KVWrite(v, k_cache, v_cache, ctx.batch.out_cache_loc)
