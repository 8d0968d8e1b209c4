"""Speculative decoding: a decode step verifies up to k drafted tokens per request in one
forward and keeps the longest accepted prefix plus one.

Drafts come from the request's own tokens (NGRAM, ``ngram.NgramProposer``: what followed the
most recent earlier occurrence of its last n tokens, n from ``max_match`` down to
``min_match``) or from a smaller draft model (STANDALONE, engine/draft.py: k greedy steps on
the device) or the target's own MTP layers (NEXTN, engine/mtp.py: likewise). A verify step
is an extend step of ``1 + k_i`` rows per request (its last token, then its draft) at the
positions its next tokens would take, with the logits of every row: row i holds the model's
distribution after the draft's first i tokens.

Acceptance (engine/acceptance.py) is speculative sampling against a draft that puts all its
mass on one token (both proposers are deterministic): draft token d is kept with probability
p(d) under the row's sampling distribution (temperature, top-k, top-p, min-p), and at the
first rejection the row samples from p with d removed; if every draft token is kept, the
last row samples a bonus token. The emitted tokens are distributed as plain sampling's
(greedy: the same tokens). The KV slots of rejected rows go back to the allocator at once; a
model's per-request state (DeepSeek V4's open compressor windows), which the verify step
advanced through every row, is restored and advanced over the kept rows again
(rank_ops.StateRewind). A benchmark may fix the number kept instead
(``acceptance.SyntheticAcceptance``; refused outside one).

A constrained request's verify rows are masked by its grammar after each prefix of its draft
(``RequestGrammar.fill_draft_rows``): a draft token the grammar refuses has probability 0 and
is never kept. A request with a penalty-pool row (penalties, ``logit_bias``,
``min_new_tokens``) drafts too: verify row j is sampled from the pool's logits as if the
draft tokens before it had been sampled (``PenaltyPool.apply``'s ``drafted``: counted, and
generated), and the tokens it keeps are counted in the pool on the device. Under synthetic
acceptance (a verdict the target did not give) such a request does not draft. Logprobs
(and the top-k) of every kept token come from its verify row's logits, the model's own. A
step where no request drafts is a plain decode step.
On CUDA a verify step replays the prefill graphs (their small buckets,
graph_plan.SPEC_BUCKETS), a draft model's steps its own graphs; a verify step is read back
before the next step is scheduled (no overlap across them).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from breakgraph.common import envs
from breakgraph.engine.acceptance import SyntheticAcceptance, kept, kept_logprobs, verify_sample
from breakgraph.engine.logprobs import token_logprobs
from breakgraph.engine.ngram import NgramProposer
from breakgraph.engine.penalties import NEUTRAL_ROW, Drafted
from breakgraph.engine.prefill import extend_batch
from breakgraph.engine.rank_ops import StateRewind
from breakgraph.engine.request import Req
from breakgraph.forward_batch import ForwardBatch, upload_many


@dataclass
class Verify:
    """A verify step's requests, their drafts and each request's first row; once sampled,
    the read-back handles of every row's choice and acceptance."""

    reqs: list[Req]
    drafts: list[np.ndarray]
    starts: list[int]
    rows: int
    prefixes: list[int] = field(default_factory=list)  # each request's KV length before
    choice: int | None = None
    accept: int | None = None
    draft_ids: int | None = None  # a draft model's drafts, read back with the step
    logprobs: tuple[int, int | None, int | None, int] | None = None  # handles, top-k
    saved: bool = False  # the model's per-request state was kept before it (rank_ops.py)
    hidden: torch.Tensor | None = None  # its streams, for NEXTN's MTP (engine/mtp.py)


@dataclass
class SpecStats:
    """Verify steps, drafted and accepted draft tokens (the mean accepted length per step
    and request is ``1 + accepted / verified``)."""

    steps: int = 0
    verified: int = 0  # request-steps
    drafted: int = 0
    accepted: int = 0

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + self.accepted / self.verified if self.verified else 0.0

    def totals(self) -> dict[str, int | float]:
        """As the scheduler's live stats name them (/metrics, /get_server_info)."""
        return {
            "spec_verify_steps": self.steps,
            "spec_draft_tokens": self.drafted,
            "spec_accepted_tokens": self.accepted,
            "spec_accept_length": self.mean_accepted_length,
        }


