"""Wire format between the API process and the engine process: msgpack dicts over ZMQ PUSH/PULL.

API -> engine:
  {"type": "add", "rid", "input_ids", "sampling": {SamplingParams fields}, "return_logprob"}
  {"type": "abort", "rid"}
  {"type": "call", "call_id", "method": "stats" | "flush_cache"}
  {"type": "shutdown"}
engine -> API:
  {"type": "ready", "info": {ModelInfo fields}} | {"type": "startup_error", "message"}
  {"type": "step", "step_ms": float | None, "outputs": [output], "errors": [{"rid", "message"}]}
  {"type": "reply", "call_id", "result"}
An output is one request's share of one step: {"rid", "ids", "logprobs", "finished",
"finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens"}.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import msgpack
import zmq

from breakgraph.engine.scheduler import StepOutput


def pack(msg: dict[str, Any]) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def unpack(data: bytes) -> dict[str, Any]:
    return msgpack.unpackb(data, raw=False)


def encode_output(out: StepOutput) -> dict[str, Any]:
    return {
        "rid": out.rid,
        "ids": out.token_ids,
        "logprobs": out.logprobs,
        "finished": out.finished,
        "finish_reason": out.finish_reason,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "cached_tokens": out.cached_tokens,
    }


@dataclass
class ModelInfo:
    """What the engine process reports once the model is loaded (the "ready" message)."""

    model_source: str
    architecture: str
    vocab_size: int
    context_length: int
    max_running_requests: int
    kv_capacity_tokens: int
    dtype: str
    device: str
    engine_pid: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class IpcPaths:
    """ZMQ ipc:// endpoints in a private temp dir; the API process binds, the engine connects."""

    to_engine: str
    from_engine: str
    tmp_dir: str

    @classmethod
    def create(cls) -> IpcPaths:
        tmp = tempfile.mkdtemp(prefix="breakgraph-ipc-")
        return cls(f"ipc://{tmp}/to_engine", f"ipc://{tmp}/from_engine", tmp)

    def remove(self) -> None:
        if Path(self.tmp_dir).is_dir():
            shutil.rmtree(self.tmp_dir, ignore_errors=True)


def make_socket(ctx: zmq.Context, kind: int, endpoint: str, bind: bool) -> zmq.Socket:
    """A PUSH or PULL socket with no high-water mark (a burst of requests never blocks or drops)."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 1000)
    if bind:
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    return sock
