"""Prefill graphs: a breakable forward per token bucket (attention is the eager break,
reading the live step), whole graphs for a lone short request, and the bounded-prefill tail.

A lone request whose whole context fits a small bucket (a short prompt with no cached prefix,
or a short one over a short prefix) replays a *whole* prefill graph instead: the same
forward captured with attention inline, on one request's metadata held in static buffers
(``PrefillGraphs.whole``). Its attention grid is the bucket's, the eager one's or larger
(the extra programs exit); its kernel is the eager one's at these sizes. It saves the
breaks' launches and the gaps between the segments.

A model with KV-shared late layers (``model.bounded_prefill``, Gemma 4) splits its prefill:
the token-bucket bank captures ``forward_head`` (the layers that store KV, all rows) and a
tail bank, bucketed by tail-row count, captures ``forward_tail`` (tail.py).
"""

from __future__ import annotations

import contextlib

import torch

from breakgraph.engine.graphs.base import GraphsBase, GraphTarget
from breakgraph.engine.graphs.key import PREFILL, PREFILL_WHOLE, TAIL, StepKey
from breakgraph.engine.graphs.tail import TailGraphs
from breakgraph.forward_batch import ForwardBatch, ForwardMode, forward_context
from breakgraph.graph import GraphBank, StaticInput


class PrefillGraphs(GraphsBase):
    """Breakable prefill graphs per token bucket; the attention break reads the live step."""

    def __init__(
        self,
        target: GraphTarget,
        buckets: list[int],
        max_pad_factor: float = 2.0,
        tail_sizes: list[int] | None = None,
        whole_max_tokens: int = 0,
    ):
        """``max_pad_factor``: the most a step may be padded to replay a bucket (the
        dispatcher reads it). ``tail_sizes``: the tail bank's row buckets, for a model with
        ``bounded_prefill``. ``whole_max_tokens``: the buckets up to it are captured whole
        too, for lone requests (none for a model with bounded prefill: its tail is a bank of
        its own, nor for one that says ``supports_whole_prefill_graphs = False``)."""
        super().__init__(target)
        self.max_pad_factor = max_pad_factor
        bounded = bool(getattr(target.model, "bounded_prefill", False))
        self.tail = TailGraphs(target, tail_sizes) if bounded and tail_sizes else None
        inputs = [
            StaticInput("input_ids", torch.int64),
            StaticInput("positions", torch.int64),
            StaticInput("out_cache_loc", torch.int64),  # the captured KV store's slots
        ]
        self.bank = self._bank(
            inputs, buckets, name="prefill graphs",
            capture_context=self._capture_context,
        )  # fmt: skip
        self.whole = None
        whole_sizes = [b for b in buckets if b <= whole_max_tokens]
        whole_ok = getattr(target.model, "supports_whole_prefill_graphs", True)
        if whole_sizes and self.tail is None and whole_ok:
            # the lone request's metadata the captured attention reads: its table row, its
            # context length and its new tokens (separate buffers: each 16-byte aligned, as
            # the uploaded rows are, so the kernels compile no variant of their own)
            dev = self.device
            self._one = {
                "req_pool_indices": torch.zeros(1, dtype=torch.int64, device=dev),
                "seq_lens": torch.zeros(1, dtype=torch.int32, device=dev),
                "extend_lens": torch.zeros(1, dtype=torch.int32, device=dev),
                "extend_start_loc": torch.zeros(1, dtype=torch.int32, device=dev),  # stays 0
            }
            self.whole = self._bank(
                inputs, whole_sizes, name="whole prefill graphs",
                split_at_breaks=False, capture_context=self._capture_whole_context,
            )  # fmt: skip

    @property
    def banks(self) -> dict[str, GraphBank]:
        """This set's banks by their names in key.py."""
        banks = {PREFILL: self.bank}
        if self.whole is not None:
            banks[PREFILL_WHOLE] = self.whole
        if self.tail is not None:
            banks[TAIL] = self.tail.bank
        return banks

    def _forward(self, input_ids, positions, out_cache_loc):
        del out_cache_loc  # the KV store reads it through the capture's forward context
        if self.tail is not None:
            return self.model.forward_head(input_ids, positions)
        return self.model(input_ids, positions)

    def _one_request(self, size: int) -> ForwardBatch:
        """One request of ``size`` new tokens over the padding row (slot 0 everywhere)."""
        return ForwardBatch.build(
            ForwardMode.EXTEND, [0] * size, [0] * size, [self.pad_req_idx], [0], [size], self.device
        )

    @contextlib.contextmanager
    def _capture_context(self, size: int):
        """A bucket is captured on one request of ``size`` new tokens; the KV store on the
        bank's static slots."""
        batch = self._one_request(size)
        batch.out_cache_loc = self.bank.views(size)["out_cache_loc"]
        with forward_context(self._capture_ctx(batch, size, self.bank)):
            yield

    @contextlib.contextmanager
    def _capture_whole_context(self, size: int):
        """One request of ``size`` new tokens, its metadata the static buffers a replay
        fills, and the grid the bucket's: every live count up to ``size``."""
        batch = self._one_request(size)
        one = self._one
        one["req_pool_indices"].fill_(self.pad_req_idx)
        one["seq_lens"].fill_(size)
        one["extend_lens"].fill_(size)
        for name, buf in one.items():
            setattr(batch, name, buf)
        batch.out_cache_loc = self.whole.views(size)["out_cache_loc"]
        ctx = self._capture_ctx(batch, size, self.whole)
        ctx.attention_zeroes_padding = True  # its grid covers every row of the bucket
        with forward_context(ctx):
            yield

    def capture(self) -> None:
        self.bank.capture()
        if self.whole is not None:
            self.whole.capture()
        if self.tail is not None:
            self.tail.capture()

    def replay(self, key: StepKey, batch: ForwardBatch) -> torch.Tensor:
        """The step's logits [B, vocab] through ``key`` (``PREFILL`` or ``PREFILL_WHOLE``)."""
        bank = self.bank
        if key.bank == PREFILL_WHOLE:
            bank, one = self.whole, self._one  # its attention reads these, by address
            torch._foreach_copy_(
                [one["seq_lens"], one["extend_lens"]], [batch.seq_lens, batch.extend_lens]
            )
            one["req_pool_indices"].copy_(batch.req_pool_indices)
        else:
            assert key.bank == PREFILL, key
        # the attention break reads the live batch; the captured KV store, the bank's slots
        with forward_context(self._context(batch)):
            out = bank.replay(
                key.size,
                batch.num_tokens,
                input_ids=batch.input_ids,
                positions=batch.positions,
                out_cache_loc=batch.out_cache_loc,
            )
        rows = batch.logits_rows
        if self.tail is None:
            if self.target.keep_hidden:
                self.last_hidden = out
            return self.model.compute_logits(out[rows])
        hidden, per_layer_inputs = out
        if per_layer_inputs is not None:
            per_layer_inputs = per_layer_inputs[rows]
        final = self.tail.run(key.tail, batch, hidden[rows], per_layer_inputs)
        return self.model.compute_logits(final)
