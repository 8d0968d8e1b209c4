"""Fixtures and hooks that tests in several folders use: tiny HF models saved as checkpoints,
the device left idle after each test. Helpers live in ``tests/support``."""

from __future__ import annotations

import contextlib
import gc
import json

import pytest
import torch

from breakgraph.common import envs
from tests.support.hf import FAMILIES, make_hf_model


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
