"""One request's life in the API process, shared by the native and the OpenAI routes.

``stream_generation`` submits a validated request and yields its cumulative state after each
batch of engine outputs; if the consumer stops early (client gone), the request is aborted.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from breakgraph.common.sampling_params import SamplingParams
from breakgraph.server.client import EngineClient
from breakgraph.server.detokenize import TextStream
from breakgraph.tokenizer import Tokenizer


@dataclass
class GenerationRequest:
    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False
    rid: str | None = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    logprob_start_len: int = -1  # first prompt position with a logprob (-1: none)
    top_logprobs_num: int = 0
    return_timeline: bool = False  # per-request stage durations in meta_info
    # when the API process received the request (wall clock for the timeline, perf_counter
    # for latencies) and when it was parsed, validated and tokenized (None: not measured)
    received_at: float = field(default_factory=time.time)
    received_perf: float = field(default_factory=time.perf_counter)
    validated_at: float | None = None


def stamp_received(gen_reqs: list[GenerationRequest], received_at: float, received_perf: float):
    """The API process's stamps of a route's requests: received (taken by the route before it
    read the body) and validated (now: parsed, checked and tokenized)."""
    validated_at = time.time()
    for r in gen_reqs:
        r.received_at, r.received_perf, r.validated_at = received_at, received_perf, validated_at


# a request's timeline, in order: (stage, the stamp that ends it); each stage lasts from the
# previous present stamp to its own, so the stages add up to the end-to-end latency
TIMELINE_STAGES = (
    ("validate", "validated"),  # parse, validate, tokenize
    ("send", "sent"),  # build and send the engine message
    ("ipc", "engine_recv"),  # until the engine loop reads it
    ("queue", "scheduled"),  # waiting to be scheduled
    ("schedule", "forward_start"),  # batch building and uploads before its first forward
    ("forward", "forward_end"),  # host side of its first forward
    ("sample", "first_token"),  # further prefill chunks, sampling, the read-back
    ("return", "first_output"),  # the engine message back to the API process
    ("decode", "last_output"),  # the remaining tokens
    ("detokenize", "detokenized"),
    ("respond", "now"),  # building the response
)


@dataclass
class GenerationState:
    """Cumulative state of one request: what a response or a stream chunk is built from."""

    rid: str
    prompt_tokens: int
    started_at: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str | None = None  # None without a tokenizer
    finished: bool = False
    finish_reason: dict | None = None
    cached_tokens: int = 0
    return_logprob: bool = False
    input_ids: list[int] = field(default_factory=list)
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    top_logprobs: list[list[list]] = field(default_factory=list)  # per output: [[lp, id], ...]
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[list] | None] = field(default_factory=list)
    return_timeline: bool = False
    stamps: dict[str, float] = field(default_factory=dict)  # timeline, wall clock

    def timeline(self, now: float) -> dict[str, float]:
        """Stage durations in seconds (TIMELINE_STAGES), from the stamps present."""
        stamps = {**self.stamps, "now": now}
        out, prev = {}, stamps["received"]
        for stage, stamp in TIMELINE_STAGES:
            if stamp in stamps:
                out[stage] = stamps[stamp] - prev
                prev = stamps[stamp]
        return out

    @property
    def input_logprob_ids(self) -> list[int]:
        """The prompt tokens that input_logprobs describe (from logprob_start_len on)."""
        if self.logprob_start_len < 0:
            return []
        return self.input_ids[self.logprob_start_len :][: len(self.input_logprobs)]

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)

    def meta_info(
        self,
        token_text: Callable[[int], str] | None = None,
        since: int = 0,
        with_input: bool = True,
    ) -> dict:
        """SGLang's meta_info; logprobs as [logprob, token id, text or None] triples (text with
        ``token_text``: return_text_in_logprobs). ``since``: the output logprobs from that
        output on only; ``with_input`` False: the prompt's logprobs as empty lists (an
        incremental stream's later events)."""
        now, now_perf = time.time(), time.perf_counter()
        meta = {
            "id": self.rid,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "finish_reason": self.finish_reason,
            "e2e_latency": now_perf - self.started_at,
        }
        if self.return_timeline:
            meta["timeline"] = self.timeline(now)
        if not self.return_logprob:
            return meta

        def triple(lp: float | None, tok: int) -> list:
            return [lp, tok, token_text(tok) if token_text is not None else None]

        def tops(entries: list[list[list] | None]) -> list:
            return [None if e is None else [triple(lp, int(t)) for lp, t in e] for e in entries]

        inputs = zip(self.input_logprobs, self.input_logprob_ids, strict=False)
        meta["input_token_logprobs"] = [triple(lp, tok) for lp, tok in inputs] if with_input else []
        meta["output_token_logprobs"] = [
            triple(lp, tok)
            for lp, tok in zip(self.logprobs[since:], self.output_ids[since:], strict=False)
        ]
        if self.top_logprobs_num > 0:
            meta["input_top_logprobs"] = tops(self.input_top_logprobs) if with_input else []
            meta["output_top_logprobs"] = tops(self.top_logprobs[since:])
        return meta


