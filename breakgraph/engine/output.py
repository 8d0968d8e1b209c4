"""What a step hands back per request, a ``TokenDelta`` (common/messages.py, the record the
API process consumes): sampled tokens appended, finish checks (stop tokens, lengths, stop
strings) and the meta info the API reports."""

from __future__ import annotations

from collections.abc import Callable

from breakgraph.common.messages import TokenDelta
from breakgraph.engine.request import Req, ReqStatus


class OutputProcessor:
    def __init__(
        self,
        eos_token_ids: set[int],
        max_context_len: int,
        stop_text: Callable[[list[int]], str] | None = None,
    ):
        self.eos_token_ids = eos_token_ids
        self.max_context_len = max_context_len
        self.stop_text = stop_text  # decodes ids to text for stop strings (None: no tokenizer)

    def append_token(self, req: Req, tok: int, lp: float | None) -> tuple[TokenDelta, dict | None]:
        """Append a sampled token; return its output and the finish reason (None: goes on)."""
        req.output_ids.append(tok)
        if lp is not None:
            req.output_logprobs.append(lp)
        out = TokenDelta(rid=req.rid, token_ids=[tok], logprobs=[] if lp is None else [lp])
        return out, self.check_finish(req, tok)

    def append_tokens(
        self, req: Req, toks: list[int], lps: list | None = None, tops: list | None = None
    ) -> tuple[TokenDelta, dict | None]:
        """Append several tokens (a speculative step's) with their logprobs and top-k (None:
        none wanted), checking each (and advancing the request's grammar by each): one output
        with those appended before the finish, and the finish reason (None: goes on)."""
        reason, n = None, 0
        for tok in toks:  # one delta for all (a TokenDelta per token cost more than the rest)
            req.output_ids.append(tok)
            n += 1
            reason = self.check_finish(req, tok)
            if req.grammar is not None:
                reason = req.grammar.finish(tok, reason)
            if reason is not None:
                break
        taken = [lp for lp in lps[:n] if lp is not None] if lps is not None else []
        req.output_logprobs += taken
        out = TokenDelta(rid=req.rid, token_ids=list(toks[:n]), logprobs=taken)
        if tops is not None:
            out.top_logprobs = tops[:n]
        return out, reason

    def check_finish(self, req: Req, tok: int) -> dict | None:
        sp = req.sampling
        if tok in sp.stop_token_ids or (not sp.ignore_eos and tok in self.eos_token_ids):
            return {"type": "stop", "matched": tok}
        if len(req.output_ids) >= sp.max_new_tokens:
            return {"type": "length", "length": sp.max_new_tokens}
        if req.fill_len >= self.max_context_len:
            return {"type": "length", "length": len(req.output_ids)}
        if sp.stop and self.stop_text is not None:
            # only the tail can hold a stop string that this token completed
            longest = max(len(s) for s in sp.stop)
            tail = self.stop_text(req.output_ids[-(longest + 8) :])
            for s in sp.stop:
                if s in tail:
                    return {"type": "stop", "matched": s}
        return None


def fill_meta(out: TokenDelta, req: Req) -> TokenDelta:
    """Token counts as the API reports them (``meta_info``)."""
    out.prompt_tokens = len(req.input_ids)
    out.completion_tokens = len(req.output_ids)
    out.cached_tokens = req.prefix_hit_tokens
    return out


def finished_output(req: Req, reason: dict, last: TokenDelta | None = None) -> TokenDelta:
    """Mark ``req`` finished (its KV already released); ``last``: this step's token, if any."""
    req.decoding = False
    req.status = ReqStatus.FINISHED
    req.finish_reason = reason
    out = TokenDelta(rid=req.rid, finished=True, finish_reason=reason)
    if last is not None:
        out.token_ids, out.logprobs = last.token_ids, last.logprobs
        out.top_logprobs = last.top_logprobs
        out.input_logprobs, out.input_top_logprobs = last.input_logprobs, last.input_top_logprobs
        out.timeline = last.timeline
    return fill_meta(out, req)


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
