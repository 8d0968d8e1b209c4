"""``breakgraph serve`` as a subprocess over real loopback HTTP, and what the server tests
do with one: post, server info, wait until idle, read an SSE stream, check a process for
torch."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

CONTEXT_LEN = 4096  # room for a long stream that a disconnect cuts short


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    try:  # a zombie is gone for our purpose
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class ServerProcess:
    def __init__(self, args: list[str], log_path: Path, new_session: bool = False):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        cmd = [sys.executable, "-m", "breakgraph.cli", "serve", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=new_session
        )

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_ready(self, timeout_s: float = 120.0) -> ServerProcess:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"server not ready in {timeout_s} s:\n{self.log()}")

    def engine_pid(self) -> int:
        return httpx.get(f"{self.url}/get_server_info").json()["engine_pid"]

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def sse_events(lines) -> list:
    """The JSON payloads of `data:` lines, then "[DONE]" if the stream ended properly."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def start_tiny(model_dir: Path, log_path: Path, new_session: bool = False) -> ServerProcess:
    return ServerProcess(["--model-path", str(model_dir)], log_path, new_session).wait_ready()


def post(srv: ServerProcess, path: str, body, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{srv.url}{path}", json=body, timeout=timeout)


def info(srv: ServerProcess) -> dict:
    return httpx.get(f"{srv.url}/get_server_info", timeout=10).json()


def metric_values(url: str) -> dict[str, float]:
    """The server's /metrics at ``url``: each sample's value by its name (labels included)."""
    text = httpx.get(f"{url}/metrics").text
    return {
        name: float(value)
        for name, value in (line.rsplit(" ", 1) for line in text.splitlines() if line[:1] != "#")
    }


def wait_idle(srv: ServerProcess, timeout_s: float = 20.0) -> dict:
    """Server info once no request runs or waits any more."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = info(srv)
        idle = state["num_running_reqs"] == 0 and state["num_queued_reqs"] == 0
        if (idle and state["num_inflight_requests"] == 0) or time.monotonic() > deadline:
            return state
        time.sleep(0.1)


def assert_refused_holding_nothing(srv: ServerProcess, r: httpx.Response, says: str) -> None:
    """A bad request's answer: a 400 whose one-line message says ``says``, and the server
    holds nothing of it (no request in flight or running, no KV)."""
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert says in message and "\n" not in message, message
    after = wait_idle(srv)
    assert (after["num_inflight_requests"], after["num_running_reqs"]) == (0, 0)
    assert after["kv_tokens_used"] == 0


def torch_loaded(pid: int) -> bool:
    """Whether process ``pid`` has torch's native library mapped (Linux)."""
    maps = Path(f"/proc/{pid}/maps")
    if not maps.exists():
        pytest.skip("needs /proc")
    return "libtorch" in maps.read_text()
