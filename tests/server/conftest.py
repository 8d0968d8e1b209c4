"""The tiny token-id server (a random llama without tokenizer) that several server test
modules share, one per module."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.hf import make_hf_model
from tests.support.server import CONTEXT_LEN, start_tiny


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-server-model")
    model = make_hf_model("llama")
    model.config.max_position_embeddings = CONTEXT_LEN
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    srv = start_tiny(tiny_model_dir, tmp_path_factory.mktemp("logs") / "tiny.log")
    yield srv
    assert srv.stop() == 0, srv.log()
