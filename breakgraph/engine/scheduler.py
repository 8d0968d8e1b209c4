"""Continuous batching, one step at a time: schedule -> launch -> process outputs.

Schedule picks a prefill batch (prefill.py: admission, prefix match, chunking) or else a
decode batch (decode.py: one token per running request, retraction under KV pressure);
the KV slots, radix tree and request table behind both are cache_manager.py's. Launch runs
the forward and samples on the device; only then are the sampled ids read back (the step's
one host sync), and output.py turns them into request state and finish decisions.

Overlap scheduling (``SchedulerConfig.overlap``, the default on CUDA): a step schedules and
launches step k+1 before it reads step k back, so the host's work for k+1 runs while the
GPU runs k. Step k's sampled ids stay on the device and feed k+1 (``Req.next_input_id``
placeholders, resolved in ``launch``). A request whose end (EOS, stop) is only known at
the read-back may have run one more step: that step's token is dropped and its KV freed,
never emitted or cached. A request that ends by length skips that step (it is known on the
host), and retraction reads the step in flight back first, so its decisions see every token.

Structured output (engine/grammar/): a constrained row's token bitmask depends on the token its
request sampled one step earlier. Under overlap that token is still on the device when the
next step launches, so such a step launches its forward, reads the previous step back (which
advances the matchers), and only then fills the mask and samples: the host's fill runs while
the GPU runs the forward, and no host sync is added inside the step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from breakgraph.cache.kv_pool import SlotAllocator
from breakgraph.cache.radix_cache import RadixCache
from breakgraph.cache.req_to_token import ReqToTokenPool
from breakgraph.common.messages import TokenDelta
from breakgraph.engine.cache_manager import CacheManager
from breakgraph.engine.config import SchedulerConfig, SchedulerStats
from breakgraph.engine.decode import DecodeManager
from breakgraph.engine.grammar import GrammarMask
from breakgraph.engine.logprobs import ReadBack, token_logprobs
from breakgraph.engine.output import OutputProcessor, fill_meta, finished_output
from breakgraph.engine.penalties import PenaltyPool, needs_row
from breakgraph.engine.prefill import PrefillManager
from breakgraph.engine.prompt_logprobs import (
    PromptRows,
    attach_prompt,
    prompt_plan,
    prompt_rows,
    take_prompt_logprobs,
)
from breakgraph.engine.request import Req
from breakgraph.engine.sampler import sample
from breakgraph.engine.speculative import (
    NgramProposer,
    SpecStats,
    Verify,
    build_verify,
    kept,
    speculable,
    verify_sample,
)
from breakgraph.engine.step_timer import StepTimer
from breakgraph.forward_batch import ForwardBatch, ForwardMode, upload_many

__all__ = ["Scheduler"]

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
    """What a launch queued on the device, read back by ``process_outputs``."""

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
    # rows or None); a constrained row's mask waits for the step in flight (sample_launched)
    unsampled: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None = None
    verify: Verify | None = None  # a speculative verify step: every row's greedy id


class Scheduler:
    def __init__(
        self,
        forward: Callable[[ForwardBatch], torch.Tensor],
        allocator: SlotAllocator,
        req_pool: ReqToTokenPool,
        tree: RadixCache,
        config: SchedulerConfig,
        device: torch.device,
        stop_text: Callable[[list[int]], str] | None = None,
        prompt_forward: PromptForward | None = None,
        penalties: PenaltyPool | None = None,
        penalized_forward: PenalizedForward | None = None,
        grammar_mask: GrammarMask | None = None,
    ):
        self.forward = forward  # batch -> logits [batch size, vocab] of each request's last row
        self.prompt_forward = prompt_forward  # for steps with prompt rows (prompt logprobs)
        # per-request sampling state (penalties, logit_bias, min_new_tokens; fixed when the
        # decode graphs read it)
        self.penalties = penalties
        # (batch, pool rows) -> (logits, logits with the pool applied): the decode graphs
        # apply it inside their replay
        self.penalized_forward = penalized_forward
        # each step's token bitmask of its constrained rows (requests with a Req.grammar)
        self.grammar_mask = grammar_mask
        self.cfg = config
        self.device = device
        self.cache = CacheManager(
            allocator, tree, req_pool, config.prefix_align, config.prefix_recompute
        )
        self.decode = DecodeManager(self.cache, config, device)
        self.prefill = PrefillManager(
            self.cache,
            self.decode,
            config,
            device,
            has_room=self._has_room,
            on_admit=self._on_admit,
        )
        self.output = OutputProcessor(config.eos_token_ids, config.max_context_len, stop_text)
        k = config.speculative_num_draft_tokens
        self.proposer = NgramProposer(k) if k else None
        self.spec_stats = SpecStats()
        self._verify: Verify | None = None  # the verify step being scheduled
        self.reqs: dict[str, Req] = {}
        # finished requests whose KV is not yet released (see release_finished)
        self._finished: list[Req] = []
        self.defer_release = False
        self.last_step_tokens = 0
        self.in_flight: Launched | None = None  # overlap: launched, not yet read back
        self.timer = StepTimer(device)  # host vs GPU time of each step; timeline stamps

    # ---- requests in and out ----
    def add(self, req: Req) -> None:
        if req.rid in self.reqs:
            raise ValueError(f"request id {req.rid!r} is already in use")
        self.reqs[req.rid] = req
        self.prefill.add(req)

    def abort(self, rid: str) -> TokenDelta | None:
        """Abort a request wherever it is; its KV slots are freed at once."""
        req = self.reqs.get(rid)
        if req is None:
            return None
        self.prefill.remove(req)
        self.decode.remove(req)
        return self._finish(req, {"type": "abort", "message": "aborted"})

    @property
    def has_work(self) -> bool:
        return self.prefill.has_work or bool(self.decode.running) or self._in_flight_is_live()

    def _in_flight_is_live(self) -> bool:
        """A step in flight that still has a live request to read back for."""
        f = self.in_flight
        if f is None:
            return False
        reqs = f.done + [p.req for p in f.prompt or []]
        return any(self.reqs.get(r.rid) is r for r in reqs)

    def stats(self) -> SchedulerStats:
        pool = self.penalties
        return SchedulerStats(
            num_running_reqs=len(self.decode.running) + self.prefill.num_in_prefill,
            num_queued_reqs=len(self.prefill.waiting),
            kv_tokens_used=self.cache.kv_tokens_used,
            kv_tokens_cached=self.cache.kv_tokens_cached,
            kv_tokens_total=self.cache.kv_tokens_total,
            num_retractions=self.decode.num_retractions,
            penalized_reqs=0 if pool is None else pool.rows_in_use,
            penalized_reqs_max=pool.capacity if pool is not None and pool.fixed else 0,
        )

    # ---- one step ----
    @torch.inference_mode()
    def step(self) -> list[TokenDelta]:
        """Schedule, launch (no host sync until here), then read the sampled ids back: this
        step's, or with overlap the previous step's (this one's stay in flight)."""
        self.timer.step_begin()
        self.release_finished()
        outputs: list[TokenDelta] = []
        scheduled = self.schedule(outputs)
        launched = None
        self.last_step_tokens = 0
        if scheduled is not None:
            reqs, batch = scheduled
            self.last_step_tokens = batch.num_tokens
            launched = self.launch(reqs, batch)
            self.prefill.cache_computed()  # the radix insert, while the GPU runs the step
        if self.cfg.overlap and (launched is None or launched.verify is None):
            previous, self.in_flight = self.in_flight, launched
            launched = previous
        if launched is not None:
            outputs.extend(self.process_outputs(launched))
        if self.in_flight is not None and self.in_flight.unsampled is not None:
            # its constrained rows' masks needed the tokens of the step just read back
            self.sample_launched(self.in_flight)
        self.timer.step_end()
        return outputs

    def drain(self) -> list[TokenDelta]:
        """Read back the step in flight (overlap), if any."""
        launched, self.in_flight = self.in_flight, None
        return [] if launched is None else self.process_outputs(launched)

    def schedule(self, outputs: list[TokenDelta]) -> tuple[list[Req], ForwardBatch] | None:
        """Pick the next batch (prefill first, else decode) and upload its metadata.

        Requests finished without a forward have their outputs appended to ``outputs``.
        """
        no_forward: list[Req] = []
        scheduled = self.prefill.schedule_batch(no_forward)
        for req in no_forward:
            outputs.append(self._finish(req, {"type": "length", "length": 0}))
        if scheduled is not None or not self.decode.running:
            return scheduled
        stepping = self.decode.stepping()
        if self.proposer is not None:
            verify = self._schedule_verify(stepping, outputs)
            if verify is not None:
                return verify
            stepping = self.decode.stepping()
        if self.cache.available >= len(stepping):
            return self.decode.schedule_batch(stepping)
        if self.in_flight is not None:
            # retraction must see every sampled token: read the step in flight back first
            outputs.extend(self.drain())
            self.release_finished()  # and the KV of the requests it finished
            return self.schedule(outputs)
        retracted, exhausted = self.decode.make_room(
            others_hold_kv=self.prefill.chunked is not None
        )
        for req in retracted:
            self.prefill.requeue(req)
        if exhausted is not None:
            # nothing else holds KV and it cannot grow: finish it rather than spin
            outputs.append(
                self._finish(exhausted, {"type": "length", "length": len(exhausted.output_ids)})
            )
            return None
        return self.decode.schedule_batch(self.decode.stepping())

    def _schedule_verify(
        self, stepping: list[Req], outputs: list[TokenDelta]
    ) -> tuple[list[Req], ForwardBatch] | None:
        """A speculative verify step of ``stepping`` if every one of them can take it and one
        has a draft (engine/speculative.py); None: a plain decode step. Tokens still in flight
        are read back first (a draft continues the last token)."""
        if not stepping or not all(speculable(r, pending_ok=True) for r in stepping):
            return None
        if any(r.num_pending for r in stepping):
            outputs.extend(self.drain())
            self.release_finished()
            stepping = self.decode.stepping()
            if not stepping or not all(speculable(r) for r in stepping):
                return None
        limit = self.cfg.max_context_len
        drafts = [
            self.proposer.propose(
                r.fill_ids,
                min(r.sampling.max_new_tokens - len(r.output_ids), limit - r.fill_len) - 1,
            )
            for r in stepping
        ]
        need = len(stepping) + sum(len(d) for d in drafts)
        if need == len(stepping) or self.cache.available < need:
            return None
        slots = self.cache.alloc(need)
        self._verify, batch = build_verify(
            stepping, drafts, slots, self.cache.req_pool, self.device
        )
        return stepping, batch

    def _launch_verify(self, batch: ForwardBatch) -> Launched:
        """Every row's logits, their greedy ids queued for the read-back (no sync)."""
        verify, self._verify = self._verify, None
        rb = ReadBack()
        self.timer.forward_begin()
        logits = self.forward(batch)
        self.timer.forward_end()
        params, gens, draft_next = [], [], []
        for req, draft in zip(verify.reqs, verify.drafts, strict=True):
            n = 1 + len(draft)
            params += [req.sampling] * n
            gens += [req.generator] * n
            draft_next += [*draft.tolist(), -1]
        (nxt,) = upload_many([draft_next], torch.int64, logits.device)
        accept, choice = verify_sample(logits, params, gens, nxt)
        launched = Launched(done=verify.reqs, readback=rb, verify=verify)
        launched.ids, launched.logprobs = rb.add(choice), rb.add(accept.to(torch.int64))
        rb.start()
        return launched

    def _process_verify(self, launched: Launched) -> list[TokenDelta]:
        """Keep each request's accepted draft prefix plus the next token; free the rejected
        rows' slots; finish checks token by token."""
        values = launched.readback.fetch()  # the step's one host sync
        choice, accept = values[launched.ids], values[launched.logprobs]
        verify, stats = launched.verify, self.spec_stats
        stats.steps += 1
        outputs = []
        for req, draft, start in zip(verify.reqs, verify.drafts, verify.starts, strict=True):
            rows = slice(start, start + 1 + len(draft))
            toks = kept(draft, [bool(a) for a in accept[rows]], choice[rows])
            stats.verified += 1
            stats.drafted += len(draft)
            stats.accepted += len(toks) - 1
            # KV: the last token and the kept draft tokens; the rejected rows' slots go back
            self.cache.allocator.free(req.truncate_kv(req.kv_len - len(draft) + len(toks) - 1))
            out, reason = None, None
            for tok in toks:
                delta, reason = self.output.append_token(req, tok, None)
                if out is None:
                    out = delta
                else:
                    out.token_ids.append(tok)
                if reason is not None:
                    break
            if reason is not None:
                out = self._finish(req, reason, out)
            else:
                fill_meta(out, req)
            outputs.append(out)
        return outputs

    def launch(self, reqs: list[Req], batch: ForwardBatch) -> Launched:
        """Forward and sample on the device, queueing what the host reads back (no sync).

        A request mid-prefill (chunked) has no token to sample: its logits row is dropped.
        """
        if self._verify is not None:
            return self._launch_verify(batch)
        rb = ReadBack()
        if any(r.num_pending for r in reqs if r.decoding):
            batch.input_ids = self._resolve_pending(batch.input_ids)
        prompt = prompt_rows(reqs, batch)
        if prompt and self.prompt_forward is None:
            raise RuntimeError("this scheduler has no prompt_forward: prompt logprobs unavailable")
        launched = Launched(done=[], readback=rb)
        pen_rows = None if self.penalties is None else self.penalties.rows(reqs)
        processed = None  # the logits with the penalty pool applied, where the forward did
        plan = prompt_plan(prompt, self.device) if prompt else None
        fwd_start = self.timer.forward_begin()
        if plan is not None:
            rows, targets, k = plan
            logits, lp, top_v, top_i = self.prompt_forward(batch, rows, targets, k)
            launched.prompt, launched.prompt_top_k = prompt, k
            launched.prompt_handles = (
                rb.add(lp),
                None if top_v is None else rb.add(top_v),
                None if top_i is None else rb.add(top_i),
            )
        elif pen_rows is not None and self.penalized_forward is not None:
            logits, processed = self.penalized_forward(batch, pen_rows)
        else:
            logits = self.forward(batch)
        fwd_end = self.timer.forward_end()
        if batch.mode is not ForwardMode.DECODE:  # a request's first forward is a prefill
            self._stamp_first_forward(reqs, fwd_start, fwd_end)
        chunked = self.prefill.chunked
        done = launched.done = [r for r in reqs if r is not chunked]
        if not done:
            rb.start()
            return launched
        # a constrained row whose last token is still in flight: its mask needs that token
        waits = self.in_flight is not None and any(
            r.grammar is not None and r.num_pending for r in done
        )
        if len(done) != len(reqs):
            (sel,) = upload_many([[i for i, r in enumerate(reqs) if r is not chunked]],
                                 torch.int64, logits.device)  # fmt: skip
            logits = logits[sel]
            processed = None if processed is None else processed[sel]
            pen_rows = None if pen_rows is None else pen_rows[sel]
        for row, r in enumerate(done):
            r.num_pending += 1
            r.pending_row = row
            if self.cfg.overlap and not r.decoding:  # decodes next step, its token in flight
                self.decode.add(r)
        launched.unsampled = (logits, processed, pen_rows)
        if not waits:
            self.sample_launched(launched)
        return launched

    def sample_launched(self, launched: Launched) -> None:
        """Sample a launched step's rows on the device (the grammar's mask applied first) and
        queue its read-back (no sync). A row whose request finished meanwhile is sampled
        unmasked; its token is dropped at the read-back."""
        logits, processed, pen_rows = launched.unsampled
        launched.unsampled = None
        done, rb = launched.done, launched.readback
        if pen_rows is not None and processed is None:  # eager: the same ops as the graphs'
            processed = self.penalties.apply(logits, pen_rows)
        target = logits if processed is None else processed
        if self.grammar_mask is not None and any(r.grammar is not None for r in done):
            if target is logits and any(r.return_logprob for r in done):
                target = logits.clone()  # logprobs stay the model's own
            live = [r.grammar if self.reqs.get(r.rid) is r else None for r in done]
            self.grammar_mask.apply(target, live)
        ids, _ = sample(target, [r.sampling for r in done], [r.generator for r in done])
        if pen_rows is not None:
            self.penalties.record(pen_rows, ids)
        launched.ids, launched.sampled = rb.add(ids), ids
        if any(r.return_logprob for r in done):
            k = max(r.top_logprobs_num if r.return_logprob else 0 for r in done)
            lp, top_v, top_i = token_logprobs(logits, ids, k)
            launched.logprobs, launched.top_k = rb.add(lp), k
            if top_v is not None:
                launched.top_values, launched.top_ids = rb.add(top_v), rb.add(top_i)
        rb.start()

    def _resolve_pending(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Placeholder ids ``-(row + 1)`` -> that row of the step in flight's sampled ids
        (device ops, no sync)."""
        assert self.in_flight is not None and self.in_flight.sampled is not None
        sampled = self.in_flight.sampled.to(input_ids.dtype)
        rows = (-input_ids - 1).clamp_(min=0)
        return torch.where(input_ids < 0, sampled[rows], input_ids)

    def _stamp_first_forward(self, reqs: list[Req], start: float, end: float) -> None:
        scheduled_at = self.timer.step_started_at or start  # 0 when launched outside step()
        for r in reqs:
            if r.scheduled_at is None:
                r.scheduled_at, r.forward_start_at, r.forward_end_at = scheduled_at, start, end

    def process_outputs(self, launched: Launched) -> list[TokenDelta]:
        """Read the step back (its one host sync); append each request's sampled token,
        finish it, or move it on to decoding."""
        if launched.verify is not None:
            return self._process_verify(launched)
        values = launched.readback.fetch()  # the step's one host sync
        read_at = time.time()
        if launched.prompt:
            take_prompt_logprobs(
                launched.prompt, launched.prompt_handles, launched.prompt_top_k, values,
                live=lambda req: self.reqs.get(req.rid) is req,
            )  # fmt: skip
        reqs = launched.done
        if not reqs:
            return []
        ids_list = [int(t) for t in values[launched.ids]]
        lp_list = values[launched.logprobs] if launched.logprobs is not None else None
        tops = None
        if launched.top_values is not None:
            k = launched.top_k
            tv, ti = values[launched.top_values], values[launched.top_ids]
            tops = [
                [[tv[b * k + j], int(ti[b * k + j])] for j in range(k)] for b in range(len(reqs))
            ]
        outputs = []
        for b, (req, tok) in enumerate(zip(reqs, ids_list, strict=True)):
            req.num_pending -= 1
            if self.reqs.get(req.rid) is not req:  # finished (or aborted) while in flight
                continue
            first = not req.output_ids
            if req.sampling.max_new_tokens == 0:  # prompt logprobs only: nothing to sample
                out = self._finish(req, {"type": "length", "length": 0})
                attach_prompt(out, req)
                out.timeline = first_token_timeline(req, read_at)
                outputs.append(out)
                continue
            lp = lp_list[b] if lp_list is not None and req.return_logprob else None
            out, reason = self.output.append_token(req, tok, lp)
            if req.grammar is not None:
                reason = grammar_finish(req, tok, reason)
            if lp is not None and req.top_logprobs_num > 0 and tops is not None:
                top = tops[b][: req.top_logprobs_num]
                out.top_logprobs = [top]
            if first:
                attach_prompt(out, req)
                if req.first_token_at is None:
                    out.timeline = first_token_timeline(req, read_at)
            if reason is not None:
                self.decode.remove(req)
                out = self._finish(req, reason, out)
            else:
                if not req.decoding:  # its prefill just completed
                    self.decode.add(req)
                fill_meta(out, req)
            outputs.append(out)
        return outputs

    def _has_room(self, req: Req) -> bool:
        """Room for ``req`` beside its KV: a penalty-pool row, where it needs one."""
        return self.penalties is None or self.penalties.has_room(req)

    def _on_admit(self, req: Req) -> None:
        """A request leaves the queue for its first prefill chunk: its penalty-pool row."""
        if needs_row(req):
            if self.penalties is None:
                raise RuntimeError("penalties, logit_bias or min_new_tokens need a PenaltyPool")
            self.penalties.acquire(req)

    def _finish(self, req: Req, reason: dict, last: TokenDelta | None = None) -> TokenDelta:
        """Forget the request, release its KV, table row and penalty row (with
        ``defer_release``: at ``release_finished``), report it finished."""
        self.decode.remove(req)
        self.reqs.pop(req.rid, None)
        self._finished.append(req)
        if not self.defer_release:
            self.release_finished()
        return finished_output(req, reason, last)

    def release_finished(self) -> None:
        """Hand finished requests' KV to the tree and free their rows. The server's loop calls
        it after sending a step's outputs, so a long prompt's radix insert does not sit
        between its last token and the client; every ``step`` starts with it too."""
        finished, self._finished = self._finished, []
        for req in finished:
            self.cache.release(req)
            if self.penalties is not None:
                self.penalties.release(req)


def grammar_finish(req: Req, tok: int, reason: dict | None) -> dict | None:
    """Advance ``req``'s grammar by its new token ``tok``: the finish reason ``reason``, or
    "stop" once the grammar has ended (its stop token accepted), or an abort if the grammar
    refuses the token (the mask allowed it: only a bug gets here)."""
    if not req.grammar.accept(tok):
        return reason or {"type": "abort", "message": f"token {tok} breaks the {req.grammar.kind}"}
    if reason is None and req.grammar.terminated:
        return {"type": "stop", "matched": tok}
    return reason


def first_token_timeline(req: Req, sampled_at: float) -> dict[str, float]:
    """The engine's wall-clock stamps of a request, sent once with its first output."""
    req.first_token_at = sampled_at
    return {
        "engine_recv": req.received_at,
        "scheduled": req.scheduled_at or sampled_at,
        "forward_start": req.forward_start_at or sampled_at,
        "forward_end": req.forward_end_at or sampled_at,
        "first_token": sampled_at,
    }
