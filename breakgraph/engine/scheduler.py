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

Structured output and speculative decoding sample in their own ways: launched.py, speculative.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from breakgraph.cache.kv_pool import SlotAllocator
from breakgraph.cache.radix_cache import RadixCache
from breakgraph.cache.req_to_token import ReqToTokenPool
from breakgraph.common.messages import TokenDelta
from breakgraph.engine.cache_manager import CacheManager
from breakgraph.engine.config import SchedulerConfig, SchedulerStats
from breakgraph.engine.decode import DecodeManager
from breakgraph.engine.grammar import GrammarMask
from breakgraph.engine.launched import (
    Launched,
    PenalizedForward,
    PromptForward,
    resolve_pending,
    sample_step,
)
from breakgraph.engine.logprobs import ReadBack
from breakgraph.engine.output import (
    OutputProcessor,
    fill_meta,
    finished_output,
    first_token_timeline,
)
from breakgraph.engine.penalties import PenaltyPool, needs_row
from breakgraph.engine.prefill import PrefillManager
from breakgraph.engine.prompt_logprobs import (
    attach_prompt,
    prompt_plan,
    prompt_rows,
    take_prompt_logprobs,
)
from breakgraph.engine.request import Req
from breakgraph.engine.spec_steps import SpecSteps
from breakgraph.engine.speculative import SpecDecoder
from breakgraph.engine.step_timer import StepTimer
from breakgraph.engine.verify_step import SpecStats
from breakgraph.forward_batch import ForwardBatch, ForwardMode, upload_many

__all__ = ["Scheduler"]


class Scheduler(SpecSteps):
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
        drafter=None,  # speculative decoding's draft model (engine/draft.py)
        states=None,  # the model's per-request state across verify steps (rank_ops.py)
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
            # room beside its KV: a penalty-pool row, where it needs one
            has_room=lambda req: self.penalties is None or self.penalties.has_room(req),
            on_admit=self._on_admit,
        )
        self.output = OutputProcessor(config.eos_token_ids, config.max_context_len, stop_text)
        self.spec = SpecDecoder.of(config, self.cache, device, drafter, states)
        self.reqs: dict[str, Req] = {}
        # finished requests whose KV is not yet released (see release_finished)
        self._finished: list[Req] = []
        self.defer_release = False
        self.last_step_tokens = 0
        self.in_flight: Launched | None = None  # overlap: launched, not yet read back
        self.timer = StepTimer(device)  # host vs GPU time of each step; timeline stamps

    # ---- requests in and out ----
    @property
    def spec_stats(self) -> SpecStats:
        """Speculative steps, drafted and accepted tokens (zeros without speculation)."""
        return self.spec.stats if self.spec is not None else SpecStats()

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
        """Requests to prefill or decode, or a step in flight with a live one to read back."""
        live = self.in_flight is not None and self.in_flight.serves(self.reqs)
        return self.prefill.has_work or bool(self.decode.running) or live

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
            **self.spec_stats.totals(),
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
        # a verify step stays in flight where the next may be chained to it (spec_chain.py)
        stays = launched is None or launched.verify is None or self.spec.chain
        if self.cfg.overlap and stays:
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
        if self.in_flight is not None and self.in_flight.verify is not None:
            chained = self._verify_in_flight(outputs)
            if chained is not None:
                return chained
        no_forward: list[Req] = []
        scheduled = self.prefill.schedule_batch(no_forward)
        for req in no_forward:
            outputs.append(self._finish(req, {"type": "length", "length": 0}))
        if scheduled is not None or not self.decode.running:
            return scheduled
        stepping = self.decode.stepping()
        if self.spec is not None:
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

    def launch(self, reqs: list[Req], batch: ForwardBatch) -> Launched:
        """Forward and sample on the device, queueing what the host reads back (no sync).

        A request mid-prefill (chunked) has no token to sample: its logits row is dropped.
        """
        if self.spec is not None and self.spec.pending is not None:
            return self._launch_verify(batch)
        rb = ReadBack()
        if any(r.num_pending for r in reqs if r.decoding):
            batch.input_ids = resolve_pending(batch.input_ids, self.in_flight)
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
            launched.add_prompt(prompt, k, lp, top_v, top_i)
        elif pen_rows is not None and self.penalized_forward is not None:
            logits, processed = self.penalized_forward(batch, pen_rows)
        else:
            logits = self.forward(batch)
        if self.spec is not None:  # the drafter's KV for the same rows
            self.spec.mirror(batch, reqs)
        fwd_end = self.timer.forward_end()
        if batch.mode is not ForwardMode.DECODE:  # a request's first forward is a prefill
            self.timer.stamp_first_forward(reqs, fwd_start, fwd_end)
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
        live = [r.grammar if self.reqs.get(r.rid) is r else None for r in launched.done]
        sample_step(launched, self.penalties, self.grammar_mask, live)

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
        ids_list, lp_list, tops = launched.tokens(values)
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
                reason = req.grammar.finish(tok, reason)
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
