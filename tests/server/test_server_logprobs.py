"""The API evaluation tools call, through the server: prompt and top logprobs (SGLang's
/generate shapes, OpenAI's echo + logprobs with max_tokens 0 through the openai client),
penalties and logit_bias, n choices; nothing leaks."""

from __future__ import annotations

import openai
import pytest
import torch

from tests.support.hf import make_hf_model
from tests.support.server import info, post, wait_idle

# server: the tiny token-id server of tests/server/conftest.py

ATOL = 2e-4
GREEDY = {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def ref():
    hf = make_hf_model("llama")

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)

    return logprobs


def test_generate_prompt_and_top_logprobs(server, ref):
    prompt = [5, 17, 99, 3, 42, 7, 8, 120]
    lps = ref(prompt)
    body = {"input_ids": prompt, "sampling_params": GREEDY, "return_logprob": True,
            "logprob_start_len": 0, "top_logprobs_num": 3}  # fmt: skip
    for start in (0, 0, 4):  # the second run has a cached prefix it must not use
        r = post(server, "/generate", {**body, "logprob_start_len": start})
        assert r.status_code == 200, r.text
        meta = r.json()["meta_info"]
        inp = meta["input_token_logprobs"]
        assert [t for _, t, _ in inp] == prompt[start:]
        if start == 0:
            assert inp[0] == [None, prompt[0], None] and meta["input_top_logprobs"][0] is None
        for pos, (lp, tok, text) in zip(range(start, len(prompt)), inp, strict=True):
            if pos:
                assert lp == pytest.approx(lps[pos - 1, tok].item(), abs=ATOL)
                values, ids = lps[pos - 1].topk(3)
                top = meta["input_top_logprobs"][pos - start]
                assert [t for _, t, _ in top] == ids.tolist() and text is None
                assert [v for v, _, _ in top] == pytest.approx(values.tolist(), abs=ATOL)
        out = meta["output_token_logprobs"]
        assert [t for _, t, _ in out] == r.json()["output_ids"]
        values, ids = lps[-1].topk(3)
        first_top = meta["output_top_logprobs"][0]
        assert [t for _, t, _ in first_top] == ids.tolist()
        assert out[0][0] == pytest.approx(values[0].item(), abs=ATOL)
        assert len(meta["output_top_logprobs"]) == 3
    assert wait_idle(server)["kv_tokens_used"] == 0


def test_generate_logprob_args_are_400(server):
    base = {"input_ids": [1, 2, 3], "sampling_params": GREEDY, "return_logprob": True}
    for extra, word in [
        ({"logprob_start_len": 3}, "logprob_start_len"),
        ({"logprob_start_len": -2}, "logprob_start_len"),
        ({"top_logprobs_num": 21}, "top_logprobs_num"),
        ({"top_logprobs_num": "x"}, "top_logprobs_num"),
    ]:
        r = post(server, "/generate", {**base, **extra})
        assert r.status_code == 400 and word in r.json()["error"]["message"], r.text
    for sp, word in [
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"presence_penalty": "a"}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_new_tokens": -1}, "min_new_tokens"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"1": 101}}, "logit_bias"),
        ({"logit_bias": {"100000": 1}}, "out of range"),
        ({"logit_bias": [1]}, "logit_bias"),
    ]:
        r = post(server, "/generate", {"input_ids": [1, 2], "sampling_params": {**GREEDY, **sp}})
        assert r.status_code == 400 and word in r.json()["error"]["message"], r.text
    state = wait_idle(server)
    assert state["num_inflight_requests"] == 0 and state["kv_tokens_used"] == 0


