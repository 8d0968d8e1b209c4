"""``--cpu-threads``: the engine's torch pool on the CPU, in-process (``generate``) and in the
engine process ``serve`` starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.server import ServerProcess

GENERATE_THEN_COUNT = """
import sys
from breakgraph.cli import main
code = main(["generate", "--model-path", sys.argv[1], "--input-ids", "1 2", "--max-new-tokens",
             "2", "--cpu-threads", "1"])
import torch
print(code, torch.get_num_threads())
"""


def test_generate_runs_on_the_threads_asked_for(tiny_llama_dir):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    r = subprocess.run(
        [sys.executable, "-c", GENERATE_THEN_COUNT, str(tiny_llama_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "0 1"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc/PID/environ")
def test_serve_starts_its_engine_process_with_the_threads_asked_for(tiny_llama_dir, tmp_path):
    srv = ServerProcess(
        ["--model-path", str(tiny_llama_dir), "--cpu-threads", "1"], tmp_path / "serve.log"
    )
    try:
        srv.wait_ready()
        environ = Path(f"/proc/{srv.engine_pid()}/environ").read_bytes().split(b"\0")
    finally:
        assert srv.stop() == 0, srv.log()
    assert b"OMP_NUM_THREADS=1" in environ
