"""Runs one forward of a ForwardBatch: sets the forward context, returns last-row logits."""

from __future__ import annotations

import torch
from torch import nn

from breakgraph.forward_batch import ForwardBatch, ForwardContext, forward_context


class ModelRunner:
    """Eager runner. Graph runners (decode CUDA graphs, prefill graph bank) wrap ``run``."""

    def __init__(self, model: nn.Module, kv_pool, req_to_token: torch.Tensor):
        self.model = model
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """-> logits [B, vocab] float32 of each request's last row."""
        ctx = ForwardContext(batch=batch, kv_pool=self.kv_pool, req_to_token=self.req_to_token)
        with forward_context(ctx):
            hidden = self.model(batch.input_ids, batch.positions)
        return self.model.compute_logits(hidden[batch.logits_rows])