def test_echo_with_max_tokens_zero_through_the_openai_client(server, ref):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    prompt = [9, 8, 7, 6, 5, 4]
    lps = ref(prompt)
    out = client.completions.create(
        model="default", prompt=prompt, echo=True, logprobs=2, max_tokens=0, temperature=0
    )
    (choice,) = out.choices
    lp = choice.logprobs
    assert lp.tokens == [f"token_id:{t}" for t in prompt]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for pos in range(1, len(prompt)):
        assert lp.token_logprobs[pos] == pytest.approx(lps[pos - 1, prompt[pos]].item(), abs=ATOL)
        values, ids = lps[pos - 1].topk(2)
        top = lp.top_logprobs[pos]
        assert list(top) == [f"token_id:{t}" for t in ids.tolist()]
        assert list(top.values()) == pytest.approx(values.tolist(), abs=ATOL)
    assert out.usage.completion_tokens == 0 and choice.finish_reason == "length"
    # max_tokens 1: the prompt's entries, then the generated token's
    out = client.completions.create(
        model="default", prompt=prompt, echo=True, logprobs=1, max_tokens=1, temperature=0
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(prompt) + 1
    assert lp.token_logprobs[-1] == pytest.approx(lps[-1].max().item(), abs=ATOL)
    assert wait_idle(server)["kv_tokens_used"] == 0


def test_n_choices_and_sampling_fields_on_completions(server):
    body = {"model": "default", "prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True,
            "n": 3, "temperature": 1.0, "seed": 11, "frequency_penalty": 0.5,
            "presence_penalty": 0.5, "repetition_penalty": 1.2, "logit_bias": {"7": 2.0},
            "logprobs": 2}  # fmt: skip
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert all(len(c["logprobs"]["top_logprobs"]) == 4 for c in out["choices"])
    again = post(server, "/v1/completions", body).json()
    tokens = [c["logprobs"]["tokens"] for c in out["choices"]]
    assert [c["logprobs"]["tokens"] for c in again["choices"]] == tokens  # seeded
    forced = post(server, "/v1/completions", {**body, "logit_bias": {"7": 100}}).json()
    assert all(c["logprobs"]["tokens"] == ["token_id:7"] * 4 for c in forced["choices"])
    bad = post(server, "/v1/completions", {**body, "logprobs": 21})
    assert bad.status_code == 400 and "logprobs" in bad.json()["error"]["message"]
    stats = wait_idle(server)
    assert stats["kv_tokens_used"] == 0 and info(server)["num_running_reqs"] == 0


def test_generate_n_samples_share_one_prefill(server):
    """SGLang's sampling_params.n on /generate: n seeded samples per prompt, prompt-major,
    distinct and reproducible; the prompt is computed once (the other samples hit it)."""
    prompt = [5 + (7 * i) % 200 for i in range(37)]
    sp = {"n": 3, "temperature": 1.0, "seed": 11, "max_new_tokens": 6, "ignore_eos": True}
    wait_idle(server)
    assert post(server, "/flush_cache", None).status_code == 200  # nothing cached before
    r = post(server, "/generate", {"input_ids": prompt, "sampling_params": sp})
    assert r.status_code == 200, r.text
    outs = r.json()
    assert isinstance(outs, list) and len(outs) == 3
    assert len({tuple(o["output_ids"]) for o in outs}) == 3
    assert sorted(o["meta_info"]["cached_tokens"] for o in outs) == [0, 36, 36]
    again = post(server, "/generate", {"input_ids": prompt, "sampling_params": sp}).json()
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in outs]
    batch = {"input_ids": [prompt, [9, 8, 7]], "sampling_params": {**sp, "n": 2}, "rid": ["a", "b"]}
    outs = post(server, "/generate", batch).json()
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [37, 37, 3, 3]
    assert [o["meta_info"]["id"] for o in outs] == ["a-0", "a-1", "b-0", "b-1"]


def test_new_fields_bad_values_are_400_and_leak_nothing(server):
    """Every field this API added answers a bad value with a one-line 400 naming it, on every
    route that takes it; afterwards nothing is in flight and no KV is held."""
    gen = {"input_ids": [1, 2, 3], "sampling_params": GREEDY}
    chat = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    comp = {"model": "default", "prompt": [1, 2, 3], "max_tokens": 2}
    cases = [
        ("/generate", {**gen, "return_timeline": "yes"}, "return_timeline"),
        ("/generate", {**gen, "return_logprob": 1}, "return_logprob"),
        (
            "/generate",
            {**gen, "return_logprob": True, "logprob_start_len": 2**70},
            "logprob_start_len",
        ),
        ("/v1/completions", {**comp, "echo": "true"}, "echo"),
        ("/v1/completions", {**comp, "logprobs": -1}, "logprobs"),
        ("/v1/completions", {**comp, "n": 0}, "n"),
        ("/v1/completions", {**comp, "n": 10**6}, "n"),
        ("/v1/chat/completions", {**chat, "top_logprobs": 3}, "top_logprobs"),
        ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {**chat, "n": 0}, "n"),
        *[
            ("/generate", {**gen, "sampling_params": {**GREEDY, "n": bad}}, "sampling_params.n")
            for bad in (0, 65, "2", 1.5, True, [2])
        ],
        ("/v1/completions", {**comp, "frequency_penalty": 2.5}, "frequency_penalty"),
        ("/v1/completions", {**comp, "logit_bias": {"1": "a"}}, "logit_bias"),
        ("/generate", {**gen, "return_text_in_logprobs": "yes"}, "return_text_in_logprobs"),
        ("/v1/completions", {**comp, "presence_penalty": -3}, "presence_penalty"),
        ("/v1/completions", {**comp, "repetition_penalty": 0}, "repetition_penalty"),
    ]
    for path, body, word in cases:
        r = post(server, path, body)
        assert r.status_code == 400, (path, body, r.text)
        message = r.json()["error"]["message"]
        assert "\n" not in message and word in message, (path, body, message)
    state = wait_idle(server)
    assert state["num_inflight_requests"] == 0 and state["kv_tokens_used"] == 0
    assert (state["num_running_reqs"], state["num_queued_reqs"]) == (0, 0)
