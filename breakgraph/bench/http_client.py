"""A small async client of breakgraph's (SGLang-native) HTTP API for the server benches.

One streamed ``POST /generate`` per request, timed on the client: TTFT is the time from
sending to the first ``data:`` line; each later event's gap is split evenly over the tokens
it carries (the server coalesces tokens that pile up), giving one inter-token latency per
token after the first.

On aiohttp (SGLang's ``bench_serving`` client too; the ``bench`` extra): its C HTTP parser
leaves less client time in a TTFT than httpx (pure-Python h11 and anyio): a 32-token
streamed request against a CPU server took 17.4 ms through aiohttp, 17.1 through a raw
socket and 19.7 through httpx.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import socket
import time
from dataclasses import dataclass, field

import orjson

try:
    import aiohttp
except ImportError:  # the server benches' client: pip install 'breakgraph[bench]'
    aiohttp = None
# SGLang's prefill repro draws token ids from this range (clipped to the vocabulary)
TOKEN_ID_RANGE = (1000, 120000)


class BenchError(Exception):
    """The server answered something a bench cannot use (an error status or event), or
    cannot be reached."""


async def stream_events(resp, route: str):
    """Each ``data:`` event of a streamed answer, parsed, with the time it arrived; ends at
    ``[DONE]``. A status other than 200, or an error event, raises a ``BenchError`` naming
    ``route``. orjson: at concurrency 64+ the client parses an event per request per step,
    each cumulative (all output ids so far); with the stdlib's parser the client, not the
    server, was the bound."""
    if resp.status != 200:
        text = await resp.text()
        raise BenchError(f"{route} answered {resp.status}: {text[:300]}")
    async for line in resp.content:
        if not line.startswith(b"data:"):
            continue
        now = time.perf_counter()
        payload = line[len(b"data:") :].strip()
        if payload == b"[DONE]":
            return
        event = orjson.loads(payload)
        if "error" in event:
            raise BenchError(f"{route} stream error: {event['error']}")
        yield now, event


def connection_problem(e: BaseException) -> str:
    """Why a request got no answer, in words (aiohttp's repr names its connection key)."""
    cause = getattr(e, "os_error", None) or e
    if isinstance(cause, ConnectionRefusedError):
        return "connection refused"
    if isinstance(cause, socket.gaierror):
        return "unknown host"
    if isinstance(e, TimeoutError):
        return "timed out"
    if aiohttp is not None and isinstance(e, aiohttp.ServerDisconnectedError):
        return "the server closed the connection"
    return getattr(cause, "strerror", None) or str(e) or type(e).__name__


@dataclass
class RequestResult:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_ms: float
    e2e_ms: float
    decode_ms: float  # first event to last event: the request's decode phase
    itl_ms: list[float] = field(default_factory=list)  # one per token after the first
    finish_reason: dict | None = None
    timeline_ms: dict[str, float] = field(default_factory=dict)  # the server's, by stage

    @property
    def tok_s(self) -> float | None:
        """Decode tokens per second this request saw (1000 / its mean inter-token latency)."""
        if self.completion_tokens < 2 or self.decode_ms <= 0:
            return None
        return (self.completion_tokens - 1) / (self.decode_ms / 1e3)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median(values: list[float]) -> float:
    return percentile(values, 50)


def stage_medians(timelines: list[dict[str, float]]) -> dict[str, float]:
    """The median of each timeline stage over the requests that report it (ms)."""
    stages = dict.fromkeys(k for t in timelines for k in t)  # first-seen order: the server's
    return {k: median([t[k] for t in timelines if k in t]) for k in stages}


def format_stages(stages: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in stages.items()) or "not reported"


def random_ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    """n token ids in SGLang's repro range, clipped to the vocabulary (tiny test models too)."""
    hi = min(TOKEN_ID_RANGE[1], vocab_size)
    lo = min(TOKEN_ID_RANGE[0], hi // 2)
    return [rng.randrange(lo, hi) for _ in range(n)]


class ServerClient:
    """An ``aiohttp.ClientSession`` on one server, with the calls the benches make."""

    def __init__(self, url: str, max_connections: int = 16, timeout_s: float = 600.0):
        if aiohttp is None:
            raise SystemExit(
                "error: the server benches need aiohttp: pip install 'breakgraph[bench]'"
            )
        self.url = url.rstrip("/")
        self.max_connections = max_connections
        self.timeout_s = timeout_s
        self.http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> ServerClient:
        self.http = aiohttp.ClientSession(
            base_url=self.url,
            timeout=aiohttp.ClientTimeout(total=self.timeout_s, connect=30.0),
            connector=aiohttp.TCPConnector(limit=self.max_connections + 4),
            read_bufsize=1 << 20,  # an event is one line: room for long ones (logprobs)
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.http.close()

    async def vocab_size(self) -> int:
        """From /get_model_info, else /get_server_info; fails clearly if the server is down."""
        for path in ("/get_model_info", "/get_server_info"):
            try:
                async with self.http.get(path) as r:
                    text = await r.text()
                    status = r.status
            except (TimeoutError, aiohttp.ClientError) as e:
                raise BenchError(
                    f"cannot reach {self.url}: {connection_problem(e)} (is `breakgraph serve` "
                    "running there? --url names another)"
                ) from None
            try:
                vocab = json.loads(text).get("vocab_size") if status == 200 else None
            except ValueError:  # not JSON
                vocab = None
            if isinstance(vocab, int):
                return vocab
        raise BenchError(f"{self.url} reports no vocab_size (/get_model_info, /get_server_info)")

    async def flush_cache(self, timeout_s: float = 30.0) -> None:
        """POST /flush_cache, retried while the server still has requests in flight."""
        deadline = time.monotonic() + timeout_s
        while True:
            async with self.http.post("/flush_cache") as r:
                status, text = r.status, await r.text()
            if status == 200:
                return
            # 400: requests still in flight (their streams have ended, their frees may not)
            if status != 400 or time.monotonic() > deadline:
                raise BenchError(f"/flush_cache failed ({status}): {text[:200]}")
            await asyncio.sleep(0.05)

    async def generate(self, input_ids: list[int], max_new_tokens: int) -> RequestResult:
        """One streamed greedy request that ignores EOS, timed from sending (the body encoded
        before), with the server's per-stage timeline of the request (``return_timeline``)
        where it reports one."""
        body = {
            "input_ids": input_ids,
            "sampling_params": {
                "max_new_tokens": max_new_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
            },
            "stream": True,
            "return_timeline": True,
        }
        # the body is encoded before the clock starts: TTFT runs from sending the request
        # (orjson: a 64K-id body takes the client ~1 ms, the stdlib's json ~6 ms)
        content = orjson.dumps(body)
        headers = {"content-type": "application/json"}
        t0 = time.perf_counter()
        first = last = None
        tokens = 0
        itl: list[float] = []
        meta: dict = {}
        async with self.http.post("/generate", data=content, headers=headers) as resp:
            async for now, event in stream_events(resp, "/generate"):
                meta = event.get("meta_info", {})
                count = meta.get("completion_tokens", len(event.get("output_ids", [])))
                new = count - tokens
                if first is None:
                    first = now
                elif new > 0:
                    itl += [(now - last) * 1e3 / new] * new
                if new > 0:
                    last, tokens = now, count
        end = time.perf_counter()
        if first is None:
            raise BenchError("/generate stream ended without an event")
        return RequestResult(
            prompt_tokens=meta.get("prompt_tokens", len(input_ids)),
            cached_tokens=meta.get("cached_tokens", 0),
            completion_tokens=tokens,
            ttft_ms=(first - t0) * 1e3,
            e2e_ms=(end - t0) * 1e3,
            decode_ms=((last or first) - first) * 1e3,
            itl_ms=itl,
            finish_reason=meta.get("finish_reason"),
            timeline_ms={k: v * 1e3 for k, v in (meta.get("timeline") or {}).items()},
        )