def build_verify(
    reqs: list[Req], drafts: list[np.ndarray], slots: torch.Tensor, req_pool, device
) -> tuple[Verify, ForwardBatch]:
    """The verify batch of ``reqs`` (every one with its last token on the host): rows
    ``[last, *draft]`` at positions ``kv_len ..``, the new slots appended to each request,
    the logits of every row."""
    ext = [1 + len(d) for d in drafts]
    prefixes = [r.kv_len for r in reqs]
    parts, starts, at = [], [], 0
    for req, draft, n in zip(reqs, drafts, ext, strict=True):
        parts.append(np.concatenate([np.asarray([req.output_ids[-1]], np.int32), draft]))
        starts.append(at)
        at += n
    at = 0
    for req, n in zip(reqs, ext, strict=True):
        req.append_kv(slots[at : at + n])
        at += n
    table_rows = [r.req_pool_idx for r in reqs]
    batch = extend_batch(np.concatenate(parts), slots, table_rows, prefixes, ext, req_pool, device)
    batch.logits_rows = torch.arange(at, dtype=torch.int64, device=batch.input_ids.device)
    return Verify(reqs, drafts, starts, at), batch


def draft_tokens(args, model) -> int:
    """The draft length the scheduler uses (0: speculation off); one line naming what does
    not support it yet."""
    algorithm = args.speculative_algorithm
    synthetic = args.bench_synthetic_accept_length
    if synthetic is not None and not (algorithm and envs.BENCH.get()):
        raise ValueError(
            "--bench-synthetic-accept-length is a benchmark aid (its outputs are not the "
            "model's): it needs --speculative-algorithm and BREAKGRAPH_BENCH=1"
        )
    if not algorithm:
        return 0
    why = None
    if algorithm == "NEXTN" and getattr(model, "mtp", None) is None:
        why = f"for {type(model).__name__} (it has no MTP layers: STANDALONE or NGRAM)"
    elif algorithm == "STANDALONE" and not args.speculative_draft_model_path:
        why = "without --speculative-draft-model-path (the draft model)"
    if why:
        raise ValueError(f"--speculative-algorithm {algorithm} is not supported {why}")
    if algorithm in ("STANDALONE", "NEXTN") and args.speculative_num_steps:
        return args.speculative_num_steps
    return args.speculative_num_draft_tokens


def _pool_rows(verify: Verify, input_ids: torch.Tensor) -> tuple:
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


