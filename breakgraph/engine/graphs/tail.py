"""Bounded replay of a model with KV-shared late layers (``model.bounded_prefill``, Gemma 4):
the tail layers on each request's last row, one breakable graph per tail-row count; the
attention break reads the live ``batch.tail()``."""

from __future__ import annotations

import contextlib

import torch

from breakgraph.engine.graphs.base import GraphsBase, GraphTarget
from breakgraph.forward_batch import ForwardBatch, ForwardMode, forward_context
from breakgraph.graph import StaticInput


class TailGraphs(GraphsBase):
    def __init__(self, target: GraphTarget, sizes: list[int]):
        super().__init__(target)
        model = target.model
        inputs = [StaticInput("positions", torch.int64)]
        inputs += [
            StaticInput(name, dtype, shape) for name, (shape, dtype) in model.tail_inputs().items()
        ]
        self.bank = self._bank(
            inputs,
            sizes,
            name="tail graphs",
            capture_context=self._capture_context,
        )

    def _forward(self, positions, hidden, per_layer_inputs=None):
        return self.model.forward_tail(hidden, per_layer_inputs, positions)

    @contextlib.contextmanager
    def _capture_context(self, size: int):
        """``size`` one-row requests over the padding row (their keys: slot 0)."""
        batch = ForwardBatch.build(
            ForwardMode.EXTEND, [0] * size, [0] * size, [self.pad_req_idx] * size,
            [0] * size, [1] * size, self.device,
        )  # fmt: skip
        with forward_context(self._capture_ctx(batch, size, self.bank)):
            yield

    def capture(self) -> None:
        self.bank.capture()

    def run(self, size: int, batch: ForwardBatch, hidden, per_layer_inputs) -> torch.Tensor:
        """The tail layers on the step's last rows (``hidden``: theirs) -> their final hidden
        states: through bucket ``size``, or eagerly where it is 0."""
        tail = batch.tail()
        with forward_context(self._context(tail)):
            if not size:
                return self.model.forward_tail(hidden, per_layer_inputs, tail.positions)
            live = {"hidden": hidden, "positions": tail.positions}
            if per_layer_inputs is not None:
                live["per_layer_inputs"] = per_layer_inputs
            return self.bank.replay(size, tail.batch_size, **live)[: tail.batch_size]
