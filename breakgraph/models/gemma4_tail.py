"""Gemma 4's bounded prefill: the KV-shared layers on the LM head's rows only.

In an extend step the KV-shared layers (the last ``num_kv_shared_layers``) store no KV, so
they only matter for the rows whose hidden states feed the LM head. With
``kv_sharing_fast_prefill``, ``forward_logits_rows`` runs the layers before the first shared
one on all rows (``forward_head``) and the shared layers on each request's last row only
(``forward_tail``), over the metadata of ``ForwardBatch.tail()``; the result equals
``forward(...)[logits_rows]``. The runner's prefill bank captures ``forward_head`` per token
bucket and a tail bank ``forward_tail`` per tail-row bucket (``engine/graphs/``);
eagerly, ``forward_logits_rows`` runs both.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from breakgraph.forward_batch import ForwardMode, forward_context, get_forward_context
from breakgraph.models.config import ModelConfig

if TYPE_CHECKING:
    from breakgraph.models.gemma4 import Gemma4TextModel


class Gemma4BoundedPrefill:
    """Head/tail forwards of ``Gemma4ForCausalLM`` (its ``model``, ``config`` and
    ``kv_sharing_fast_prefill``)."""

    model: Gemma4TextModel
    config: ModelConfig
    kv_sharing_fast_prefill: bool  # set by the model, the same on every TP rank

    @property
    def bounded_prefill(self) -> bool:
        """Extend steps split into head (all rows) and tail (each request's last row)."""
        return self.kv_sharing_fast_prefill

    def forward_logits_rows(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Final hidden states [R, hidden] of the step's ``logits_rows`` (each request's last).

        With ``kv_sharing_fast_prefill`` in an extend step, the KV-shared layers run on those
        rows only, attending over each request's whole context (``ForwardBatch.tail``); the
        result equals ``forward(...)[logits_rows]``.
        """
        ctx = get_forward_context()
        batch = ctx.batch
        # a step that wants more rows than one per request (a speculative verify step: every
        # row) runs every layer on every row
        every_row = batch.logits_rows.shape[0] != batch.batch_size
        if not (self.kv_sharing_fast_prefill and batch.mode is ForwardMode.EXTEND) or every_row:
            return self.model(input_ids, positions)[batch.logits_rows]
        hidden, per_layer_inputs = self.forward_head(input_ids, positions)
        rows, tail = batch.logits_rows, batch.tail()
        with forward_context(dataclasses.replace(ctx, batch=tail)):
            return self.forward_tail(
                hidden[rows],
                None if per_layer_inputs is None else per_layer_inputs[rows],
                tail.positions,
            )

    def forward_head(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Hidden states [T, hidden] after the KV-storing layers, on all rows, and the
        per-layer inputs [T, layers, P] (None without PLE) the tail layers need."""
        model = self.model
        hidden, per_layer_inputs = model.embed(input_ids)
        head = range(model.first_kv_shared_layer_idx)
        return model.run_layers(hidden, per_layer_inputs, positions, head), per_layer_inputs

    def forward_tail(
        self, hidden: torch.Tensor, per_layer_inputs: torch.Tensor | None, positions: torch.Tensor
    ) -> torch.Tensor:
        """The KV-shared layers and the final norm on tail rows (the context's batch is the
        step's ``tail()``)."""
        model = self.model
        tail = range(model.first_kv_shared_layer_idx, len(model.layers))
        return model.norm(model.run_layers(hidden, per_layer_inputs, positions, tail))

    def tail_inputs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Trailing shape and dtype of each tail input per row (for a graph bank's buffers)."""
        dtype = self.model.embed_tokens.weight.dtype
        inputs = {"hidden": ((self.config.hidden_size,), dtype)}
        p = self.model.hidden_size_per_layer_input
        if p:
            inputs["per_layer_inputs"] = ((len(self.model.layers), p), dtype)
        return inputs