def _emitted(accept: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """Whether each verify row's token is emitted: every row of its request before it
    accepted its draft token (device ops)."""
    rejected = (~accept).to(torch.int32)
    before = rejected.cumsum(0) - rejected  # rejections before each row
    return before == before[first]


class SpecDecoder:
    """A scheduler's speculative steps: drafts and the verify batch (``schedule``), the
    drafts (a draft model's, on the device), the verify forward and its acceptance queued
    on the device (``launch``), each request's kept tokens with its rejected rows' slots
    freed (``accepted``); ``stats`` counts them. ``drafter``: a draft model
    (engine/draft.py; None: n-gram drafts); ``synthetic``: a benchmark's fixed mean accepted
    length (``SyntheticAcceptance``); ``states``: the model's per-request state, rewound past
    rejected drafts (rank_ops.StateRewind)."""

    def __init__(
        self,
        num_draft: int,
        cache,
        max_context_len: int,
        device: torch.device,
        drafter=None,
        synthetic: float | None = None,
        states: StateRewind | None = None,
    ):
        self.num_draft = num_draft
        self.proposer = NgramProposer(num_draft) if drafter is None else None
        self.drafter = drafter
        self.synthetic = None if synthetic is None else SyntheticAcceptance(synthetic, num_draft)
        self.cache = cache
        self.max_context_len = max_context_len
        self.device = device
        self.stats = SpecStats()
        self.pending: Verify | None = None  # scheduled, not yet launched
        # a model's per-request state (DeepSeek V4's open compressor windows): a verify step
        # advances it through every row, so it is saved first and, where a draft token is
        # rejected, restored and advanced again over the kept rows
        self.states = states
        self._forward = None  # the verify step's forward, for the rewind

    @classmethod
    def of(
        cls, config, cache, device: torch.device, drafter=None, states=None
    ) -> SpecDecoder | None:
        """A scheduler's speculative decoder (None: speculation off)."""
        k = config.speculative_num_draft_tokens
        if not k:
            return None
        synthetic = config.speculative_synthetic_accept_length
        return cls(k, cache, config.max_context_len, device, drafter, synthetic, states)

    def mirror(self, batch: ForwardBatch, reqs: list[Req]) -> None:
        """A target step (of ``reqs``) that is not a verify step: the drafter writes its KV
        too."""
        if self.drafter is not None:
            self.drafter.mirror(batch, reqs)

    def drafts_for(self, req: Req) -> bool:
        """Whether ``req`` drafts: not with a penalty-pool row under synthetic acceptance
        (the pool counts the tokens the target's verdict keeps). Such a request rides a
        verify step as one plain row."""
        return self.synthetic is None or req.penalty_row is None

    def _drafts(self, stepping: list[Req]) -> list[np.ndarray]:
        """Each request's draft: n-gram tokens, or a draft model's length (zeros until it
        drafts them on the device); padded to full length for synthetic acceptance."""
        k, limit = self.num_draft, self.max_context_len
        limits = [
            min(r.sampling.max_new_tokens - len(r.output_ids), limit - r.fill_len) - 1
            if self.drafts_for(r)
            else 0
            for r in stepping
        ]
        if self.proposer is None:
            return [np.zeros(max(0, min(k, n)), dtype=np.int32) for n in limits]
        drafts = [
            self.proposer.propose(r.fill_ids, n) for r, n in zip(stepping, limits, strict=True)
        ]
        if self.synthetic is not None:  # any tokens: the benchmark keeps them regardless
            drafts = [
                np.resize(np.append(d, r.output_ids[-1]), max(0, min(k, n))).astype(np.int32)
                for d, r, n in zip(drafts, stepping, limits, strict=True)
            ]
        return drafts

    def schedule(self, stepping: list[Req]) -> tuple[list[Req], ForwardBatch] | None:
        """The verify step of ``stepping`` (their last tokens on the host), or None when no
        request has a draft or the KV pool cannot take the drafts."""
        drafts = self._drafts(stepping)
        need = len(stepping) + sum(len(d) for d in drafts)
        if need == len(stepping) or self.cache.available < need:
            return None
        slots = self.cache.alloc(need)
        prefixes = [r.kv_len for r in stepping]
        self.pending, batch = build_verify(
            stepping, drafts, slots, self.cache.req_pool, self.device
        )
        self.pending.prefixes = prefixes
        return stepping, batch

    def launch(
        self, batch: ForwardBatch, forward, readback, grammar_mask=None, penalties=None
    ) -> Verify:
        """The pending verify step on the device: a draft model's drafts into its rows, the
        target's forward, the penalty pool's rows applied (``penalties``), constrained rows
        masked (``grammar_mask``), the acceptance queued for ``readback``. No host sync, but
        for a draft model's drafts of a constrained request (its masks need them on the
        host)."""
        verify, self.pending = self.pending, None
        rows = [
            verify.starts[i] + 1 + j for i, d in enumerate(verify.drafts) for j in range(len(d))
        ]
        if self.drafter is not None:
            lens = [len(d) for d in verify.drafts]
            table = self.drafter.propose(verify.reqs, lens, verify.prefixes)
            cells = [i * table.shape[1] + j for i, n in enumerate(lens) for j in range(n)]
            at, cell = upload_many([rows, cells], torch.int64, batch.input_ids.device)
            flat = table.view(-1)[cell]
            batch.input_ids[at] = flat
            draft_next = torch.full((verify.rows,), -1, dtype=torch.int64, device=flat.device)
            draft_next[at - 1] = flat
            verify.draft_ids = readback.add(flat)
        else:
            nxt = [-1] * verify.rows
            for r, t in zip(rows, np.concatenate(verify.drafts).tolist(), strict=True):
                nxt[r - 1] = t
            (draft_next,) = upload_many([nxt], torch.int64, batch.input_ids.device)
        if self.states:
            self.states.save([r.req_pool_idx for r in verify.reqs])
            verify.saved = True
            self._forward = forward
        logits = forward(batch)
        if self.drafter is not None:
            self.drafter.hold(verify)
        drafts = verify.drafts
        if self.drafter is not None and any(r.grammar is not None for r in verify.reqs):
            # the host needs them for the masks: the one sync of such a step
            drafts = np.split(flat.cpu().numpy(), np.cumsum(lens)[:-1])
        pooled = None
        if penalties is not None and any(r.penalty_row is not None for r in verify.reqs):
            pooled = _pool_rows(verify, batch.input_ids)
        self._sample(verify, logits, draft_next, drafts, readback, grammar_mask, penalties, pooled)
        return verify

    def _sample(
        self, verify, logits, draft_next, drafts, readback, grammar_mask, penalties, pooled
    ):
        """Every row's acceptance and choice from ``logits`` with the penalty pool applied
        (``pooled``: the rows of requests that hold one, each after its draft tokens before
        it) and constrained rows masked; the tokens the pool's rows keep counted in it; each
        row's logprobs of its draft token and its choice (the model's own), where a request
        wants them."""
        reqs, starts = verify.reqs, verify.starts
        sizes = [1 + len(d) for d in verify.drafts]
        pen_rows = None if pooled is None else pooled[0]
        target = logits if pooled is None else penalties.apply(logits, pen_rows, pooled[1])
        constrained = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if constrained and grammar_mask is not None:
            if target is logits and any(r.return_logprob for r in reqs):
                target = logits.clone()  # logprobs stay the model's own
            host = grammar_mask.host_rows(verify.rows)
            for i in constrained:
                reqs[i].grammar.fill_draft_rows(host, starts[i], drafts[i])
            grammar_mask.apply_host(target, host)
        params = [r.sampling for r, n in zip(reqs, sizes, strict=True) for _ in range(n)]
        gens = [r.generator for r, n in zip(reqs, sizes, strict=True) for _ in range(n)]
        accept, choice = verify_sample(target, params, gens, draft_next)
        if pooled is not None:  # each emitted row's token: its draft token if kept, else choice
            emitted = _emitted(accept, pooled[2])
            kept_tok = torch.where(accept, draft_next, choice)
            penalties.record(torch.where(emitted, pen_rows, NEUTRAL_ROW), kept_tok)
        verify.choice, verify.accept = readback.add(choice), readback.add(accept)
        if any(r.return_logprob for r in reqs):
            k = max(r.top_logprobs_num if r.return_logprob else 0 for r in reqs)
            both = torch.stack([choice, draft_next.clamp(min=0)], dim=1)
            lp, top_v, top_i = token_logprobs(logits, both, k)
            tops = (None, None) if top_v is None else (readback.add(top_v), readback.add(top_i))
            verify.logprobs = (readback.add(lp), *tops, k)

    def accepted(self, verify: Verify, values) -> Iterator[tuple[Req, list[int], tuple]]:
        """Each request, the tokens it keeps and their (logprobs, top-k) (``None``s where it
        wants none), from the read-back ``values``; its KV cut to its last token and the kept
        draft, the rejected rows' slots freed."""
        choice, accept = values[verify.choice], values[verify.accept]
        drafts = verify.drafts
        if verify.draft_ids is not None:  # a draft model's, read back with the step
            flat = np.asarray(values[verify.draft_ids], dtype=np.int32)
            drafts = np.split(flat, np.cumsum([len(d) for d in drafts])[:-1])
        stats = self.stats
        stats.steps += 1
        rewind: list[tuple[Req, list[int]]] = []
        kept_drafts: list[int] = []
        for req, draft, start in zip(verify.reqs, drafts, verify.starts, strict=True):
            rows = slice(start, start + 1 + len(draft))
            if self.synthetic is not None:
                j = min(self.synthetic.draw(), len(draft))
                toks = [*draft[:j].tolist(), int(choice[start + j])]
            else:
                toks = kept(draft, [bool(a) for a in accept[rows]], choice[rows])
            stats.verified += 1
            stats.drafted += len(draft)
            stats.accepted += len(toks) - 1
            self.cache.allocator.free(req.truncate_kv(req.kv_len - len(draft) + len(toks) - 1))
            kept_drafts.append(len(toks) - 1)
            if verify.saved and len(toks) <= len(draft):
                rewind.append((req, toks[:-1]))
            yield req, toks, kept_logprobs(verify, values, req, start, len(toks))
        if self.drafter is not None:  # before the rewind's forward (the step's streams)
            done = [r.finished for r in verify.reqs]
            self.drafter.accepted(
                verify, [None if f else n for f, n in zip(done, kept_drafts, strict=True)]
            )
        rewind = [(req, kept_draft) for req, kept_draft in rewind if not req.finished]
        if rewind:  # before the next step (the caller has taken every request's tokens)
            self.states.rewind(verify, rewind, self._forward)
