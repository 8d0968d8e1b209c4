"""The ZMQ PUSH/PULL pair between the API process and the engine process (messages: messages.py)."""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import zmq


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
