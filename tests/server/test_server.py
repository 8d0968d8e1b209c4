"""The HTTP server over real loopback HTTP, on a tiny random model without tokenizer (token ids).

Starts ``breakgraph serve`` as a subprocess (API process + engine process) and checks what a
client relies on: SGLang-shaped answers, batch = individual, 4xx for bad input while the server
keeps serving, KV slots returned after a disconnect and after 200 concurrent streams, /metrics,
and a clean shutdown of both processes.
"""

from __future__ import annotations

import asyncio
import gzip
import importlib.metadata
import json
import os
import re
import select
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from breakgraph.common.messages import (
    AbortReq,
    GenerateReq,
    RequestError,
    Shutdown,
    StatsReply,
    StatsReq,
    StepResult,
    decode,
    encode,
)
from breakgraph.common.sampling_params import SamplingParams
from breakgraph.engine.args import EngineArgs
from breakgraph.engine.engine import Engine
from breakgraph.server import engine_process
from breakgraph.server.engine_process import EngineLoop
from breakgraph.server.ipc import EngineSocket, FramedSocket
from tests.support.server import (
    CONTEXT_LEN,
    ServerProcess,
    info,
    metric_values,
    pid_alive,
    post,
    sse_events,
    start_tiny,
    torch_loaded,
    wait_idle,
)

GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


# ---- /generate ----
def test_generate_ids(server):
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": GREEDY}
    first = post(server, "/generate", body)
    assert first.status_code == 200, first.text
    out = first.json()
    assert len(out["output_ids"]) == 6 and out["text"] is None
    meta = out["meta_info"]
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (4, 6)
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["e2e_latency"] > 0
    again = post(server, "/generate", body).json()
    assert again["output_ids"] == out["output_ids"]  # greedy is deterministic
    assert again["meta_info"]["cached_tokens"] == 3  # the prompt minus its last token
    assert again["meta_info"]["id"] != meta["id"]


def test_logprobs(server):
    body = {"input_ids": [5, 6], "sampling_params": GREEDY, "return_logprob": True}
    out = post(server, "/generate", body).json()
    lps = out["meta_info"]["output_token_logprobs"]
    assert [tok for _, tok, _ in lps] == out["output_ids"]
    assert all(lp <= 0 for lp, _, _ in lps)


def test_batch_equals_individual(server):
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5], [42]]
    batch = post(server, "/generate", {"input_ids": prompts, "sampling_params": GREEDY})
    assert batch.status_code == 200, batch.text
    outs = batch.json()
    assert isinstance(outs, list) and len(outs) == 3
    for prompt, out in zip(prompts, outs, strict=True):
        single = post(server, "/generate", {"input_ids": prompt, "sampling_params": GREEDY})
        assert out["output_ids"] == single.json()["output_ids"]
        assert out["meta_info"]["prompt_tokens"] == len(prompt)


def test_stream_is_cumulative_and_matches(server):
    # 32 tokens: the API process sends the tokens that piled up while it was busy as one
    # event, so a short output can arrive whole in one when the box is loaded
    body = {"input_ids": [3, 1, 4, 1, 5], "sampling_params": {**GREEDY, "max_new_tokens": 32}}
    expected = post(server, "/generate", body).json()["output_ids"]
    with httpx.stream("POST", f"{server.url}/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) >= 2 and len(chunks[0]["output_ids"]) >= 1
    for a, b in zip(chunks, chunks[1:], strict=False):
        assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
        assert a["meta_info"]["finish_reason"] is None
    assert chunks[-1]["output_ids"] == expected
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_batch_stream(server):
    body = {"input_ids": [[1, 2], [3, 4]], "sampling_params": GREEDY, "stream": True}
    with httpx.stream("POST", f"{server.url}/generate", json=body) as r:
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    finals = {e["index"]: e for e in events[:-1] if e["meta_info"]["finish_reason"]}
    assert sorted(finals) == [0, 1]
    assert all(len(e["output_ids"]) == 6 for e in finals.values())


def test_completions_with_token_ids(server):
    name = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    body = {"model": name, "prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True, "n": 2}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert all(c["finish_reason"] == "length" for c in out["choices"])
    usage = out["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (3, 8, 11)
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}) as r:
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    finishes = [c for e in events[:-1] for c in e["choices"] if c["finish_reason"]]
    assert sorted(c["index"] for c in finishes) == [0, 1]


# ---- bad input ----
BAD_GENERATE = [
    ("{not json", "malformed JSON"),
    ({"sampling_params": GREEDY}, "exactly one of text and input_ids"),
    ({"text": "hi", "input_ids": [1]}, "exactly one of text and input_ids"),
    ({"input_ids": []}, "prompt is empty"),
    ({"input_ids": [1, -1]}, "out of range"),
    ({"input_ids": [1, 256]}, "out of range"),
    ({"input_ids": [1, "x"]}, "not an integer"),
    ({"input_ids": [1, True]}, "input_ids[1]: token id True is not an integer"),
    ({"input_ids": [[1], [2, 256]]}, "input_ids[1][1]: token id 256 is out of range [0, 256)"),
    ({"text": "hello"}, "no tokenizer"),
    ({"input_ids": [1] * 10, "sampling_params": {"max_new_tokens": CONTEXT_LEN}}, "context length"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    (
        {"input_ids": [1], "sampling_params": {"max_new_tokens": 4, "min_new_tokens": 5}},
        "min_new_tokens (5) is above max_new_tokens (4)",
    ),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 2.5}}, "max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 10**12}}, "max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"temperature": -0.1}}, "temperature"),
    ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p"),
    ({"input_ids": [1], "sampling_params": {"top_p": 1.5}}, "top_p"),
    ({"input_ids": [1], "sampling_params": {"top_k": -2}}, "top_k"),
    ({"input_ids": [1], "sampling_params": {"temprature": 0.5}}, "unknown sampling"),
    ({"input_ids": [1], "stream": "yes"}, "stream"),
    ({"input_ids": [[1], [2]], "rid": ["a"]}, "rid has 1 entries for 2 prompts"),
]


