"""``--api-key`` (or ``BREAKGRAPH_API_KEY``) against a live server on the tiny token-id model:
every route but the health probes answers 401 in the one JSON error shape without the key,
and serves as usual with it, the ``openai`` client's ``api_key`` included."""

from __future__ import annotations

import httpx
import pytest

from breakgraph.common import envs
from tests.support.server import ServerProcess, sse_events

KEY = "s3cret-key"
GREEDY = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
BEARER = {"Authorization": f"Bearer {KEY}"}

# every route of the server, with a body where it takes one
ROUTES = [
    ("POST", "/generate", {"input_ids": [1, 2, 3], "sampling_params": GREEDY}),
    ("POST", "/v1/completions", {"model": "default", "prompt": [1, 2], "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"model": "default", "messages": []}),
    ("GET", "/v1/models", None),
    ("GET", "/get_model_info", None),
    ("GET", "/get_server_info", None),
    ("GET", "/metrics", None),
    ("GET", "/version", None),
    ("POST", "/flush_cache", None),
    ("POST", "/stop_profile", None),
    ("POST", "/abort_request", {"abort_all": True}),
    ("GET", "/no/such/route", None),
]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    args = ["--model-path", str(tiny_model_dir), "--api-key", KEY]
    srv = ServerProcess(args, tmp_path_factory.mktemp("logs") / "auth.log")
    srv.wait_ready()  # /health answers without the key
    yield srv
    assert srv.stop() == 0, srv.log()


def call(srv, method: str, path: str, body=None, headers=None) -> httpx.Response:
    return httpx.request(method, f"{srv.url}{path}", json=body, headers=headers, timeout=60)


@pytest.mark.parametrize("method,path,body", ROUTES, ids=[r[1] for r in ROUTES])
def test_every_route_but_health_needs_the_key(server, method, path, body):
    for headers, words in (
        (None, "needs an API key"),
        ({"Authorization": "Bearer wrong"}, "API key is wrong"),
        ({"Authorization": f"Bearer {KEY}x"}, "API key is wrong"),
        ({"Authorization": KEY}, "must be 'Bearer KEY'"),
        ({"Authorization": f"Basic {KEY}"}, "must be 'Bearer KEY'"),
    ):
        r = call(server, method, path, body, headers)
        assert r.status_code == 401, (path, headers, r.text)
        assert r.headers["www-authenticate"] == "Bearer"
        error = r.json()["error"]
        assert words in error["message"] and error["code"] == 401
        assert KEY not in r.text
    r = call(server, method, path, body, BEARER)
    assert r.status_code != 401, r.text


def test_the_health_probes_need_no_key(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/health_generate", timeout=60).status_code == 200


def test_with_the_key_the_server_serves(server):
    r = call(server, "POST", "/generate", ROUTES[0][2], BEARER)
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 4
    lower = {"authorization": f"bearer {KEY}"}  # the scheme is case-insensitive (RFC 7235)
    assert call(server, "GET", "/v1/models", None, lower).status_code == 200
    body = {**ROUTES[0][2], "stream": True}
    with httpx.stream("POST", f"{server.url}/generate", json=body, headers=BEARER) as r:
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and len(events[-2]["output_ids"]) == 4
    info = call(server, "GET", "/get_server_info", None, BEARER)
    assert info.status_code == 200 and KEY not in info.text  # the key is not reported back


def test_openai_client_sends_its_api_key(server):
    openai = pytest.importorskip("openai")
    good = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    out = good.completions.create(model="default", prompt=[1, 2, 3], max_tokens=3)
    assert out.usage.completion_tokens == 3
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="API key is wrong"):
        bad.completions.create(model="default", prompt=[1, 2, 3], max_tokens=3)


def test_the_key_from_the_environment_and_the_flag_over_it(tiny_model_dir, tmp_path):
    """BREAKGRAPH_API_KEY when --api-key is not given; --api-key wins over it."""
    with envs.API_KEY.override("from-env"):
        srv = ServerProcess(["--model-path", str(tiny_model_dir)], tmp_path / "env.log")
        flag = ServerProcess(
            ["--model-path", str(tiny_model_dir), "--api-key", "from-flag"], tmp_path / "flag.log"
        )
    try:
        for s in (srv.wait_ready(), flag.wait_ready()):
            assert call(s, "GET", "/v1/models").status_code == 401
        env_auth = {"Authorization": "Bearer from-env"}
        assert call(srv, "GET", "/v1/models", None, env_auth).status_code == 200
        assert call(flag, "GET", "/v1/models", None, env_auth).status_code == 401
        flag_auth = {"Authorization": "Bearer from-flag"}
        assert call(flag, "GET", "/v1/models", None, flag_auth).status_code == 200
        assert "API key required" in srv.log()
    finally:
        assert srv.stop() == 0, srv.log()
        assert flag.stop() == 0, flag.log()


def test_without_a_key_nothing_is_asked(tiny_model_dir, tmp_path):
    with envs.API_KEY.override(None):
        srv = ServerProcess(["--model-path", str(tiny_model_dir)], tmp_path / "open.log")
    try:
        srv.wait_ready()
        assert call(srv, "GET", "/v1/models").status_code == 200
        assert "API key required" not in srv.log()
    finally:
        assert srv.stop() == 0, srv.log()
