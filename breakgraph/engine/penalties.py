"""Repetition, frequency and presence penalties, logit_bias and min_new_tokens on the device.

A request with penalties owns a row of ``PenaltyPool``: its output-token counts and a mask of
its prompt's tokens, both on the device. A step gathers the batch's rows, applies the
penalties to all of them at once, and adds the sampled ids back with one scatter: no host sync.
"""

from __future__ import annotations

import torch

from breakgraph.engine.request import Req
from breakgraph.forward_batch import upload_many


def apply_penalties(
    logits: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor, params: torch.Tensor
) -> torch.Tensor:
    """logits, counts (output tokens) [B, V] float, seen (prompt or output) [B, V] bool and
    params [B, 3] (frequency, presence, repetition) -> the penalized logits.

    Repetition (HF/SGLang): a seen token's logit is divided by p if positive, else multiplied;
    frequency/presence (OpenAI): ``logit -= count * frequency + (count > 0) * presence``."""
    freq, pres, rep = params[:, 0:1], params[:, 1:2], params[:, 2:3]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    return logits - counts * freq - (counts > 0).to(logits.dtype) * pres


class PenaltyPool:
    """Per-request token counts on the device, rows handed out to requests with penalties."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        self.counts = torch.zeros(0, vocab_size, device=device)
        self.prompt_seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self.free: list[int] = []
        # the step's (batch rows, pool rows) on the device: uploaded once, by ``process`` or
        # ``record``, for the step's request list (the same list object in both)
        self._step_reqs: list[Req] | None = None
        self._step_rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def _rows(self, reqs: list[Req]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows in the batch, rows in the pool) of the requests holding a row; None: none."""
        if reqs is not self._step_reqs:
            pen = [i for i, r in enumerate(reqs) if r.penalty_row is not None]
            self._step_reqs, self._step_rows = reqs, None
            if pen:
                rows = upload_many(
                    [pen, [reqs[i].penalty_row for i in pen]], torch.int64, self.device
                )
                self._step_rows = (rows[0], rows[1])
        return self._step_rows

    @property
    def rows_in_use(self) -> int:
        return self.counts.shape[0] - len(self.free)

    def acquire(self, req: Req) -> None:
        """A row for ``req``: zero counts and its prompt's tokens marked (once per request)."""
        if req.penalty_row is not None:
            return
        if not self.free:
            grow = max(self.counts.shape[0], 4)
            start = self.counts.shape[0]
            self.counts = torch.cat([self.counts, self.counts.new_zeros(grow, self.vocab_size)])
            self.prompt_seen = torch.cat(
                [self.prompt_seen, self.prompt_seen.new_zeros(grow, self.vocab_size)]
            )
            self.free.extend(range(start + grow - 1, start - 1, -1))
        row = self.free.pop()
        req.penalty_row = row
        self.counts[row].zero_()
        self.prompt_seen[row].zero_()
        (prompt,) = upload_many([req.input_ids], torch.int64, self.device)
        self.prompt_seen[row].index_fill_(0, prompt, True)
        if req.output_ids:  # a retracted request keeps its counts: it comes back with outputs
            (out,) = upload_many([req.output_ids], torch.int64, self.device)
            self.counts[row].index_add_(0, out, torch.ones_like(out, dtype=self.counts.dtype))

    def release(self, req: Req) -> None:
        if req.penalty_row is not None:
            self.free.append(req.penalty_row)
            req.penalty_row = None

    def process(
        self, logits: torch.Tensor, reqs: list[Req], eos_token_ids: set[int]
    ) -> torch.Tensor:
        """The batch's logits with penalties, logit_bias and min_new_tokens applied (device)."""
        pen = [i for i, r in enumerate(reqs) if r.penalty_row is not None]
        bias_rows, bias_cols, bias_vals = [], [], []
        for i, r in enumerate(reqs):
            sp = r.sampling
            for tok, b in (sp.logit_bias or {}).items():
                bias_rows.append(i)
                bias_cols.append(int(tok))
                bias_vals.append(b)
            if r.num_generated < sp.min_new_tokens:
                banned = set(sp.stop_token_ids)
                if not sp.ignore_eos:
                    banned |= eos_token_ids
                for tok in sorted(banned):
                    bias_rows.append(i)
                    bias_cols.append(tok)
                    bias_vals.append(float("-inf"))
        if not pen and not bias_rows:
            return logits
        logits = logits.clone()
        if pen:
            rows_b, rows_pool = self._rows(reqs)
            (params,) = upload_many(
                [
                    [
                        x
                        for i in pen
                        for x in (
                            reqs[i].sampling.frequency_penalty,
                            reqs[i].sampling.presence_penalty,
                            reqs[i].sampling.repetition_penalty,
                        )
                    ]
                ],
                torch.float32,
                self.device,
            )
            counts = self.counts[rows_pool]
            seen = self.prompt_seen[rows_pool] | (counts > 0)
            penalized = apply_penalties(logits[rows_b], counts, seen, params.view(-1, 3))
            logits.index_copy_(0, rows_b, penalized)
        if bias_rows:
            rows, cols = upload_many([bias_rows, bias_cols], torch.int64, self.device)
            (vals,) = upload_many([bias_vals], torch.float32, self.device)
            # scatter_add_ on flat indices: sync-free on CUDA (-inf stays -inf)
            logits.view(-1).scatter_add_(0, rows * logits.shape[-1] + cols, vals)
        return logits

    def record(self, reqs: list[Req], ids: torch.Tensor) -> None:
        """Count the sampled ids (device tensor [B]) for the requests with a row; no sync."""
        rows = self._rows(reqs)
        if rows is None:
            return
        rows_b, rows_pool = rows
        toks = ids[rows_b]
        flat = rows_pool * self.vocab_size + toks
        self.counts.view(-1).scatter_add_(0, flat, torch.ones_like(toks, dtype=self.counts.dtype))
