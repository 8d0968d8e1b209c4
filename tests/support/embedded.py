"""Fixtures for ``breakgraph serve`` on the embedded SmolLM2-135M-Instruct (text in and out):
``server``, its ``openai`` client and the model name it serves. A module that uses them
binds them by name (``server, client, model_name = embedded.server, ...``): tests/server's
conftest.py names the tiny token-id server ``server`` too."""

from __future__ import annotations

import pytest

from tests.support.server import ServerProcess


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess([], tmp_path_factory.mktemp("logs") / "embedded.log").wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model_name(client) -> str:
    return client.models.list().data[0].id
