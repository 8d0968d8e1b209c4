"""What ``serve`` and ``generate`` say at the default log level: start-up progress and the
engine's summary, and every error in one format."""

from __future__ import annotations

import re
import socket
import subprocess
import sys

from tests.support.server import ServerProcess

# the one log format (common/logs.py): time, level, logger, message; [engine] in its process
LINE = re.compile(
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (INFO|WARNING|ERROR) (\[engine\] )?[\w.]+: "
)


def test_serve_says_what_start_up_does_at_the_default_level(tiny_llama_dir, tmp_path):
    srv = ServerProcess(["--model-path", str(tiny_llama_dir)], tmp_path / "serve.log")
    try:
        srv.wait_ready()
    finally:
        assert srv.stop() == 0, srv.log()
    log = srv.log()
    lines = [line for line in log.splitlines() if LINE.match(line)]
    order = [
        "breakgraph.server.client: engine process",  # loading starts
        "[engine] breakgraph.models.loader: loaded",  # the weights, their dtype and device
        "[engine] breakgraph.engine.engine: engine ready:",  # KV slots, running, context
        "[engine] breakgraph.engine.engine: memory:",
    ]
    at = [next((i for i, line in enumerate(lines) if words in line), None) for words in order]
    assert None not in at and at == sorted(at), log
    loaded, ready = lines[at[1]], lines[at[2]]
    assert "torch.float32" in loaded and "on cpu" in loaded
    for words in ("KV slots", "running requests", "context"):
        assert words in ready
    assert "breakgraph: serving" in log


def test_errors_of_serve_and_generate_share_one_format():
    def err(*args: str) -> str:
        r = subprocess.run(
            [sys.executable, "-m", "breakgraph.cli", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode != 0
        (line,) = r.stderr.strip().splitlines()
        assert LINE.match(line) and " ERROR " in line, line
        return line

    for command in (["serve"], ["generate", "hi"]):
        assert "--model-path /no/such/model: no such file" in err(
            *command, "--model-path", "/no/such/model"
        )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        assert "already in use" in err("serve", "--model-path", "smollm2-135m", "--port", port)


def test_the_start_up_choices_speak_at_the_default_level():
    """At the default level the memory plan's auto fraction and the extend attention FlashInfer
    serves are said (once per start or per attention shape); per-step loggers stay quiet."""
    import logging

    from breakgraph.common.logs import STARTUP_LOGGERS, configure_logging

    root = logging.getLogger()
    saved = (root.level, list(root.handlers))
    levels = {name: logging.getLogger(name).level for name in STARTUP_LOGGERS}
    try:
        configure_logging("warning")
        for name in ("breakgraph.engine.memory", "breakgraph.kernels.flashinfer_extend"):
            assert logging.getLogger(name).isEnabledFor(logging.INFO), name
        assert not logging.getLogger("breakgraph.engine.scheduler").isEnabledFor(logging.INFO)
    finally:
        root.setLevel(saved[0])
        root.handlers[:] = saved[1]
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
