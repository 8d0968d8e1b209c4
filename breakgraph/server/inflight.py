"""The API process's registry of in-flight requests: each one's queue, and a step message's
outputs routed onto them, with the request metrics.

Each in-flight request has an asyncio queue that gets its TokenDeltas; an exception instead
ends the request (rejected by the engine, or the engine died). The metrics are kept here,
so they are exact whether or not the HTTP client is still listening.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from breakgraph.common.messages import StepResult, TokenDelta
from breakgraph.server.errors import EngineError, RequestRejected
from breakgraph.server.metrics import ServerMetrics

request_log = logging.getLogger("breakgraph.requests")  # --log-requests: INFO whatever the level


@dataclass
class InFlight:
    queue: asyncio.Queue
    submitted_at: float  # perf_counter: when the request was received by the API process
    received_at: float  # wall clock (time.time), the timeline's stamps
    sent_at: float
    last_token_at: float | None = None
    aborting: bool = False  # an abort was sent: not asked (nor counted) again
    # the counts of its latest delta, which its plain tokens' deltas carry on
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def counted(self, out: TokenDelta) -> TokenDelta:
        """A delta from the engine: its counts hold until the next."""
        self.prompt_tokens, self.cached_tokens = out.prompt_tokens, out.cached_tokens
        self.completion_tokens = out.completion_tokens
        return out

    def plain(self, rid: str, token: int) -> TokenDelta:
        """The delta of a plain token (``StepResult.token_rids``): one token, counted."""
        self.completion_tokens += 1
        return TokenDelta(rid, [token], prompt_tokens=self.prompt_tokens,
                          completion_tokens=self.completion_tokens,
                          cached_tokens=self.cached_tokens)  # fmt: skip


class InFlightRequests:
    """The requests sent to the engine and not yet finished, by rid."""

    def __init__(self, metrics: ServerMetrics, log_requests: bool = False):
        self.metrics = metrics
        self.log_requests = log_requests  # one INFO line per request finished
        self._entries: dict[str, InFlight] = {}

    def __contains__(self, rid: str) -> bool:
        return rid in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, rid: str) -> InFlight | None:
        return self._entries.get(rid)

    def rids(self) -> list[str]:
        return list(self._entries)

    def add(self, rid: str, entry: InFlight) -> None:
        self._entries[rid] = entry

    def end(self, rid: str, error: EngineError) -> None:
        """End ``rid`` now: its waiter gets ``error`` (counted as an abort)."""
        entry = self._entries.pop(rid, None)
        if entry is not None:
            self.metrics.requests.labels("abort").inc()
            entry.queue.put_nowait(error)

    def fail_all(self, error: EngineError) -> None:
        for entry in self._entries.values():
            entry.queue.put_nowait(error)
        self._entries.clear()

    def route(self, msg: StepResult) -> None:
        """Hand each output to its request's queue, then observe the step's metrics in a
        callback of their own: the requests' tasks, woken by the queues, are scheduled first,
        so a token reaches its client before the histograms are updated."""
        now = time.perf_counter()
        inflight = self._entries
        for err in msg.errors:
            entry = inflight.pop(err.rid, None)
            if entry is not None:
                entry.queue.put_nowait(RequestRejected(err.message))
        routed = []
        # plain tokens first: a request's delta in the same message comes after its token
        for rid, token in msg.plain_tokens():
            entry = inflight.get(rid)
            if entry is not None:
                out = entry.plain(rid, token)
                entry.queue.put_nowait(out)
                routed.append((entry, out))
        for out in msg.outputs:
            entry = inflight.get(out.rid)
            if entry is None:
                continue
            if out.finished:
                del inflight[out.rid]
            entry.queue.put_nowait(entry.counted(out))
            routed.append((entry, out))
        asyncio.get_running_loop().call_soon(self._observe_step, msg, routed, now)

    def _observe_step(self, msg: StepResult, routed: list, now: float) -> None:
        m = self.metrics
        if msg.step_ms is not None:
            m.observe_step(msg.step_ms, msg.forward_ms, msg.gpu_ms, msg.gpu_step_ms)
        for _ in msg.errors:
            m.requests.labels("error").inc()
        for entry, out in routed:
            self._observe_output(entry, out, now)

    def _observe_output(self, entry: InFlight, out: TokenDelta, now: float) -> None:
        m, n = self.metrics, len(out.token_ids)
        if out.timeline is not None:  # once, with its first output (tokens or not)
            m.observe_timeline(entry.received_at, entry.sent_at, out.timeline)
            m.prompt_tokens.inc(out.prompt_tokens)
            m.cached_tokens.inc(out.cached_tokens)
        if n:
            m.generation_tokens.inc(n)
            if entry.last_token_at is None:
                m.ttft.observe(now - entry.submitted_at)
            else:
                gap = (now - entry.last_token_at) / n
                for _ in range(n):
                    m.itl.observe(gap)
            entry.last_token_at = now
        if out.finished:
            m.e2e.observe(now - entry.submitted_at)
            m.requests.labels((out.finish_reason or {}).get("type", "unknown")).inc()
            if self.log_requests:
                request_log.info(
                    "finished %s: %d prompt (%d cached) + %d completion tokens, %s, %.3f s",
                    out.rid,
                    out.prompt_tokens,
                    out.cached_tokens,
                    out.completion_tokens,
                    out.finish_reason,
                    now - entry.submitted_at,
                )
