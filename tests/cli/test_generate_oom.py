"""``breakgraph generate`` when the device runs out of memory outside the memory plan (in a
graph capture or the KV pool's allocation at startup, in a step while generating): one line
naming what was asked and free and the flags to change, exit status 2, no traceback; as
``serve`` reports a failed start through its ``StartupError``.

The CLI runs in-process; torch's ``OutOfMemoryError`` (its CUDA message) is raised where
the real one is on a GPU: the rank's KV pool allocation after the plan, a step's launch."""

from __future__ import annotations

import pytest
import torch

import breakgraph.engine.rank as rank
from breakgraph.cli.run import run
from breakgraph.engine.scheduler import Scheduler

# torch's message, as its CUDA caching allocator words it
CUDA_OOM = (
    "CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of 139.81 GiB "
    "of which 383.00 MiB is free. Including non-PyTorch memory, this process has 139.42 GiB "
    "memory in use. Of the allocated memory 137.10 GiB is allocated by PyTorch, and 1.20 GiB is "
    "reserved by PyTorch but unallocated. If reserved but unallocated memory is large try "
    "setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
    "documentation for Memory Management  "
    "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)
FLAGS = ("--mem-fraction-static", "--cuda-graph-max-bs", "--chunked-prefill-size",
         "--max-running-requests", "--disable-cuda-graph")  # fmt: skip


def _out_of_memory(*args, **kwargs):
    raise torch.OutOfMemoryError(CUDA_OOM)


def _generate(path, capsys) -> str:
    code = run(["generate", "--model-path", str(path), "--input-ids", "1 2 3",
                "--max-new-tokens", "2", "--ignore-eos"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = [line for line in err.strip().splitlines() if "ERROR" in line]
    assert len(lines) == 1, err
    return lines[0]


def _assert_names_cause_and_flags(line: str, stage: str) -> None:
    assert f"the device ran out of memory {stage}, outside the memory plan" in line, line
    assert "(1.00 GiB asked, 383.00 MiB free)" in line, line
    for flag in FLAGS:
        assert flag in line, (flag, line)


def test_out_of_memory_at_startup_is_one_line(tiny_llama_dir, capsys, monkeypatch):
    class ShortKVPool(rank.KVPool):
        from_model = classmethod(_out_of_memory)

    monkeypatch.setattr(rank, "KVPool", ShortKVPool)
    _assert_names_cause_and_flags(_generate(tiny_llama_dir, capsys), "while starting")


def test_out_of_memory_while_generating_is_one_line(tiny_llama_dir, capsys, monkeypatch):
    # a step's launch (its forward and sampling); the startup's memory profile runs the
    # runner's steps too, and turns an error there into its own one-line refusal
    monkeypatch.setattr(Scheduler, "launch", _out_of_memory)
    _assert_names_cause_and_flags(_generate(tiny_llama_dir, capsys), "while generating")


@pytest.mark.parametrize("message", ["", "out of memory on some other device"])
def test_a_message_without_torchs_numbers_keeps_its_first_line(message):
    from breakgraph.cli.generate import out_of_memory

    line = str(out_of_memory(torch.OutOfMemoryError(message), "while starting"))
    assert "\n" not in line
    assert f"({message or 'OutOfMemoryError'})" in line


def test_a_tp_workers_failure_during_a_step_is_one_line():
    """A worker's device out of memory reaches rank 0 as its message (``TPWorkerError``):
    the same line as rank 0's own, naming the rank; any other failure its first line."""
    from breakgraph.cli.generate import worker_failure
    from breakgraph.engine.tp.driver import TPWorkerError

    oom = TPWorkerError(
        "TP worker rank 1 exited (exit code 1): ...", 1, f"OutOfMemoryError: {CUDA_OOM}"
    )
    _assert_names_cause_and_flags(str(worker_failure(oom)), "on TP rank 1 while generating")
    killed = TPWorkerError("TP worker rank 1 exited (exit code -9): restart it\nmore", 1)
    assert str(worker_failure(killed)) == "TP worker rank 1 exited (exit code -9): restart it"
