"""Server-sent events: ``data: {...}`` lines, a stream that starts at its first event, and an
abort-safe response (its body generator is always closed, which aborts unfinished requests)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from breakgraph.server.client import EngineError
from breakgraph.server.protocol import APIError

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class EventStream(StreamingResponse):
    """A text/event-stream response whose body generator is closed however the response ends
    (client gone mid-send included), so the generator's cleanup always runs."""

    def __init__(self, body: AsyncIterator[str]):
        super().__init__(
            body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


def error_event(e: Exception) -> str:
    if isinstance(e, APIError):
        return sse(e.body())
    status = e.status if isinstance(e, EngineError) else 500
    return sse(APIError(str(e), status=status).body())


async def event_stream(events: AsyncIterator[str]) -> EventStream:
    """Wait for the first event before answering, so an early error (say, the engine rejects
    the request) is an ordinary HTTP error; later errors become an error event."""
    first = await anext(events, None)

    async def body() -> AsyncIterator[str]:
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
