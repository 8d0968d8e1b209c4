"""A launched step: what its launch queued on the device for the read-back (``Launched``), and
its sampling (``sample_step``): the penalty pool, then the grammar's mask, the sampler, the
logprobs of the sampled tokens. The scheduler samples a step at its launch, or later where a
constrained row's mask needs the step in flight's tokens first.

Structured output (engine/grammar/): a constrained row's token bitmask depends on the token its
request sampled one step earlier. Under overlap that token is still on the device when the
next step launches, so such a step launches its forward, reads the previous step back (which
advances the matchers), and only then fills the mask and samples: the host's fill runs while
the GPU runs the forward, and no host sync is added inside the step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from breakgraph.engine.logprobs import ReadBack, token_logprobs
from breakgraph.engine.prompt_logprobs import PromptRows
from breakgraph.engine.request import Req
from breakgraph.engine.sampler import sample
from breakgraph.engine.verify_step import Verify
from breakgraph.forward_batch import ForwardBatch

# (batch, pool rows) -> (logits, logits with the penalty pool applied)
PenalizedForward = Callable[[ForwardBatch, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# (batch, prompt rows [R], their target ids [R], top-k) ->
#   (logits [B, V] of each request's last row, logprobs [R], top-k logprobs [R, k], ids [R, k])
PromptForward = Callable[
    [ForwardBatch, torch.Tensor, torch.Tensor, int],
    tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None],
]


@dataclass
class Launched:
    """What a launch queued on the device, read back by ``Scheduler.process_outputs``."""

    done: list[Req]  # requests sampled this step
    readback: ReadBack
    sampled: torch.Tensor | None = None  # their sampled ids on the device [len(done)]
    ids: int | None = None  # ReadBack handles
    logprobs: int | None = None
    top_values: int | None = None
    top_ids: int | None = None
    top_k: int = 0
    prompt: list[PromptRows] | None = None
    prompt_handles: tuple[int, int | None, int | None] | None = None
    prompt_top_k: int = 0
    # launched, not yet sampled: (logits, logits with the penalty pool applied or None, pool
    # rows or None); a constrained row's mask waits for the step in flight (sample_step)
    unsampled: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None = None
    verify: Verify | None = None  # a speculative verify step (engine/speculative.py)

    def add_prompt(self, prompt: list[PromptRows], k: int, lp, top_v, top_i) -> None:
        """Queue a step's prompt-logprob rows (top-k ``k``) for the read-back."""
        rb = self.readback
        self.prompt, self.prompt_top_k = prompt, k
        self.prompt_handles = (
            rb.add(lp),
            None if top_v is None else rb.add(top_v),
            None if top_i is None else rb.add(top_i),
        )

    def serves(self, reqs: dict[str, Req]) -> bool:
        """Whether a request it samples or takes prompt logprobs for is still live in
        ``reqs`` (the scheduler's, by id)."""
        mine = self.done + [p.req for p in self.prompt or []]
        return any(reqs.get(r.rid) is r for r in mine)

    def tokens(self, values) -> tuple[list[int], list | None, list | None]:
        """From the read-back ``values``: each request's sampled id, its logprob (None: none
        asked for) and its top-k ``[[logprob, id], ...]`` (None: none asked for)."""
        ids = [int(t) for t in values[self.ids]]
        lps = values[self.logprobs] if self.logprobs is not None else None
        tops = None
        if self.top_values is not None:
            k = self.top_k
            tv, ti = values[self.top_values], values[self.top_ids]
            tops = [
                [[tv[b * k + j], int(ti[b * k + j])] for j in range(k)] for b in range(len(ids))
            ]
        return ids, lps, tops


def sample_step(launched: Launched, penalties, grammar_mask, grammars: list) -> None:
    """Sample a launched step's rows on the device (the penalty pool, then the grammar's mask
    at the rows of ``grammars``, None for a row without one) and queue its read-back (no
    sync)."""
    logits, processed, pen_rows = launched.unsampled
    launched.unsampled = None
    done, rb = launched.done, launched.readback
    if pen_rows is not None and processed is None:  # eager: the same ops as the graphs'
        processed = penalties.apply(logits, pen_rows)
    target = logits if processed is None else processed
    if grammar_mask is not None and any(r.grammar is not None for r in done):
        if target is logits and any(r.return_logprob for r in done):
            target = logits.clone()  # logprobs stay the model's own
        grammar_mask.apply(target, grammars)
    ids, _ = sample(target, [r.sampling for r in done], [r.generator for r in done])
    if pen_rows is not None:
        penalties.record(pen_rows, ids)
    launched.ids, launched.sampled = rb.add(ids), ids
    if any(r.return_logprob for r in done):
        k = max(r.top_logprobs_num if r.return_logprob else 0 for r in done)
        lp, top_v, top_i = token_logprobs(logits, ids, k)
        launched.logprobs, launched.top_k = rb.add(lp), k
        if top_v is not None:
            launched.top_values, launched.top_ids = rb.add(top_v), rb.add(top_i)
    rb.start()


def resolve_pending(input_ids: torch.Tensor, in_flight: Launched) -> torch.Tensor:
    """Placeholder ids ``-(row + 1)`` -> that row of the step in flight's sampled ids
    (device ops, no sync)."""
    assert in_flight is not None and in_flight.sampled is not None
    sampled = in_flight.sampled.to(input_ids.dtype)
    rows = (-input_ids - 1).clamp_(min=0)
    return torch.where(input_ids < 0, sampled[rows], input_ids)
