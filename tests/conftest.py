"""Fixtures and hooks that tests in several folders use: tiny HF models saved as checkpoints,
the device left idle after each test, the GPU tests' skips in one summary line without CUDA.
Helpers live in ``tests/support``."""

from __future__ import annotations

import contextlib
import gc
import json
import re
from pathlib import Path

import pytest
import torch

from breakgraph.common import envs
from tests.support.hf import FAMILIES, make_hf_model

# on a machine without CUDA, every test that needs it skips under this one reason, folded by
# the short summary (-ra) into one line instead of one per test location
NO_CUDA = "needs a CUDA device (GPU tests; on a GPU machine they run)"


def _fold_gpu_skip(report: pytest.CollectReport | pytest.TestReport) -> None:
    """A skip for want of CUDA, reported under ``NO_CUDA`` at no one location."""
    if not report.skipped or not isinstance(report.longrepr, tuple) or torch.cuda.is_available():
        return
    reason = str(report.longrepr[2])
    if "gpu" in getattr(report, "keywords", ()) or re.search(r"\b(CUDA|GPUs?)\b", reason):
        report.longrepr = (str(Path(__file__).parent), None, NO_CUDA)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _fold_gpu_skip(report)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    _fold_gpu_skip(report)


@pytest.fixture
def knobs():
    """``knobs(MOE_GEMV=8, PDL="1")`` sets environment knobs (breakgraph/common/envs.py) for
    the rest of the test, child processes included; each is restored at teardown."""
    with contextlib.ExitStack() as stack:
        yield lambda **values: stack.enter_context(envs.override(**values))


@pytest.fixture(autouse=True)
def _leave_the_device_idle():
    """After each test: wait for its GPU work, then give its dead engines' memory back.

    The wait makes a test that leaves work running on the device (a runaway kernel, a step
    launched and never read) hang in its own teardown, where faulthandler names it, rather
    than in whichever test next queues enough launches to fill the queue. The memory goes
    back because an engine sizes its KV cache from the memory free on the device: one
    test's cached blocks (or a subprocess test's, seeing them as used) must not shrink the
    next test's engine."""
    yield
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture(scope="session", params=sorted(FAMILIES))
def hf_checkpoint(request, tmp_path_factory):
    """(family, HF model, checkpoint dir) for each model family."""
    model = make_hf_model(request.param)
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    model.save_pretrained(path)
    return request.param, model, path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    model = make_hf_model("llama")
    path = tmp_path_factory.mktemp("tiny-llama-engine")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    """A dummy-weight Qwen3 config (``QWEN3_SMALL``) for the GPU engine and TP tests."""
    from tests.support.gpu import QWEN3_SMALL  # the engine's import, for GPU tests only

    path = tmp_path_factory.mktemp("qwen3-small")
    (path / "config.json").write_text(json.dumps(QWEN3_SMALL))
    return path
