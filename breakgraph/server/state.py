"""What the routes share: the engine handle, the tokenizer and what the engine reported, and
how a generation route takes its request in."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from breakgraph.common.messages import ModelInfo
from breakgraph.engine.args import DEFAULT_MAX_REQUEST_BYTES
from breakgraph.server.client import EngineClient
from breakgraph.server.errors import APIError
from breakgraph.server.generation import GenerationRequest, stamp_received
from breakgraph.server.json_body import off_loop_if_large, read_body
from breakgraph.tokenizer import Tokenizer

B = TypeVar("B")  # a route's parsed body
X = TypeVar("X")  # what else a route's preparation hands back


@dataclass
class ServerState:
    client: EngineClient
    tokenizer: Tokenizer | None
    info: ModelInfo
    served_model_name: str
    model_path: str | None
    server_args: dict[str, Any] = field(default_factory=dict)
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    incremental_streaming_output: bool = False  # /generate stream events: the new part only
    stream_interval: int = 1  # a stream's events: every this many tokens (first and last at once)

    def require_alive(self) -> None:
        if not self.client.alive:
            raise APIError("the engine is not running", status=503)


def server_state(request: Request) -> ServerState:
    return request.app.state.server


async def read_generation(
    request: Request,
    prepare: Callable[[bytes, ServerState], tuple[B, list[GenerationRequest], X]],
) -> tuple[ServerState, B, list[GenerationRequest], X]:
    """A generation route's request taken in: its body read (within --max-request-bytes),
    ``prepare(raw, state)`` parsing, validating and tokenizing it (in a worker thread when
    large) into (body, requests, the route's own), and the requests stamped with when it
    arrived (taken before the body was read)."""
    received_at, received_perf = time.time(), time.perf_counter()
    s = server_state(request)
    raw = await read_body(request, s.max_request_bytes)
    body, gen_reqs, extra = await off_loop_if_large(raw, prepare, raw, s)
    stamp_received(gen_reqs, received_at, received_perf)
    return s, body, gen_reqs, extra
