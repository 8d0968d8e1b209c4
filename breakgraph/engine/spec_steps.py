"""The scheduler's speculative steps (engine/speculative.py): when a decode step is a verify
step, its launch and its read-back; under overlap, a verify step chained to the one still on
the device (engine/spec_chain.py)."""

from __future__ import annotations

from breakgraph.common.messages import TokenDelta
from breakgraph.engine.launched import Launched
from breakgraph.engine.logprobs import ReadBack
from breakgraph.engine.output import fill_meta
from breakgraph.engine.request import Req
from breakgraph.forward_batch import ForwardBatch


class SpecSteps:
    """A mixin of ``Scheduler`` (its ``spec``, ``decode``, ``prefill``, ``in_flight`` ...)."""

    def _schedule_verify(
        self, stepping: list[Req], outputs: list[TokenDelta]
    ) -> tuple[list[Req], ForwardBatch] | None:
        """A speculative verify step of ``stepping`` if one of them drafts and has a draft
        (engine/speculative.py); None: a plain decode step. Tokens still in flight are read
        back first (a draft continues the last token)."""
        if not any(self.spec.drafts_for(r) for r in stepping):
            return None
        if any(r.num_pending for r in stepping):
            outputs.extend(self.drain())
            self.release_finished()
            stepping = self.decode.stepping()
            if not any(self.spec.drafts_for(r) for r in stepping):
                return None
        return self.spec.schedule(stepping)

    def _verify_in_flight(self, outputs: list[TokenDelta]):
        """With a verify step in flight: the next verify step chained to it, else None once
        it is read back (what comes next needs its tokens on the host). A request that could
        be admitted to prefill is not kept waiting behind a chain (one waiting for a running
        request to end is)."""
        prev = self.in_flight.verify
        prefill = self.prefill
        full = len(self.decode.running) >= self.cfg.max_running_requests
        if prefill.chunked is None and (not prefill.waiting or full):
            stepping = [r for r in self.decode.stepping() if not _ends_with(r, self.cfg)]
            if stepping:
                chained = self.spec.schedule_chained(prev, stepping)
                if chained is not None:
                    return chained
        outputs.extend(self.drain())
        self.release_finished()
        return None

    def _launch_verify(self, batch: ForwardBatch) -> Launched:
        """Drafts, every row's logits, their acceptance queued for the read-back (no sync)."""
        rb = ReadBack()
        self.timer.forward_begin()
        verify = self.spec.launch(batch, self.forward, rb, self.grammar_mask, self.penalties)
        self.timer.forward_end()
        rb.start()
        return Launched(done=verify.reqs, readback=rb, verify=verify)

    def _process_verify(self, launched: Launched) -> list[TokenDelta]:
        """Keep each request's accepted draft prefix plus the next token; free the rejected
        rows' slots (not those the verify step chained to it may write); finish checks token
        by token."""
        values = launched.readback.fetch()  # the step's one host sync
        nxt = self.in_flight.verify if self.in_flight is not None else None
        if nxt is not None and nxt.chained_to is not launched.verify:
            nxt = None
        outputs = []
        for req, toks, (lps, tops) in self.spec.accepted(launched.verify, values, nxt):
            out, reason = self.output.append_tokens(req, toks, lps, tops)
            outputs.append(self._finish(req, reason, out) if reason else fill_meta(out, req))
        return outputs


def _ends_with(req: Req, cfg) -> bool:
    """Whether the verify step in flight surely ends ``req`` by length (it keeps at least one
    token)."""
    return (
        len(req.output_ids) + 1 >= req.sampling.max_new_tokens
        or req.fill_len + 1 >= cfg.max_context_len
    )
