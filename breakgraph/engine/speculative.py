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
On CUDA a verify step replays the decode graphs, a row per decode row (engine/graphs/
dispatch.py; DeepSeek V4's the prefill graphs' small buckets), a draft model's steps its own. Under overlap scheduling a
draft model's verify steps run back to back (``schedule_chained``, engine/spec_chain.py);
others are read back before the next step is scheduled.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from breakgraph.engine.acceptance import (
    SyntheticAcceptance,
    kept_logprobs,
    leading_accepts,
    pool_rows,
    verify_sample,
)
from breakgraph.engine.logprobs import token_logprobs
from breakgraph.engine.ngram import NgramProposer
from breakgraph.engine.penalties import NEUTRAL_ROW
from breakgraph.engine.rank_ops import StateRewind
from breakgraph.engine.request import Req
from breakgraph.engine.spec_chain import Carry, carry_of, device_batch, emitted
from breakgraph.engine.verify_step import SpecStats, Verify, build_verify
from breakgraph.forward_batch import ForwardBatch, ForwardMode, token_positions, upload_many


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
        chain: bool = False,
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
        # verify steps back to back under overlap (spec_chain.py): n-gram drafts or a draft
        # model's (DraftModel.propose_chained), no per-request state
        chains = drafter is None or hasattr(drafter, "propose_chained")
        self.chain = chain and chains and not states

    @classmethod
    def of(
        cls, config, cache, device: torch.device, drafter=None, states=None
    ) -> SpecDecoder | None:
        """A scheduler's speculative decoder (None: speculation off)."""
        k = config.speculative_num_draft_tokens
        if not k:
            return None
        synthetic = config.speculative_synthetic_accept_length
        chain = config.overlap and config.speculative_chain
        return cls(k, cache, config.max_context_len, device, drafter, synthetic, states, chain)

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

    def _room(self, req: Req, ahead: int = 0) -> int:
        """Draft tokens ``req`` may take after ``ahead`` more tokens: its length and the
        context leave room for them and the verify step's bonus token."""
        left = min(req.sampling.max_new_tokens - len(req.output_ids),
                   self.max_context_len - req.fill_len)  # fmt: skip
        return left - ahead - 1

    def _drafts(self, stepping: list[Req]) -> list[np.ndarray]:
        """Each request's draft: n-gram tokens, or a draft model's length (zeros until it
        drafts them on the device); padded to full length for synthetic acceptance."""
        k = self.num_draft
        limits = [self._room(r) if self.drafts_for(r) else 0 for r in stepping]
        if self.proposer is None:
            return [np.zeros(max(0, min(k, n)), dtype=np.int32) for n in limits]
        return [
            self._ngram_draft(r, max(0, min(k, n))) for r, n in zip(stepping, limits, strict=True)
        ]

    def _ngram_draft(self, req: Req, n: int, ahead: np.ndarray | None = None) -> np.ndarray:
        """``req``'s n-gram draft of at most ``n`` tokens, after ``ahead`` (the drafts of a
        verify step still on the device: ``propose_after``) if given; exactly ``n`` under
        synthetic acceptance (any tokens: the benchmark keeps them regardless)."""
        if req.ngram is None:  # its index, made at its first draft
            req.ngram = self.proposer.new_index()
        if ahead is None:
            draft = self.proposer.propose(req.fill_tokens(), n, req.ngram)
        else:
            draft = self.proposer.propose_after(req.fill_tokens(), ahead, n, req.ngram)
        if self.synthetic is not None:  # the draft and the last token, repeated to n
            cycle = draft.tolist()
            cycle.append(req.output_ids[-1])
            return np.array((cycle * n)[:n], dtype=np.int32)
        return draft

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

    def schedule_chained(
        self, prev: Verify, stepping: list[Req]
    ) -> tuple[list[Req], ForwardBatch] | None:
        """The verify step of ``stepping`` chained to ``prev``, still on the device (see
        spec_chain.py): drafts sized for the most ``prev`` may keep, ``1 + k`` slots more per
        request, rows at the carried positions. None where it cannot be: a request not in
        ``prev`` or with a grammar, one that may need more room than the context has, or
        too few free slots (the caller reads ``prev`` back first)."""
        index = {id(r): i for i, r in enumerate(prev.reqs)}
        at = [index.get(id(r)) for r in stepping]
        if (
            not self.chain
            or prev.carry is None
            or None in at
            or any(r.grammar is not None for r in stepping)
        ):
            return None
        k, ctx, ngram = self.num_draft, self.max_context_len, self.proposer is not None
        lens, drafts = [], []
        for req, i in zip(stepping, at, strict=True):
            ahead = prev.drafts[i]
            room = self._room(req, ahead=len(ahead) + 1)  # all prev may keep
            n = max(0, min(k, room)) if self.drafts_for(req) else 0
            if ngram and n:  # n-gram drafts, past what prev verifies
                draft = self._ngram_draft(req, n, ahead=ahead)
                n = len(draft)
            else:  # a draft model's: drafted on the device
                draft = np.zeros(n, dtype=np.int32)
            if req.kv_len + n + 1 > ctx:  # the table's row ends before its worst case
                return None
            lens.append(n)
            drafts.append(draft)
        need = len(stepping) + sum(lens)
        if need == len(stepping) or self.cache.available < need:
            return None
        slots = self.cache.alloc(need)
        upper = [r.kv_len for r in stepping]  # a bound of each prefix: all of prev kept
        ext = [n + 1 for n in lens]
        rows = [r.req_pool_idx for r in stepping]
        req_pool = self.cache.req_pool
        ends = np.cumsum(ext)
        starts_np = ends - ext
        cols = token_positions(np.asarray(upper), np.asarray(ext), starts_np)
        req_pool.write_many(np.repeat(rows, ext), cols, slots)
        host = slots.numpy()  # a view: each request's slice without a tensor of its own
        ends = ends.tolist()
        starts = starts_np.tolist()
        for req, s, e in zip(stepping, starts, ends, strict=True):
            req.append_kv(host[s:e])
        host_ids = np.zeros(need, dtype=np.int64)  # n-gram drafts after each first row
        drafted = np.ones(need, dtype=bool)
        drafted[starts] = False
        host_ids[drafted] = np.concatenate(drafts)
        pick, first, ids = upload_many([at, starts, host_ids], torch.int64, self.device)
        base, last = prev.carry.base[pick], prev.carry.last[pick]
        ids[first] = last
        batch = device_batch(
            ForwardMode.EXTEND, req_pool.table, rows, base, ext, upper, ids, all_logits=True
        )
        batch.decode_rows = True
        self.pending = Verify(stepping, drafts, starts, need, [None] * len(stepping))
        self.pending.chained_to, self.pending.extent = prev, ext
        self.pending.carry = Carry(base, last, prev.carry.prev[pick])
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
        owner, offset = verify.layout()
        rows = np.flatnonzero(offset)  # the draft tokens' rows
        if self.drafter is not None:
            lens = [len(d) for d in verify.drafts]
            if verify.chained_to is not None:  # from the carried tokens, on the device
                c = verify.carry
                table = self.drafter.propose_chained(verify.reqs, lens, c.base, c.prev, c.last)
            else:
                table = self.drafter.propose(verify.reqs, lens, verify.prefixes)
            cells = owner[rows] * table.shape[1] + offset[rows] - 1
            at, cell = upload_many([rows, cells], torch.int64, batch.input_ids.device)
            flat = table.view(-1)[cell]
            batch.input_ids[at] = flat
            draft_next = torch.full((verify.rows,), -1, dtype=torch.int64, device=flat.device)
            draft_next[at - 1] = flat
            verify.draft_ids = readback.add(flat)
        else:
            nxt = verify.next_drafts(np.concatenate(verify.drafts), offset)
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
            pooled = pool_rows(verify, batch.input_ids)
        if self.synthetic is not None:
            sizes = np.fromiter(map(len, verify.drafts), np.int64, len(verify.drafts))
            verify.fixed = np.minimum(self.synthetic.draws(len(sizes)), sizes).tolist()
        accept, choice = self._sample(
            verify, logits, draft_next, drafts, readback, grammar_mask, penalties, pooled
        )
        if self.chain:
            self._carry(verify, batch, accept, choice, owner)
        return verify

    def _carry(self, verify: Verify, batch: ForwardBatch, accept, choice, owner) -> None:
        """What a verify step leaves the next one chained to it (spec_chain.Carry); ``owner``:
        each row's request."""
        fixed = [] if verify.fixed is None else verify.fixed
        prefixes = [] if verify.chained_to is not None else verify.prefixes
        owner_t, starts, first, fixed_t, pre = upload_many(
            [owner, verify.starts, np.asarray(verify.starts)[owner], fixed, prefixes],
            torch.int64, self.device,
        )  # fmt: skip
        base = verify.carry.base if verify.chained_to is not None else pre
        verify.carry = carry_of(
            accept, choice, batch.input_ids, base, owner_t, starts, first,
            fixed_t if verify.fixed is not None else None,
        )  # fmt: skip

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
        params = gens = None  # every row greedy: no per-row lists
        if not all(r.sampling.greedy for r in reqs):
            params = [r.sampling for r, n in zip(reqs, sizes, strict=True) for _ in range(n)]
            gens = [r.generator for r, n in zip(reqs, sizes, strict=True) for _ in range(n)]
        accept, choice = verify_sample(target, params, gens, draft_next)
        if pooled is not None:  # each emitted row's token: its draft token if kept, else choice
            kept_rows = emitted(accept, pooled[2])
            kept_tok = torch.where(accept, draft_next, choice)
            penalties.record(torch.where(kept_rows, pen_rows, NEUTRAL_ROW), kept_tok)
        verify.choice, verify.accept = readback.add(choice), readback.add(accept)
        if any(r.return_logprob for r in reqs):
            k = max(r.top_logprobs_num if r.return_logprob else 0 for r in reqs)
            both = torch.stack([choice, draft_next.clamp(min=0)], dim=1)
            lp, top_v, top_i = token_logprobs(logits, both, k)
            tops = (None, None) if top_v is None else (readback.add(top_v), readback.add(top_i))
            verify.logprobs = (readback.add(lp), *tops, k)
        return accept, choice

    def accepted(
        self, verify: Verify, values, nxt: Verify | None = None
    ) -> Iterator[tuple[Req, list[int], tuple]]:
        """Each request, the tokens it keeps and their (logprobs, top-k) (``None``s where it
        wants none), from the read-back ``values``; its KV cut to its last token and the kept
        draft (and the rows ``nxt``, the verify step chained to it, may write past them), the
        rejected rows' slots freed. A request that finished while it ran is skipped."""
        later = {} if nxt is None else {id(r): i for i, r in enumerate(nxt.reqs)}
        drafts = verify.drafts
        if verify.draft_ids is not None:  # a draft model's, read back with the step
            ids = np.asarray(values[verify.draft_ids], dtype=np.int32)
            drafts = np.split(ids, np.cumsum([len(d) for d in drafts])[:-1])
        choice, accept = values[verify.choice], values[verify.accept]
        flat = np.concatenate(drafts).tolist()  # request i's draft from starts[i] - i on
        fixed = verify.fixed
        stats = self.stats
        stats.steps += 1
        rewind: list[tuple[Req, list[int]]] = []
        kept_drafts: list[int] = []
        dropped: list[torch.Tensor] = []  # the rejected rows' slots, freed at once
        logprobs = verify.logprobs is not None
        for i, (req, draft, start) in enumerate(zip(verify.reqs, drafts, verify.starts,
                                                    strict=True)):  # fmt: skip
            if req.finished:  # ended by the step before (chained): nothing of it is kept
                kept_drafts.append(None)
                continue
            j = fixed[i] if fixed is not None else leading_accepts(accept, start, len(draft))
            toks = flat[start - i : start - i + j]
            toks.append(int(choice[start + j]))
            stats.verified += 1
            stats.drafted += len(draft)
            stats.accepted += j
            end = verify.prefixes[i] + j + 1
            later_i = later.get(id(req))
            if later_i is not None:  # the chained step's prefix, and the rows it may write
                nxt.prefixes[later_i] = end
                end += nxt.extent[later_i]
            if end != req.kv_len:
                dropped.append(req.truncate_kv(end))
            kept_drafts.append(j)
            if verify.saved and j < len(draft):
                rewind.append((req, toks[:-1]))
            lps = kept_logprobs(verify, values, req, start, j + 1) if logprobs else (None, None)
            yield req, toks, lps
        if dropped:
            self.cache.allocator.free(torch.cat(dropped))
        if self.drafter is not None:  # before the rewind's forward (the step's streams)
            done = [r.finished for r in verify.reqs]
            self.drafter.accepted(
                verify, [None if f else n for f, n in zip(done, kept_drafts, strict=True)]
            )
        if nxt is not None:
            nxt.chained_to = None  # its prefixes are known now
        rewind = [(req, kept_draft) for req, kept_draft in rewind if not req.finished]
        if rewind:  # before the next step (the caller has taken every request's tokens)
            self.states.rewind(verify, rewind, self._forward)
