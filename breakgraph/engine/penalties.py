"""Repetition, frequency and presence penalties, logit_bias and min_new_tokens on the device.

A request with any of them owns a row of ``PenaltyPool``: its output-token counts, a mask of
its prompt's tokens, its penalty parameters, its logit_bias as a dense row, the tokens
min_new_tokens masks and how many tokens it has generated, all on the device. Row 0 is
neutral (no penalty, no bias, nothing masked): requests without a row and padding rows read
it. A step maps its batch rows to pool rows (one upload) and ``apply`` gathers and applies
everything with device ops only: no host sync, and capture-safe, so the decode graphs run it
inside their replay (``DecodeGraphs``) reading the pool by address. ``record`` adds the
sampled ids back with one scatter.

With CUDA graphs the pool is fixed (``capacity`` rows, allocated once: a graph reads its
tensors by address); a request needing a row waits in the queue while none is free. Without
graphs it grows on demand.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from breakgraph.engine.request import Req
from breakgraph.forward_batch import upload_many
from breakgraph.kernels import ops

NEUTRAL_ROW = 0


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


@dataclass
class Drafted:
    """A verify step's draft tokens as ``PenaltyPool.apply`` counts them (device tensors):
    row ``rows[e]`` counts ``tokens[e]`` once more; row r has generated ``before[r]`` more
    tokens (its draft tokens before it)."""

    rows: torch.Tensor  # [E] int64
    tokens: torch.Tensor  # [E] int64
    before: torch.Tensor  # [R] int32


def needs_row(req: Req) -> bool:
    """Whether the request's sampling reads pool state (penalties, bias, min_new_tokens)."""
    sp = req.sampling
    return sp.has_penalties or bool(sp.logit_bias) or sp.min_new_tokens > 0


class PenaltyPool:
    """Per-request sampling state on the device; row 0 neutral, rows handed out to requests."""

    def __init__(
        self,
        vocab_size: int,
        device: torch.device,
        eos_token_ids: set[int],
        capacity: int | None = None,
    ):
        """``capacity``: a fixed number of request rows (CUDA graphs read the tensors by
        address); None: start small and grow."""
        self.vocab_size = vocab_size
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.fixed = capacity is not None
        self.counts = torch.zeros(0, vocab_size, device=device)  # output tokens, per token
        self.prompt_seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self.bias = torch.zeros(0, vocab_size, device=device)  # logit_bias
        self.banned = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self.params = torch.zeros(0, 3, device=device)  # frequency, presence, repetition
        self.min_new = torch.zeros(0, dtype=torch.int32, device=device)
        self.generated = torch.zeros(0, dtype=torch.int32, device=device)
        self.free: list[int] = []
        self._grow(1 + (capacity if capacity is not None else 4))
        self.free.remove(NEUTRAL_ROW)

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer ``apply`` reads (their addresses stay fixed in a fixed pool)."""
        return [
            self.counts, self.prompt_seen, self.bias, self.banned, self.params, self.min_new,
            self.generated,
        ]  # fmt: skip

    def _grow(self, rows: int) -> None:
        start = self.counts.shape[0]
        grown = []
        for t in self.tensors():
            extra = t.new_zeros(rows, *t.shape[1:])
            grown.append(torch.cat([t, extra]))
        (self.counts, self.prompt_seen, self.bias, self.banned, self.params, self.min_new,
         self.generated) = grown  # fmt: skip
        self.params[start:, 2] = 1.0  # repetition 1: neutral
        self.free.extend(range(start + rows - 1, start - 1, -1))

    @property
    def capacity(self) -> int:
        return self.counts.shape[0] - 1

    @property
    def rows_in_use(self) -> int:
        return self.capacity - len(self.free)

    def has_room(self, req: Req) -> bool:
        """Whether ``req`` can start: it needs no row, holds one, or one is free (or can be)."""
        return (
            not needs_row(req) or req.penalty_row is not None or bool(self.free) or not self.fixed
        )

    def acquire(self, req: Req) -> None:
        """A row for ``req`` if it needs one and holds none: its state written once."""
        if req.penalty_row is not None or not needs_row(req):
            return
        if not self.free:
            assert not self.fixed, "has_room() is checked at admission"
            self._grow(max(self.capacity, 4))
        row = self.free.pop()
        req.penalty_row = row
        sp = req.sampling
        self.counts[row].zero_()
        self.prompt_seen[row].zero_()
        self.bias[row].zero_()
        self.banned[row].zero_()
        banned = set(sp.stop_token_ids) | (set() if sp.ignore_eos else self.eos_token_ids)
        banned = sorted(t for t in banned if 0 <= t < self.vocab_size)
        bias = sorted((int(t), float(b)) for t, b in (sp.logit_bias or {}).items())
        prompt, out, bias_ids, ban_ids, ints = upload_many(
            [req.input_ids, req.output_ids, [t for t, _ in bias], banned,
             [sp.min_new_tokens, len(req.output_ids)]],
            torch.int64,
            self.device,
        )  # fmt: skip
        (row_params,) = upload_many(
            [[sp.frequency_penalty, sp.presence_penalty, sp.repetition_penalty]
             + [b for _, b in bias]],
            torch.float32,
            self.device,
        )  # fmt: skip
        self.params[row] = row_params[:3]
        self.prompt_seen[row].index_fill_(0, prompt, True)
        self.bias[row].index_copy_(0, bias_ids, row_params[3:])
        self.banned[row].index_fill_(0, ban_ids, True)
        # a retracted request keeps its counts: it comes back with outputs
        self.counts[row].index_add_(0, out, torch.ones_like(out, dtype=self.counts.dtype))
        # device copies: assigning a Python number to a CUDA element would sync the host
        self.min_new[row : row + 1].copy_(ints[0:1])
        self.generated[row : row + 1].copy_(ints[1:2])

    def release(self, req: Req) -> None:
        if req.penalty_row is not None:
            self.free.append(req.penalty_row)
            req.penalty_row = None

    def rows(self, reqs: list[Req]) -> torch.Tensor | None:
        """The pool row of each of ``reqs`` (device int64, 0: none), in one upload; None
        when no request holds a row. A step computes it once and hands it on."""
        held = [r.penalty_row or NEUTRAL_ROW for r in reqs]
        return upload_many([held], torch.int64, self.device)[0] if any(held) else None

    def apply(
        self, logits: torch.Tensor, rows: torch.Tensor, drafted: Drafted | None = None
    ) -> torch.Tensor:
        """logits [B, V] float and their pool rows [B] -> logits with penalties, logit_bias
        and min_new_tokens applied. Device ops on fixed-shape gathers only (graph-safe);
        neutral rows come out bit-identical. ``drafted``: a verify step's rows, each after
        the draft tokens before it (counted, and generated, as if sampled already)."""
        return ops.apply_penalties(logits, rows, *self.tensors(), drafted=drafted)

    def record(self, rows: torch.Tensor, ids: torch.Tensor) -> None:
        """Count the sampled ids [B] of the batch rows ``rows`` [B] (neutral rows stay zero);
        device ops, no sync."""
        held = (rows != NEUTRAL_ROW).to(torch.int32)
        self.counts.view(-1).scatter_add_(
            0, rows * self.vocab_size + ids, held.to(self.counts.dtype)
        )
        self.generated.scatter_add_(0, rows, held)
