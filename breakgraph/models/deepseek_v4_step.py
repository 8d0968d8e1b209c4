"""DeepSeek V4's per-step derivations, split by what a CUDA graph may bake in.

- ``V4Rows``: what depends only on each row's position and KV slot: the rope of the rows per
  kind and, per compression ratio, each row's slot in its window, the rope at its window's
  first position and where its entry goes (its KV slot where it closes the window, else the
  reserved slot 0). Made from the forward's own ``positions`` and the step's
  ``out_cache_loc``, which a graph bank holds in static buffers, so a graph captures it.
- ``live_step()``: what depends on the step's requests (each row's request, each request's
  table row, its first and last position, whether its compressors start fresh, and the host
  bounds of the ops' shapes). A prefill step's is read only inside the eager breaks
  (``deepseek_v4_attention.py``), from the live step, to which they slice their
  bucket-sized tensors. A decode step's is built from device values alone with static
  bounds (one row per request; the entries a row may see bounded by the request table's
  width, i.e. the context length), so a decode graph captures it whole and an eager decode
  step computes the same thing.
"""

from __future__ import annotations

import torch

from breakgraph.forward_batch import ForwardBatch, ForwardMode, get_forward_context
from breakgraph.kernels.compressed_attention import CompressedStep

_ROWS = "deepseek_v4_rows"
_STEP = "deepseek_v4"


class V4Rows:
    """The rows' own derivations (positions [T], slots [T]), each made at the first layer
    that asks and shared by the rest of the forward."""

    def __init__(self, rotary, positions: torch.Tensor, out_cache_loc: torch.Tensor):
        self.rotary = rotary
        self.positions = positions
        self.out_cache_loc = out_cache_loc
        self._made: dict = {}

    def _get(self, key, make):
        value = self._made.get(key)
        if value is None:
            value = self._made[key] = make()
        return value

    def rope(self, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of rope ``kind`` at the rows' positions."""
        return self._get(("rope", kind), lambda: self.rotary(self.positions, kind))

    def windows(self, ratio: int) -> tuple[torch.Tensor, ...]:
        """(slot in its window, cos, sin at its window's first position, its entry's slot)
        per row, for the compressors of ``ratio``."""
        return self._get(("windows", ratio), lambda: self._windows(ratio))

    def _windows(self, ratio: int) -> tuple[torch.Tensor, ...]:
        pos = self.positions
        slot_in_window = pos % ratio
        cos, sin = self.rotary(pos - slot_in_window, "compress")
        closes = slot_in_window == ratio - 1
        loc = self.out_cache_loc
        return slot_in_window, cos, sin, torch.where(closes, loc, torch.zeros_like(loc))


def begin_rows(rotary, positions: torch.Tensor) -> V4Rows:
    """The forward's rows, from its own ``positions`` (a graph's static buffer, not the
    capture batch's): called once by a V4 forward before its layers."""
    batch = get_forward_context().batch
    rows = batch.attention_plans[_ROWS] = V4Rows(rotary, positions, batch.out_cache_loc)
    return rows


def step_rows(rotary) -> V4Rows:
    """The rows ``begin_rows`` made, or (a layer run outside a V4 forward, eagerly) the
    batch's own."""
    batch = get_forward_context().batch
    rows = batch.attention_plans.get(_ROWS)
    if rows is None:
        rows = begin_rows(rotary, batch.positions)
    return rows


def live_step() -> CompressedStep:
    """The live step as the compressed-attention ops read it: built at the first break that
    asks, kept on the batch (device ops only, no host sync)."""
    ctx = get_forward_context()
    batch = ctx.batch
    step = batch.attention_plans.get(_STEP)
    if step is None:
        make = _decode_step if batch.mode is ForwardMode.DECODE else _extend_step
        step = batch.attention_plans[_STEP] = make(batch, ctx.req_to_token)
    return step


def _extend_step(batch: ForwardBatch, req_to_token: torch.Tensor) -> CompressedStep:
    """A prefill (extend) step from its lengths; the ops' bounds from the host copies."""
    t = batch.input_ids.shape[0]
    b = batch.seq_lens.shape[0]
    ext = batch.extend_lens.long()
    row_req = torch.repeat_interleave(torch.arange(b, device=ext.device), ext, output_size=t)
    first = batch.out_cache_loc[batch.extend_start_loc.long().clamp(max=max(t - 1, 0))]
    return CompressedStep(
        positions=batch.positions,
        row_req=row_req,
        req_rows=batch.req_pool_indices,
        start_pos=batch.prefix_lens.long(),
        end_pos=batch.seq_lens.long(),
        fresh=(batch.prefix_lens == 0) | (first == 0),
        req_to_token=req_to_token,
        max_extend=max(batch.extend_lens_cpu) if batch.extend_lens_cpu else 1,
        max_seq=max(batch.seq_lens_cpu) if batch.seq_lens_cpu else 1,
    )


def _decode_step(batch: ForwardBatch, req_to_token: torch.Tensor) -> CompressedStep:
    """A decode step from its device rows alone (row i is request i at its position; a
    padding row is the padding request at position 0, slot 0: fresh) and static bounds, so
    that a decode graph, whose host lengths are placeholders, computes what eager does."""
    pos = batch.positions
    b = pos.shape[0]
    return CompressedStep(
        positions=pos,
        row_req=torch.arange(b, device=pos.device),
        req_rows=batch.req_pool_indices,
        start_pos=pos,
        end_pos=pos + 1,
        fresh=(pos == 0) | (batch.out_cache_loc == 0),
        req_to_token=req_to_token,
        max_extend=1,
        max_seq=req_to_token.shape[1],
    )
