"""Server-sent events: ``data: {...}`` lines, a stream that starts at its first event, and an
abort-safe response (its body generator is always closed, which aborts unfinished requests);
and the JSON response of a whole generation. Both are written by orjson: a stream writes one
event per request per engine step, cumulative (SGLang's ``output_ids`` and ``text`` so far),
and the standard library's encoder of those was about a quarter of the API process's busy
time at concurrency 64 (py-spy; ``breakgraph bench host api`` measures the API's CPU per
token)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import anyio
import orjson
from starlette.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from breakgraph.server.errors import APIError, EngineError

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"


def dumps(data: Any) -> bytes:
    """``data`` as UTF-8 JSON. A non-finite float (a logprob of -inf) is written as null,
    which stays valid JSON (the standard library writes ``-Infinity``, or refuses it)."""
    return orjson.dumps(data, option=orjson.OPT_NON_STR_KEYS)


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + dumps(data) + b"\n\n"


class GenerationResponse(JSONResponse):
    """A whole generation's JSON body (a batch of long outputs with logprobs can be large)."""

    def render(self, content: Any) -> bytes:
        return dumps(content)


class EventStream(StreamingResponse):
    """A text/event-stream response whose body generator is closed however the response ends
    (client gone mid-send included), so the generator's cleanup always runs.

    It streams in the caller's task. Starlette's StreamingResponse (under uvicorn's ASGI 2.3)
    starts a task group per response and sends from a second task, so the headers and the
    first event waited for that task's start-up and a loop turn, on every request's TTFT.
    Here a small watcher task listens for the client's disconnect and cancels the stream."""

    def __init__(self, body: AsyncIterator[bytes]):
        # X-Accel-Buffering: a reverse proxy (nginx) passes each event on at once
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(body, media_type="text/event-stream", headers=headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streaming = asyncio.current_task()

        async def cancel_on_disconnect() -> bool:
            # uvicorn also answers a pending receive with a disconnect once the response is
            # done; the watcher is cancelled first (no await after the stream's end)
            while (await receive())["type"] != "http.disconnect":
                pass
            streaming.cancel()
            return True

        watcher = asyncio.ensure_future(cancel_on_disconnect())
        complete = False
        try:
            await self.stream_response(send)
            complete = True
        except asyncio.CancelledError:
            if not (watcher.done() and not watcher.cancelled() and watcher.result()):
                raise  # not the client's disconnect (the server is stopping, say)
            streaming.uncancel()  # the client left: the response is over, not this task
        finally:
            watcher.cancel()
            if complete:  # the body ran to its end: closing it is a formality
                await self.body_iterator.aclose()
            else:
                with anyio.CancelScope(shield=True):
                    await self.body_iterator.aclose()


def error_event(e: Exception) -> bytes:
    if isinstance(e, APIError):
        return sse(e.body())
    status = e.status if isinstance(e, EngineError) else 500
    return sse(APIError(str(e), status=status).body())


async def event_stream(events: AsyncIterator[bytes]) -> EventStream:
    """Wait for the first event before answering, so an early error (say, the engine rejects
    the request) is an ordinary HTTP error; later errors become an error event."""
    first = await anext(events, None)

    async def body() -> AsyncIterator[bytes]:
        try:
            if first is not None:
                yield first
            async for event in events:
                yield event
        except (APIError, EngineError) as e:
            logger.warning("stream ended with an error: %s", e)
            yield error_event(e)
            yield DONE
        finally:
            await events.aclose()

    return EventStream(body())
