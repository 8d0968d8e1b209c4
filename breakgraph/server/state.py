"""What the routes share: the engine handle, the tokenizer and what the engine reported."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from breakgraph.common.messages import ModelInfo
from breakgraph.engine.args import DEFAULT_MAX_REQUEST_BYTES
from breakgraph.server.client import EngineClient
from breakgraph.server.errors import APIError
from breakgraph.tokenizer import Tokenizer


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