@pytest.mark.parametrize("body,message", BAD_GENERATE, ids=[m for _, m in BAD_GENERATE])
def test_bad_generate_is_400(server, body, message):
    if isinstance(body, str):
        r = httpx.post(f"{server.url}/generate", content=body, timeout=30)
    else:
        r = post(server, "/generate", body)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]


def test_bad_openai_requests(server):
    r = post(server, "/v1/completions", {"model": "no-such-model", "prompt": [1]})
    assert r.status_code == 404 and "no-such-model" in r.json()["error"]["message"]
    name = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    r = post(server, "/v1/completions", {"prompt": [1], "max_tokens": 1})  # no model: the served
    assert r.status_code == 200 and r.json()["model"] == name, r.text
    r = post(server, "/v1/chat/completions", {"model": 7, "messages": []})  # not a name
    assert r.status_code == 400 and "model" in r.json()["error"]["message"], r.text
    after = wait_idle(server)
    assert (after["num_inflight_requests"], after["kv_tokens_used"]) == (0, 0)
    r = post(server, "/v1/chat/completions", {"model": name, "messages": [{"role": "user"}]})
    assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]
    r = post(server, "/v1/completions", {"model": name, "prompt": [1], "temperature": -1})
    assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]
    r = post(server, "/v1/completions", {"model": name, "prompt": [1], "max_tokens": "many"})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    r = post(server, "/v1/completions", {"model": name, "prompt": [[1], [2, -1]]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == "prompt[1][1]: token id -1 is out of range [0, 256)"


@pytest.mark.parametrize(
    "fields,message,param",
    [
        ({"max_tokens": -1}, "max_tokens must be in [0, ", None),
        ({"max_tokens": CONTEXT_LEN}, f"+ max_tokens ({CONTEXT_LEN}) = ", None),
        (
            {"max_tokens": 4, "min_tokens": 5},
            "min_tokens (5) is above max_tokens (4)",
            "min_tokens",
        ),
        ({"min_tokens": -1}, "min_tokens must be an integer in [0, ", None),
    ],
)
def test_openai_errors_name_the_fields_the_request_used(server, fields, message, param):
    """The validation /generate shares names OpenAI's fields on the OpenAI routes: the
    request sent max_tokens, not SGLang's max_new_tokens."""
    r = post(server, "/v1/completions", {"model": "default", "prompt": [1, 2], **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"] and "_new_tokens" not in error["message"], error
    assert error["param"] == param
    after = wait_idle(server)
    assert (after["num_inflight_requests"], after["kv_tokens_used"]) == (0, 0)


def test_min_tokens_holds_the_stop_token_back(server):
    """OpenAI's min_tokens (SGLang's and vLLM's extra field) is min_new_tokens: a stop token
    the logit bias makes certain comes first without it, and sixth with a minimum of 5."""
    body = {"model": "default", "prompt": [1, 2], "max_tokens": 8, "stop_token_ids": [9],
            "logit_bias": {"9": 100}, "temperature": 0}  # fmt: skip
    for min_tokens, n in ((None, 1), (5, 6)):
        r = post(server, "/v1/completions", {**body, "min_tokens": min_tokens})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["usage"]["completion_tokens"] == n
        assert out["choices"][0]["finish_reason"] == "stop"


def test_still_serving_after_bad_input(server):
    for body, _ in BAD_GENERATE:
        if not isinstance(body, str):
            post(server, "/generate", body)
    r = post(server, "/generate", {"input_ids": [1, 2], "sampling_params": GREEDY})
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 6
    assert wait_idle(server)["kv_tokens_used"] == 0


# ---- aborts, disconnects, load ----
def abort_count(srv: ServerProcess) -> float:
    text = httpx.get(f"{srv.url}/metrics").text
    m = re.search(r'^breakgraph_requests_total\{reason="abort"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_disconnect_mid_stream_frees_kv(server):
    baseline = wait_idle(server)["kv_tokens_used"]
    aborts = abort_count(server)
    long = {"max_new_tokens": CONTEXT_LEN - 100, "ignore_eos": True, "temperature": 0}
    body = {"input_ids": list(range(1, 60)), "sampling_params": long, "stream": True}
    with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = 0
        for line in lines:
            got += line.startswith("data: ")
            if got == 3:
                break
        during = info(server)
        assert during["num_running_reqs"] == 1
        assert during["kv_tokens_used"] > baseline
    # the connection is closed mid-stream here
    after = wait_idle(server)
    assert after["num_running_reqs"] == 0
    assert after["kv_tokens_used"] == baseline
    assert abort_count(server) == aborts + 1


def test_a_body_cut_short_leaks_nothing_and_logs_no_error(server):
    """The generation routes are served without FastAPI's stack (server/asgi.py): a client
    gone in the middle of sending its body is dropped quietly there too, with nothing
    admitted; a stream it reads to its end and a later request are unaffected."""
    before = server.log().count("Traceback")
    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            head = f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            sock.sendall(head.encode() + b"Content-Length: 1000\r\n\r\n" + b'{"input_ids": [1, 2')
    body = {"input_ids": [3, 1, 4], "sampling_params": GREEDY, "stream": True}
    with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=60) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "data: [DONE]"
    assert len(json.loads(events[-2][len("data: ") :])["output_ids"]) == 6  # events coalesce
    after = wait_idle(server)
    assert (after["num_running_reqs"], after["kv_tokens_used"]) == (0, 0)
    assert after["num_inflight_requests"] == 0
    assert server.log().count("Traceback") == before, server.log()


def test_disconnect_while_waiting_for_a_whole_answer(server):
    aborts = abort_count(server)
    long = {"max_new_tokens": CONTEXT_LEN - 100, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        post(server, "/generate", {"input_ids": [2, 4, 6], "sampling_params": long}, timeout=1.0)
    after = wait_idle(server)
    assert (after["kv_tokens_used"], after["num_running_reqs"]) == (0, 0)
    assert abort_count(server) == aborts + 1


def test_abort_request_endpoint(server):
    long = {"max_new_tokens": CONTEXT_LEN - 100, "ignore_eos": True}
    body = {"input_ids": [7, 7, 7], "sampling_params": long, "stream": True, "rid": "abort-me"}
    with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        dup = post(server, "/generate", {**body, "stream": False})
        assert dup.status_code == 400 and "already in use" in dup.json()["error"]["message"]
        assert post(server, "/abort_request", {"rid": "abort-me"}).json()["success"]
        events = sse_events(lines)
    assert events[-1] == "[DONE]"
    assert events[-2]["meta_info"]["finish_reason"]["type"] == "abort"
    assert wait_idle(server)["kv_tokens_used"] == 0


def test_abort_by_the_rid_of_an_n_request_aborts_its_samples(server):
    long = {"max_new_tokens": CONTEXT_LEN - 100, "ignore_eos": True, "n": 3}
    body = {"input_ids": [7, 8, 9], "sampling_params": long, "stream": True, "rid": "grp"}
    with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        one = post(server, "/abort_request", {"rid": "grp-1"}).json()
        assert one == {"success": True, "aborted": 1}  # one sample by its own rid
        rest = post(server, "/abort_request", {"rid": "grp"}).json()
        assert rest == {"success": True, "aborted": 2}  # grp-1's abort is not asked again
        events = sse_events(lines)
    assert events[-1] == "[DONE]"
    finished = {e["index"]: e["meta_info"]["finish_reason"]["type"]
                for e in events[:-1] if e["meta_info"].get("finish_reason")}  # fmt: skip
    assert finished == {0: "abort", 1: "abort", 2: "abort"}
    assert wait_idle(server)["kv_tokens_used"] == 0
    assert post(server, "/abort_request", {"rid": "grp"}).json() == {"success": False, "aborted": 0}


def test_200_concurrent_streams(server):
    n, new_tokens = 200, 8
    assert info(server)["max_running_requests"] >= n

    async def one(client: httpx.AsyncClient, i: int) -> list:
        body = {
            "input_ids": [i % 250 + 1, (i * 7) % 250 + 1, 3],
            "sampling_params": {"max_new_tokens": new_tokens, "ignore_eos": True},
            "stream": True,
        }
        async with client.stream("POST", f"{server.url}/generate", json=body) as r:
            assert r.status_code == 200
            return sse_events([line async for line in r.aiter_lines()])

    async def main() -> list:
        limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=n + 10)
        async with httpx.AsyncClient(limits=limits, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(n)))

    results = asyncio.run(main())
    assert len(results) == n
    for events in results:
        assert events[-1] == "[DONE]"
        assert events[-2]["meta_info"]["completion_tokens"] == new_tokens
        assert len(events[-2]["output_ids"]) == new_tokens
    assert len({events[-2]["meta_info"]["id"] for events in results}) == n
    after = wait_idle(server)
    assert (after["kv_tokens_used"], after["num_running_reqs"]) == (0, 0)


# ---- health, info, metrics ----
def test_health_info_and_cache(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/health_generate", timeout=60).status_code == 200
    model = httpx.get(f"{server.url}/get_model_info").json()
    assert (model["vocab_size"], model["context_length"]) == (256, CONTEXT_LEN)
    assert model["is_generation"] is True
    models = httpx.get(f"{server.url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [model["served_model_name"]]
    wait_idle(server)
    assert post(server, "/flush_cache", None).status_code == 200
    assert info(server)["kv_tokens_cached"] == 0


def test_flush_cache_refused_during_traffic_in_the_one_error_shape(server):
    """A flush while a request runs is refused: 409 with the JSON error every route answers
    (not SGLang's {"success": false}); idle, it flushes (POST, or GET as SGLang's docs do)."""
    long = {"max_new_tokens": CONTEXT_LEN - 100, "ignore_eos": True, "temperature": 0}
    body = {"input_ids": [9, 8, 7], "sampling_params": long, "stream": True}
    with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=60) as r:
        lines = r.iter_lines()  # held: a dropped iterator closes the stream
        assert next(lines).startswith("data: ")
        refused = post(server, "/flush_cache", None)
    assert refused.status_code == 409, refused.text
    error = refused.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == 409
    assert "not flushed" in error["message"] and "in flight" in error["message"]
    wait_idle(server)
    for method in ("POST", "GET"):
        r = httpx.request(method, f"{server.url}/flush_cache", timeout=30)
        assert r.status_code == 200 and r.json()["success"] is True
    assert info(server)["kv_tokens_cached"] == 0


def test_profile_start_and_stop_write_a_chrome_trace(server, tmp_path):
    """SGLang's /start_profile and /stop_profile: the engine's torch profiler between two
    steps, its trace written where the start said; a second start or a stop with none is a
    409, an option it does not take a 400."""
    out = tmp_path / "profiles"
    started = post(server, "/start_profile", {"output_dir": str(out)})
    assert started.status_code == 200 and started.json()["output_dir"] == str(out)
    again = post(server, "/start_profile", None)
    assert again.status_code == 409 and "already running" in again.json()["error"]["message"]
    greedy = {"max_new_tokens": 4, "temperature": 0}
    assert post(server, "/generate", {"input_ids": [5, 6, 7], "sampling_params": greedy}).is_success
    stopped = post(server, "/stop_profile", None)
    assert stopped.status_code == 200, stopped.text
    trace = Path(stopped.json()["trace"])
    assert trace.parent == out and trace.name.endswith(".trace.json.gz")
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    assert any(str(e.get("name", "")).startswith("aten::") for e in events)  # the steps' ops
    none = post(server, "/stop_profile", None)
    assert none.status_code == 409 and "no profile is running" in none.json()["error"]["message"]
    assert httpx.get(f"{server.url}/start_profile", timeout=30).status_code == 405  # POST only
    bad = post(server, "/start_profile", {"num_steps": 3})
    assert bad.status_code == 400 and "output_dir" in bad.json()["error"]["message"]


def test_profile_routes_refuse_bad_input_and_leak_nothing(server):
    """Each bad body is a 400 naming the problem, with no profile left running (a stop after
    them is a 409) and nothing in flight or holding KV."""
    for body, words in (
        ([1, 2], "output_dir"),
        ({"output_dir": 3}, "output_dir must be"),
        ({"output_dir": ""}, "output_dir must be"),
        ({"output_dir": "/tmp/x", "with_stack": True}, "output_dir"),
    ):
        r = post(server, "/start_profile", body)
        assert r.status_code == 400 and words in r.json()["error"]["message"], (body, r.text)
    malformed = httpx.post(f"{server.url}/start_profile", content=b"{", timeout=30)
    assert malformed.status_code == 400 and "malformed JSON" in malformed.json()["error"]["message"]
    assert post(server, "/stop_profile", None).status_code == 409  # none was started
    state = wait_idle(server)
    assert state["num_inflight_requests"] == 0 and state["kv_tokens_used"] == 0
    assert (state["num_running_reqs"], state["num_queued_reqs"]) == (0, 0)


def test_version(server):
    """SGLang's /version: the installed package's version, as /get_server_info reports it."""
    r = httpx.get(f"{server.url}/version")
    assert r.status_code == 200
    assert r.json() == {"version": importlib.metadata.version("breakgraph")}
    assert info(server)["version"] == r.json()["version"]


def test_server_info_reports_where_the_memory_went(server):
    """/get_server_info's ``memory``: the weights, the KV pool (its bytes are its tokens'
    and the padding slot's), the penalty pool; no graph pools and no device totals on the
    CPU."""
    i = info(server)
    mem = i["memory"]
    assert mem["kv_tokens"] == i["max_total_num_tokens"]
    assert mem["weights_bytes"] > 0 and mem["penalty_pool_bytes"] > 0
    per_token = mem["kv_bytes"] / (mem["kv_tokens"] + 1)
    assert per_token == int(per_token) > 0
    assert mem["graph_pool_bytes"] == {} and mem["free_bytes"] == mem["total_bytes"] == 0
    # the plan's reserve: nothing measured on the CPU; the request table is the rank's
    assert mem["activation_reserve_bytes"] == mem["graph_pool_estimate_bytes"] == 0
    table = (i["max_running_requests"] + 1) * i["context_length"] * 4  # + the padding row
    assert mem["request_table_bytes"] == table


def test_both_processes_freeze_startup_objects_out_of_gc(server):
    """Ready: each process froze its start-up objects (a full collection no longer walks
    torch's and the model's); the engine's collections since are in /metrics."""
    i = info(server)
    assert i["gc_frozen_objects"] > 10_000 and i["api_gc_frozen_objects"] > 10_000
    for p in ("gc_", "api_gc_"):
        assert i[f"{p}collections_after_ready"] >= 0
        assert 0 <= i[f"{p}max_pause_seconds_after_ready"] <= i[f"{p}pause_seconds_after_ready"]
    values = metric_values(server.url)
    for name in ("collections", "pause_seconds", "max_pause_seconds"):
        assert values[f"breakgraph_engine_gc_{name}_after_ready"] >= 0


def test_metrics_text_format(server):
    post(server, "/generate", {"input_ids": [1, 2, 3], "sampling_params": GREEDY})
    text = httpx.get(f"{server.url}/metrics").text
    sample = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? \S+$')
    values: dict[str, float] = {}
    for line in text.strip().splitlines():
        if line.startswith("# "):
            assert re.match(r"^# (HELP|TYPE) breakgraph_\w+ ", line), line
            continue
        assert sample.match(line), line
        name, value = line.rsplit(" ", 1)
        values[name] = float(value)
    assert values["breakgraph_kv_slots_total"] == 16384
    assert values["breakgraph_generation_tokens_total"] >= 6
    for hist in ("time_to_first_token", "inter_token_latency", "step_time"):
        name = f"breakgraph_{hist}_seconds"
        buckets = [v for k, v in values.items() if k.startswith(f"{name}_bucket")]
        assert buckets == sorted(buckets) and buckets[-1] == values[f"{name}_count"] > 0


# every histogram of the request timeline and the step times, fed once per request or step
TIMELINE_HISTOGRAMS = (
    "request_api_seconds", "request_ipc_seconds", "request_queue_seconds",
    "request_scheduling_seconds", "forward_host_seconds", "time_to_first_token_seconds",
    "inter_token_latency_seconds", "e2e_request_latency_seconds", "step_time_seconds",
)  # fmt: skip
OLD_METRICS = (
    "prompt_tokens_total", "generation_tokens_total", "cached_tokens_total",
    'requests_total{reason="length"}', "num_requests_running", "num_requests_waiting",
    "kv_slots_used", "kv_slots_cached", "kv_slots_total", "kernel_compilations_after_ready",
    "kernel_compilations_total", "num_requests_penalized", "num_requests_penalized_max",
)  # fmt: skip


def test_metrics_timeline_histograms_move(server):
    """The old names stay; each timeline histogram counts the requests (or steps) served."""
    before = metric_values(server.url)
    for name in OLD_METRICS:
        assert f"breakgraph_{name}" in before, name
    n = 3
    for i in range(n):
        body = {"input_ids": [1, 2, 3 + i], "sampling_params": GREEDY}
        assert post(server, "/generate", body).status_code == 200
    after = metric_values(server.url)
    count = {h: after[f"breakgraph_{h}_count"] - before.get(f"breakgraph_{h}_count", 0)
             for h in TIMELINE_HISTOGRAMS}  # fmt: skip
    for h in ("request_api_seconds", "request_ipc_seconds", "request_queue_seconds",
              "request_scheduling_seconds", "time_to_first_token_seconds",
              "e2e_request_latency_seconds"):  # fmt: skip
        assert count[h] == n, h  # one per request
    assert count["inter_token_latency_seconds"] == n * 5  # GREEDY: 6 tokens each
    assert count["forward_host_seconds"] >= n * 6 and count["step_time_seconds"] >= n * 6
    for h in TIMELINE_HISTOGRAMS:
        assert after[f"breakgraph_{h}_sum"] >= 0
    assert after["breakgraph_step_host_seconds"] > 0
    # the earlier stages end before the first token
    ttft = after["breakgraph_time_to_first_token_seconds_sum"]
    stages = sum(after[f"breakgraph_request_{s}_seconds_sum"]
                 for s in ("api", "ipc", "queue", "scheduling"))  # fmt: skip
    assert stages <= ttft + 1e-3 * n


def test_forward_steps_are_counted_by_graph_and_eager_reason(server):
    """Each forward step counts under the bank it replayed, an eager one under why: on the
    CPU every step is eager (no CUDA graphs), a prompt's under "no prefill graphs" and the
    decode steps under "no decode graphs"; /metrics and /get_server_info agree."""
    before = info(server)["forward_steps"]
    body = {"input_ids": [1, 2, 9], "sampling_params": GREEDY}  # 6 tokens: 1 prefill, 5 decode
    assert post(server, "/generate", body).status_code == 200
    after = info(server)["forward_steps"]
    grew = {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}
    assert grew == {"eager (no prefill graphs)": 1, "eager (no decode graphs)": 5}, grew
    values = metric_values(server.url)
    for graph, n in after.items():
        reason = graph.removeprefix("eager (").removesuffix(")")
        name = f'breakgraph_forward_steps_total{{graph="eager",reason="{reason}"}}'
        assert values[name] >= n  # a scrape after the call: as many or more


def test_return_timeline_adds_up_to_e2e(server):
    """Each stage is non-negative and together they are the end-to-end latency reported."""
    for stream in (False, True):
        body = {"input_ids": [5, 6, 7], "sampling_params": GREEDY, "return_timeline": True,
                "stream": stream}  # fmt: skip
        r = post(server, "/generate", body)
        assert r.status_code == 200
        if stream:
            chunks = sse_events(r.text.splitlines())
            assert chunks[-1] == "[DONE]"
            meta = chunks[-2]["meta_info"]
        else:
            meta = r.json()["meta_info"]
        timeline = meta["timeline"]
        assert list(timeline) == [
            "validate", "send", "ipc", "queue", "schedule", "forward", "sample", "return",
            "decode", "respond",
        ]  # fmt: skip
        assert all(v >= 0 for v in timeline.values()), timeline
        assert abs(sum(timeline.values()) - meta["e2e_latency"]) < 2e-3, (timeline, meta)
    plain = post(server, "/generate", {"input_ids": [5, 6, 7], "sampling_params": GREEDY})
    assert "timeline" not in plain.json()["meta_info"]


def test_api_process_never_loads_torch(server):
    """torch lives in the engine process only: the API process stays small and starts fast."""
    name = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    body = {"model": name, "prompt": [1, 2, 3], "max_tokens": 2}
    assert post(server, "/v1/completions", body).status_code == 200
    assert post(server, "/generate", {"input_ids": [1, 2], "sampling_params": GREEDY}).is_success
    assert torch_loaded(server.engine_pid())
    assert not torch_loaded(server.proc.pid)


# ---- the engine loop, without HTTP ----
@pytest.mark.parametrize("overlap", [False, True])
def test_engine_loop_rejects_bad_requests_and_sends_one_message_per_step(tiny_model_dir, overlap):
    """The engine-side check is a backstop: an invalid request comes back as a per-request
    error and the loop goes on; each step's outputs travel in one message (with overlap
    scheduling, a step's tokens travel with the next step's message)."""
    engine = Engine(EngineArgs(model_path=str(tiny_model_dir), overlap_schedule=overlap))
    engine_end, api_end = socket.socketpair()
    api = FramedSocket(api_end)

    def receive(timeout_s: float) -> list:
        select.select([api.sock], [], [], timeout_s)
        return [decode(data) for data in api.read()]

    try:
        sampling = SamplingParams(max_new_tokens=3, ignore_eos=True)
        for rid, ids in [("bad", [1, 999]), ("a", [1, 2]), ("b", [3, 4, 5])]:
            api.send(encode(GenerateReq(rid, ids, sampling)))
        api.send(encode(StatsReq(call_id=7)))
        loop = threading.Thread(target=EngineLoop(engine, EngineSocket(engine_end)).run)
        loop.start()
        messages, finished, deadline = [], set(), time.monotonic() + 30
        while len(finished) < 2 and time.monotonic() < deadline:
            for msg in receive(1.0):
                messages.append(msg)
                if isinstance(msg, StepResult):
                    finished |= {o.rid for o in msg.outputs if o.finished}
        api.send(encode(Shutdown()))
        loop.join(10)
        assert not loop.is_alive()
        messages += receive(0.5)  # what came after the last step's outputs
        steps = [m for m in messages if isinstance(m, StepResult)]
        assert steps[0].errors == [RequestError("bad", "token id 999 is out of range [0, 256)")]
        assert len(steps) == 3 + overlap and all(m.step_ms > 0 for m in steps)
        launched = steps[:3]  # with overlap the last step only reads the third one back
        assert all(0 < m.forward_ms <= m.step_ms and m.gpu_ms is None for m in launched)  # CPU
        for m in steps[overlap:]:  # a and b share every step: one message carries both tokens
            tokens = [(o.rid, len(o.token_ids)) for o in m.outputs]
            tokens += [(rid, 1) for rid, _ in m.plain_tokens()]
            assert sorted(tokens) == [("a", 1), ("b", 1)]
        # the first token (its timeline) and the last (finished) travel as deltas, the one
        # between as a plain token
        assert [sorted(rid for rid, _ in m.plain_tokens()) for m in steps[overlap:]] == [
            [],
            ["a", "b"],
            [],
        ]
        # the stats call is answered after the step of the turn that read it
        reply = next(m for m in messages if isinstance(m, StatsReply) and m.call_id == 7)
        assert reply.stats["num_queued_reqs"] + reply.stats["num_running_reqs"] == 2
        assert engine.stats()["kv_tokens_used"] == 0
        # stats published unasked: as the loop starts, before its first step (the two
        # requests queued), and as it goes idle (their KV released)
        published = [m.stats for m in messages if isinstance(m, StatsReply) and m.call_id == -1]
        assert published[0]["num_queued_reqs"] == 0
        assert max(p["num_queued_reqs"] for p in published) == 2
        idle = {k: published[-1][k] for k in ("num_running_reqs", "num_queued_reqs")}
        assert idle == {"num_running_reqs": 0, "num_queued_reqs": 0}
        assert published[-1]["kv_tokens_used"] == 0
    finally:
        engine_end.close()
        api_end.close()


def test_an_abort_going_idle_publishes_its_kv_released(tiny_model_dir, monkeypatch):
    """A request aborted mid-decode: a stats call read with the abort, and the snapshot the
    loop publishes as it goes idle (what /get_server_info falls back on), show no request
    running and no KV held; so does every published snapshot with nothing running or
    queued, a snapshot every turn included."""
    monkeypatch.setattr(engine_process, "STATS_INTERVAL_S", 0.0)
    engine = Engine(EngineArgs(model_path=str(tiny_model_dir)))
    engine_end, api_end = socket.socketpair()
    api = FramedSocket(api_end)
    loop = threading.Thread(target=EngineLoop(engine, EngineSocket(engine_end)).run)
    messages: list = []

    def receive_until(done, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not done() and time.monotonic() < deadline:
            select.select([api.sock], [], [], 0.5)
            messages.extend(decode(data) for data in api.read())

    try:
        sp = SamplingParams(max_new_tokens=200, temperature=0.0, ignore_eos=True)
        api.send(encode(GenerateReq("r", list(range(1, 40)), sp)))
        loop.start()
        steps = lambda: [m for m in messages if isinstance(m, StepResult)]  # noqa: E731
        receive_until(lambda: sum(len(m.plain_tokens()) for m in steps()) >= 3)
        api.send(encode(AbortReq("r")))
        api.send(encode(StatsReq(call_id=3)))  # most often read with the abort
        receive_until(lambda: any(o.finished for m in steps() for o in m.outputs))
        receive_until(lambda: any(isinstance(m, StatsReply) and m.call_id == 3 for m in messages))
        api.send(encode(Shutdown()))
        loop.join(10)
        assert not loop.is_alive()
        receive_until(lambda: False, 0.5)  # what came after the abort's message
        (answer,) = [m.stats for m in messages if isinstance(m, StatsReply) and m.call_id == 3]
        assert (answer["num_running_reqs"], answer["kv_tokens_used"]) == (0, 0), answer
        published = [m.stats for m in messages if isinstance(m, StatsReply) and m.call_id == -1]
        last = published[-1]
        assert (last["num_running_reqs"], last["kv_tokens_used"]) == (0, 0), last
        for stats in published:
            if stats["num_running_reqs"] == 0 and stats["num_queued_reqs"] == 0:
                assert stats["kv_tokens_used"] == 0, published
        finished = [o.rid for m in steps() for o in m.outputs if o.finished]
        assert finished == ["r"]
        assert engine.stats()["kv_tokens_used"] == 0
    finally:
        engine_end.close()
        api_end.close()


def test_plain_tokens_keep_each_requests_order(tiny_model_dir):
    """A request whose delta is already in the message sends its later tokens as deltas
    too, and the API routes the plain tokens first: each request's queue gets its outputs in
    the engine's order, with the counts of its latest delta carried onto plain tokens."""
    from breakgraph.common.messages import TokenDelta
    from breakgraph.server.inflight import InFlight, InFlightRequests
    from breakgraph.server.metrics import ServerMetrics

    engine = Engine(EngineArgs(model_path=str(tiny_model_dir)))
    engine_end, api_end = socket.socketpair()
    try:
        loop = EngineLoop(engine, EngineSocket(engine_end))
        counts = dict(prompt_tokens=7, cached_tokens=3)
        loop._add_outputs([
            TokenDelta("a", [1], timeline={"first_token": 1.0}, completion_tokens=1, **counts),
            TokenDelta("b", [5], completion_tokens=4, **counts),  # plain
        ])  # fmt: skip
        # the same message, later: "a" has a delta in it already; its finish follows
        loop._add_outputs([
            TokenDelta("a", [2], completion_tokens=2, **counts),
            TokenDelta("b", [6], completion_tokens=5, **counts),
            TokenDelta("b", [7], finished=True, finish_reason={"type": "length"},
                       completion_tokens=6, **counts),
        ])  # fmt: skip
        msg = decode(encode(StepResult(1.0, loop._outputs, [], token_rids=loop._token_rids,
                                       token_ids=loop._token_ids)))  # fmt: skip
        assert msg.plain_tokens() == [("b", 5), ("b", 6)]
        assert [(o.rid, o.token_ids) for o in msg.outputs] == [("a", [1]), ("a", [2]), ("b", [7])]

        async def route() -> dict[str, list]:
            requests = InFlightRequests(ServerMetrics())
            for rid in ("a", "b"):
                requests.add(rid, InFlight(asyncio.Queue(), 0.0, 0.0, 0.0))
            queues = {rid: requests.get(rid).queue for rid in requests.rids()}
            requests.get("b").counted(msg.outputs[2])  # counts as of b's first delta
            requests.route(msg)
            await asyncio.sleep(0)
            return {rid: [q.get_nowait() for _ in range(q.qsize())] for rid, q in queues.items()}

        got = asyncio.run(route())
        assert [o.token_ids for o in got["a"]] == [[1], [2]]
        assert [(o.token_ids, o.finished) for o in got["b"]] == [([5], False), ([6], False),
                                                                  ([7], True)]  # fmt: skip
        assert [(o.prompt_tokens, o.cached_tokens) for o in got["b"]] == [(7, 3)] * 3
    finally:
        engine_end.close()
        api_end.close()


def test_engine_loop_exits_when_the_api_end_closes(tiny_model_dir):
    """The API process gone (its end of the socket closed, as at its death): the engine
    loop stops within its idle wait, without a shutdown message."""
    engine = Engine(EngineArgs(model_path=str(tiny_model_dir)))
    engine_end, api_end = socket.socketpair()
    loop = threading.Thread(target=EngineLoop(engine, EngineSocket(engine_end)).run)
    try:
        loop.start()
        FramedSocket(api_end).send(encode(StatsReq(call_id=1)))
        api_end.close()
        loop.join(5)
        assert not loop.is_alive()
    finally:
        engine_end.close()


def test_idle_spin_polls_after_work_then_sleeps(tiny_model_dir):
    """--idle-spin-ms: the engine loop polls its socket (no sleep) for the spin right after
    it worked, and waits in plain poll otherwise; input arriving during the spin is read."""
    engine = Engine(EngineArgs(model_path=str(tiny_model_dir)))
    engine_end, api_end = socket.socketpair()
    sock = EngineSocket(engine_end)
    spins: list[float] = []
    real_wait = sock.wait

    def wait(timeout_s, spin_s=0.0):
        spins.append(spin_s)
        return real_wait(timeout_s, spin_s)

    sock.wait = wait
    loop = EngineLoop(engine, sock, idle_spin_s=0.05)
    thread = threading.Thread(target=loop.run)
    api = FramedSocket(api_end)
    try:
        thread.start()
        time.sleep(0.05)  # the first wait: nothing happened yet, no spin
        api.send(encode(StatsReq(call_id=1)))
        deadline = time.monotonic() + 5
        replies = []
        while not replies and time.monotonic() < deadline:
            replies = api.read()
            time.sleep(0.005)
        assert replies
        # the wait after the work spins first; the one after its timeout (an idle second)
        # sleeps from the start
        while len(spins) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert spins[:3] == [0.0, 0.05, 0.0], spins
    finally:
        api_end.close()
        thread.join(5)
        engine_end.close()
    assert not thread.is_alive()


def test_socket_wait_spins_then_sleeps():
    """EngineSocket.wait: input during the spin returns at once; none returns False at the
    timeout, the spin capped by it."""
    a, b = socket.socketpair()
    try:
        sock, peer = EngineSocket(a), FramedSocket(b)
        timer = threading.Timer(0.02, peer.send, args=(b"hello",))
        timer.start()
        t0 = time.monotonic()
        assert sock.wait(5.0, spin_s=1.0) and time.monotonic() - t0 < 0.5
        assert sock.read() == [b"hello"]
        t0 = time.monotonic()
        assert not sock.wait(0.05, spin_s=10.0)  # the spin never outlasts the timeout
        assert 0.04 < time.monotonic() - t0 < 1.0
    finally:
        a.close()
        b.close()


def test_frames_cross_the_socket_whole_in_any_pieces():
    """Length-prefixed frames: many small ones, an empty one and one larger than the
    socket's buffer (the sender keeps what the socket did not take and sends it later)
    arrive whole and in order, however the reads split them."""
    a, b = socket.socketpair()
    sender, receiver = FramedSocket(a), FramedSocket(b)
    big = bytes(range(256)) * 40_000  # 10 MB
    sent = [b"x" * n for n in range(50)] + [b"", big, b"last"]
    for data in sent:
        sender.send(data)
    assert sender.pending > 0  # the big frame did not fit in the socket at once
    got = []
    while len(got) < len(sent):
        got += receiver.read()
        sender.write_some()
    assert got == sent and sender.pending == 0
    a.close()
    assert receiver.read() == [] and receiver.closed
    with pytest.raises(ConnectionError):
        receiver.send(b"after the close")
    b.close()


# ---- lifecycle ----
def test_sigterm_stops_both_processes(tiny_model_dir, tmp_path):
    srv = start_tiny(tiny_model_dir, tmp_path / "sigterm.log")
    engine = srv.engine_pid()
    assert pid_alive(engine)
    assert srv.stop(signal.SIGTERM) == 0, srv.log()
    assert not pid_alive(engine)


def test_ctrl_c_to_process_group_stops_both(tiny_model_dir, tmp_path):
    srv = start_tiny(tiny_model_dir, tmp_path / "sigint.log", new_session=True)
    engine = srv.engine_pid()
    os.killpg(srv.proc.pid, signal.SIGINT)  # what a terminal does on Ctrl-C
    assert srv.proc.wait(30) == 0, srv.log()
    srv.stop()
    deadline = time.monotonic() + 10
    while pid_alive(engine) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(engine)


def test_engine_death_stops_the_server(tiny_model_dir, tmp_path):
    srv = start_tiny(tiny_model_dir, tmp_path / "death.log")
    os.kill(srv.engine_pid(), signal.SIGKILL)
    assert srv.proc.wait(30) == 1
    srv.stop()
    assert "engine process died" in srv.log()