async def stream_generation(
    client: EngineClient,
    tokenizer: Tokenizer | None,
    req: GenerationRequest,
    interval: int = 1,
) -> AsyncIterator[GenerationState]:
    """Yield the request's state (the same object, updated) until it finishes: once at least
    ``interval`` tokens came in since the last yield (``--stream-interval``), and at once
    for the first state, the first token and the end."""
    rid = req.rid or uuid.uuid4().hex
    state = GenerationState(
        rid=rid,
        prompt_tokens=len(req.input_ids),
        started_at=req.received_perf,
        return_logprob=req.return_logprob,
        input_ids=req.input_ids,
        logprob_start_len=req.logprob_start_len if req.return_logprob else -1,
        top_logprobs_num=req.top_logprobs_num if req.return_logprob else 0,
        return_timeline=req.return_timeline,
    )
    stamps = state.stamps
    stamps["received"] = req.received_at
    if req.validated_at is not None:
        stamps["validated"] = req.validated_at
    text = None
    if tokenizer is not None:
        text = TextStream(tokenizer, req.sampling.stop, req.skip_special_tokens, req.no_stop_trim)
        state.text = ""
    queue = client.submit(
        rid,
        req.input_ids,
        req.sampling,
        req.return_logprob,
        req.logprob_start_len if req.return_logprob else -1,
        req.top_logprobs_num if req.return_logprob else 0,
        received_at=req.received_at,
        received_perf=req.received_perf,
    )
    stamps["sent"] = client.sent_at(rid) or time.time()  # the client's stamp, before the send
    shown = None  # completion tokens at the last yield, all detokenized (None: no yield yet)
    try:
        while not state.finished:
            items = [await queue.get()]
            while not queue.empty():  # coalesce what piled up while the consumer was busy
                items.append(queue.get_nowait())
            stamps["last_output"] = time.time()
            new_ids: list[int] = []
            for item in items:
                if isinstance(item, Exception):
                    state.finished = True  # nothing left to abort
                    raise item
                new_ids += item.token_ids
                state.logprobs += item.logprobs
                state.top_logprobs += item.top_logprobs
                if item.input_logprobs is not None:
                    state.input_logprobs = item.input_logprobs
                    state.input_top_logprobs = item.input_top_logprobs or []
                state.cached_tokens = item.cached_tokens
                if item.timeline is not None:
                    stamps.update(item.timeline)
                if item.token_ids and "first_output" not in stamps:
                    stamps["first_output"] = stamps["last_output"]
                if item.finished:
                    state.finished = True
                    state.finish_reason = item.finish_reason
            state.output_ids += new_ids
            n = state.completion_tokens
            if not (state.finished or shown is None or (shown == 0 < n) or n - shown >= interval):
                continue  # not due: its tokens are detokenized with the next state shown
            if text is not None:  # the ids since the last state shown
                if state.finished:
                    state.text = text.finish(state.output_ids, state.finish_reason)
                else:
                    state.text = text.feed(state.output_ids[shown or 0 :])
                stamps["detokenized"] = time.time()
            shown = n
            yield state
    finally:
        if not state.finished:
            client.abort(rid)


async def run_to_completion(
    client: EngineClient,
    tokenizer: Tokenizer | None,
    reqs: list[GenerationRequest],
    is_disconnected: Callable[[], Awaitable[bool]] | None = None,
    poll_s: float = 0.5,
) -> list[GenerationState] | None:
    """Run requests to the end concurrently; None (all aborted) if the client goes away."""

    async def last(req: GenerationRequest) -> GenerationState:
        final = None
        # only the end is wanted: no interval reaches it sooner
        async for state in stream_generation(client, tokenizer, req, interval=1 << 62):
            final = state
        return final

    tasks = [asyncio.create_task(last(r)) for r in reqs]
    try:
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(
                pending, timeout=poll_s, return_when=asyncio.FIRST_EXCEPTION
            )
            for t in done:
                if t.exception() is not None:
                    raise t.exception()  # the others are aborted on the way out
            if pending and is_disconnected is not None and await is_disconnected():
                return None
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def merge_streams(
    streams: list[AsyncIterator[GenerationState]],
) -> AsyncIterator[tuple[int, GenerationState]]:
    """Interleave several requests' streams as their states change: (index, state)."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[GenerationState]) -> None:
        try:
            async for state in stream:
                # wait until the consumer is done with this state: the stream updates it in place
                consumed = asyncio.Event()
                await queue.put((i, state, consumed))
                await consumed.wait()
            await queue.put(done)
        except Exception as e:
            await queue.put(e)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                i, state, consumed = item
                yield i, state
                consumed.set()
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
