"""/v1/completions streamed by a server without a tokenizer (token-id prompts), as a client that
times tokens reads it: a chunk per decode step rather than one at the end, each with vLLM's
``return_token_ids`` and ``continuous_usage_stats`` fields, so that the same client reads
breakgraph and vLLM (``breakgraph bench peers``)."""

from __future__ import annotations

from itertools import accumulate

import httpx
import pytest

from tests.support.server import assert_refused_holding_nothing, post, sse_events

PROMPT = [5, 6, 7, 8]
BODY = {
    "model": "default",
    "prompt": PROMPT,
    "max_tokens": 24,
    "temperature": 0,
    "ignore_eos": True,
}


def _stream(server, body: dict) -> list:
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60
    ) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    return events[:-1]


def test_token_id_stream_sends_a_chunk_per_step_with_its_ids_and_usage(server):
    whole = post(server, "/v1/completions", {**BODY, "return_token_ids": True}).json()
    (choice,) = whole["choices"]
    assert choice["prompt_token_ids"] == PROMPT and len(choice["token_ids"]) == 24

    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {**BODY, "return_token_ids": True, "stream_options": options}
    events = _stream(server, body)
    chunks = [e for e in events if e["choices"]]
    # one event per step: the tokens arrive as they are decoded, not in one final chunk
    assert len(chunks) > 1 and all(e["choices"][0]["token_ids"] for e in chunks)
    assert all(c["finish_reason"] is None for e in chunks[:-1] for c in e["choices"])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["text"] == "" for e in chunks for c in e["choices"])  # no tokenizer, no text
    streamed = [t for e in chunks for t in e["choices"][0]["token_ids"]]
    assert streamed == choice["token_ids"]  # greedy: the same tokens as the whole response
    # the prompt's ids once, in the first chunk
    assert chunks[0]["choices"][0]["prompt_token_ids"] == PROMPT
    assert not any("prompt_token_ids" in e["choices"][0] for e in chunks[1:])
    # each chunk's usage counts the choice's tokens so far
    counts = [e["usage"]["completion_tokens"] for e in chunks]
    assert counts == list(accumulate(len(e["choices"][0]["token_ids"]) for e in chunks))
    assert counts[-1] == 24
    assert all(e["usage"]["prompt_tokens"] == len(PROMPT) for e in chunks)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 24


def test_plain_token_id_stream_is_per_step_too(server):
    """Without the extra fields a chunk still goes out per step (empty text), and carries
    neither ids nor usage; n choices each stream their own."""
    events = _stream(server, {**BODY, "n": 2})
    for index in (0, 1):
        chunks = [c for e in events for c in e["choices"] if c["index"] == index]
        assert len(chunks) > 1 and chunks[-1]["finish_reason"] == "length"
        assert not any("token_ids" in c or "prompt_token_ids" in c for c in chunks)
    assert not any("usage" in e for e in events)


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"return_token_ids": "yes"}, "return_token_ids"),
        ({"stream_options": {"include_usage": True, "continuous_usage_stats": 1}},
         "continuous_usage_stats"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("stream", [False, True])
def test_bad_vllm_fields_are_a_400_naming_them_and_hold_nothing(server, extra, field, stream):
    r = post(server, "/v1/completions", {**BODY, **extra, "stream": stream})
    assert_refused_holding_nothing(server, r, field)
