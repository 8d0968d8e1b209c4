"""What a verify step keeps (engine/speculative.py): speculative sampling against a draft
with all its mass on one token (``verify_sample``), the kept run of a request's rows
(``kept``) and their logprobs (``kept_logprobs``), and a benchmark's fixed mean accepted
length in place of the target's verdict (``SyntheticAcceptance``); what the penalty pool
counts per verify row (``pool_rows``)."""

from __future__ import annotations

import numpy as np
import torch

from breakgraph.engine.penalties import NEUTRAL_ROW, Drafted
from breakgraph.engine.request import Req, SamplingParams
from breakgraph.engine.sampler import MAX_SAMPLE_FLOATS, exponential_noise, filtered_probs
from breakgraph.forward_batch import upload_many


def kept(draft: np.ndarray, accept: list[bool], choice: list[int]) -> list[int]:
    """The tokens a request keeps from its verify rows: the draft while its rows accept,
    then the first rejecting row's choice (or, all accepted, the last row's)."""
    j = leading_accepts(accept, 0, len(draft))
    return [int(t) for t in draft[:j]] + [int(choice[j])]


def leading_accepts(accept: list, start: int, n: int) -> int:
    """``kept``'s count of draft tokens from a step's read-back ``accept`` (every row's):
    the rows from ``start`` on that accept, at most ``n``."""
    j = 0
    while j < n and accept[start + j]:
        j += 1
    return j


def verify_sample(
    logits: torch.Tensor,
    params: list[SamplingParams] | None,
    generators: list[torch.Generator | None] | None,
    draft_next: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V] of verify rows, each row's sampling parameters and generator (None:
    every row greedy, no per-row lists built), and the draft token that follows it (-1 for
    a request's last row) -> (accept [R] bool: the draft token is kept; choice [R] int64:
    the row's token where the run stops there). Greedy rows accept a draft equal to their
    argmax; sampled rows keep it with probability p(d) and otherwise draw from p without
    it. On the device, no host sync. Sampled rows go ``MAX_SAMPLE_FLOATS // V`` at a time,
    as ``sample`` does: the filters' [rows, V] temporaries over a full verify batch (1,024
    requests x 4 rows of a 151,936-token vocabulary) took 27 GiB, which the memory plan kept
    free beside the KV pool."""
    all_greedy = params is None or all(p.greedy for p in params)
    rows = max(1, MAX_SAMPLE_FLOATS // max(logits.shape[-1], 1))
    if not all_greedy and logits.shape[0] > rows:  # each chunk's argmax too: no second pass
        parts = [
            verify_sample(logits[i : i + rows], params[i : i + rows], generators[i : i + rows],
                          draft_next[i : i + rows])
            for i in range(0, logits.shape[0], rows)
        ]  # fmt: skip
        return torch.cat([a for a, _ in parts]), torch.cat([c for _, c in parts])
    greedy_ids = logits.argmax(dim=-1)
    has_draft = draft_next >= 0
    d = draft_next.clamp(min=0)
    accept_greedy = has_draft & (greedy_ids == d)
    if all_greedy:
        return accept_greedy, greedy_ids
    probs, greedy = filtered_probs(logits, params)
    p_d = probs.gather(1, d[:, None]).squeeze(1)
    u = torch.rand(probs.shape[0], device=probs.device)
    for row, gen in enumerate(generators):
        if gen is not None:
            u[row] = torch.rand(1, generator=gen, device=probs.device)[0]
    accept = has_draft & (u * probs.sum(dim=-1) < p_d)
    residual = probs.scatter(1, d[:, None], torch.where(has_draft, 0.0, p_d)[:, None])
    choice = (residual / exponential_noise(residual, generators)).argmax(dim=-1)
    g = greedy.bool()
    return torch.where(g, accept_greedy, accept), torch.where(g, greedy_ids, choice)


def kept_logprobs(verify, values, req: Req, start: int, n: int) -> tuple:
    """The logprobs of a request's ``n`` kept tokens (its draft's, then the last row's
    choice) and each row's top-k, from the read-back; (None, None) where it wants none."""
    if verify.logprobs is None or not req.return_logprob:
        return None, None
    lp, top_v, top_i, k = verify.logprobs
    lp = values[lp]  # per row: its choice's, its draft token's
    lps = [lp[2 * (start + j) + 1] for j in range(n - 1)] + [lp[2 * (start + n - 1)]]
    m = req.top_logprobs_num
    if top_v is None or m <= 0:
        return lps, None
    tv, ti = values[top_v], values[top_i]
    rows = range(start * k, (start + n) * k, k)
    return lps, [[[tv[r + j], int(ti[r + j])] for j in range(m)] for r in rows]


class SyntheticAcceptance:
    """A benchmark aid, not decoding: each request keeps a drawn number of its draft tokens
    whatever the target says, so that a step's mechanics (draft, verify, rollback) can be
    measured at a fixed mean accepted length (tokens kept per request and verify step,
    the bonus token included) without a trained draft. Seeded: runs repeat."""

    def __init__(self, mean_length: float, num_draft: int):
        if not 1.0 <= mean_length <= num_draft + 1:
            raise ValueError(
                f"a synthetic mean accepted length must lie in [1, draft tokens + 1 = "
                f"{num_draft + 1}], got {mean_length}"
            )
        self.mean_length = mean_length
        self.rng = np.random.default_rng(0)

    def draw(self) -> int:
        """Draft tokens kept: floor or ceil of ``mean_length - 1``, in the ratio that gives
        it as the mean."""
        a = self.mean_length - 1.0
        return int(a) + int(self.rng.random() < a - int(a))

    def draws(self, n: int) -> np.ndarray:
        """``n`` draws at once (int64), the same as ``n`` calls of ``draw``."""
        a = self.mean_length - 1.0
        return int(a) + (self.rng.random(n) < a - int(a)).astype(np.int64)


def pool_rows(verify, input_ids: torch.Tensor) -> tuple:
    """A verify step's penalty-pool rows (each row its request's; neutral where it holds
    none); what each row counts beyond the pool: row j of a request (j >= 1, after draft
    token j) the draft tokens 1..j (the step's input rows 1..j, read on the device) and j
    tokens generated; and each row's request's first row."""
    pen, before, first, rows, src = [], [], [], [], []
    for req, draft, start in zip(verify.reqs, verify.drafts, verify.starts, strict=True):
        n = 1 + len(draft)
        pen += [req.penalty_row or NEUTRAL_ROW] * n
        before += range(n)
        first += [start] * n
        if req.penalty_row is not None:
            for j in range(1, n):
                rows += [start + j] * j
                src += range(start + 1, start + j + 1)
    device = input_ids.device
    pen_rows, at, tok_at, first_t = upload_many([pen, rows, src, first], torch.int64, device)
    (before_t,) = upload_many([before], torch.int32, device)
    return pen_rows, Drafted(at, input_ids[tok_at], before_t), first_t
