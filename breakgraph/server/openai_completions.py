"""OpenAI's /v1/completions: prompts (text or token ids) in, n choices per prompt out, with
the legacy logprobs shape (tokens, token_logprobs, top_logprobs, text_offset) and echo."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from breakgraph.server import openai_choices
from breakgraph.server.generation import GenerationState
from breakgraph.server.openai_protocol import CompletionRequest, completion_prompts
from breakgraph.server.sse import DONE, GenerationResponse, event_stream, sse
from breakgraph.server.state import ServerState, read_generation


def _completion_logprobs(
    tokenizer,
    ids: list[int],
    lps: list[float | None],
    offset: int,
    tops: list[list[list] | None] | None = None,
) -> dict:
    """OpenAI's legacy logprobs: tokens, token_logprobs, top_logprobs ({token: logprob} per
    position, None where there is none), text_offset."""
    tokens = openai_choices.token_strings(tokenizer, ids)
    offsets = []
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    top_logprobs = None
    if tops is not None:
        top_logprobs = [
            None
            if entry is None
            else dict(zip(openai_choices.token_strings(tokenizer, [int(t) for _, t in entry]),
                          [lp for lp, _ in entry], strict=True))
            for entry in tops
        ]  # fmt: skip
    return {
        "tokens": tokens,
        "token_logprobs": lps,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def _token_ids(req: CompletionRequest, st: GenerationState, ids: list[int], opening: bool):
    """return_token_ids (vLLM's): the output's ids, and the prompt's in a choice's first
    chunk (a whole response: in every choice)."""
    if not req.return_token_ids:
        return {}
    return {"token_ids": ids, **({"prompt_token_ids": st.input_ids} if opening else {})}


def _prompt_text(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False) if tokenizer is not None else ""


def _echo_logprobs(tokenizer, st: GenerationState, k: int, ids, lps, tops, offset: int) -> dict:
    """The prompt's tokens and logprobs (the first one null), then the output's."""
    prompt_tops = (st.input_top_logprobs or [None] * len(st.input_logprobs)) if k else None
    return _completion_logprobs(
        tokenizer,
        st.input_ids + ids,
        list(st.input_logprobs) + lps,
        offset,
        None if prompt_tops is None else prompt_tops + tops,
    )


async def completions(request: Request) -> Response:
    s, req, gen_reqs, prompts = await read_generation(request, _prepare_completion)
    want_logprobs = req.logprobs is not None
    cid = gen_reqs[0].rid.rsplit("-", 1)[0]
    created = int(time.time())
    head = {"id": cid, "object": "text_completion", "created": created, "model": req.model}

    if req.stream:
        return await event_stream(
            _completion_events(s, req, prompts, gen_reqs, head, want_logprobs)
        )
    states = await openai_choices.run(request, s, gen_reqs)
    if states is None:
        return Response(status_code=499)
    choices = []
    k = req.logprobs or 0
    for i, st in enumerate(states):
        logprobs = None
        tops = st.top_logprobs if k else None
        prefix = _prompt_text(s.tokenizer, st.input_ids) if req.echo else ""
        if req.prompt_logprobs:
            logprobs = _echo_logprobs(s.tokenizer, st, k, st.output_ids, st.logprobs, tops or [], 0)
        elif want_logprobs:
            logprobs = _completion_logprobs(s.tokenizer, st.output_ids, st.logprobs, 0, tops)
        choices.append(
            {
                "index": i,
                "text": prefix + (st.text or ""),
                "logprobs": logprobs,
                "finish_reason": openai_choices.finish_reason(st),
                "matched_stop": openai_choices.matched_stop(st),
                **_token_ids(req, st, st.output_ids, True),
            }
        )
    return GenerationResponse(
        {**head, "choices": choices, "usage": openai_choices.usage(prompts, states)}
    )


def _prepare_completion(raw: bytes, s: ServerState):
    """Parse, validate and tokenize a /v1/completions body (off the event loop when large)."""
    req = openai_choices.parse_request(CompletionRequest, raw, s)
    prompts = completion_prompts(req.prompt, s.tokenizer, s.info)
    cid = f"cmpl-{uuid.uuid4().hex}"
    gen_reqs = openai_choices.requests(
        prompts, req.n, cid, req, req.logprobs is not None, s.info,
        top_k=req.logprobs or 0, prompt_logprobs=req.prompt_logprobs,
    )  # fmt: skip
    return req, gen_reqs, prompts


async def _completion_events(
    s: ServerState, req: CompletionRequest, prompts, gen_reqs, head, want_logprobs
) -> AsyncIterator[bytes]:
    sent = openai_choices.SentSoFar(len(gen_reqs))
    final: dict[int, GenerationState] = {}
    echoed: set[int] = set()
    k = req.logprobs or 0
    prompt_chars: dict[int, int] = {}  # echo: each choice's prompt text length, decoded once
    async for i, st in openai_choices.stream(s, gen_reqs):
        opening = i not in echoed  # this choice's first chunk
        first = req.echo and opening
        prefix = _prompt_text(s.tokenizer, st.input_ids) if first else ""
        if first:
            prompt_chars[i] = len(prefix)
        offset = 0 if first else sent.chars[i] + prompt_chars.get(i, 0)
        start = sent.tokens[i]
        delta, ids, lps = sent.take(i, st)
        # a chunk per step with new tokens, its text empty without a tokenizer (as vLLM's)
        if not delta and not ids and not st.finished and not first:
            continue
        echoed.add(i)
        tops = st.top_logprobs[start : start + len(ids)] if k else None
        logprobs = None
        if first and req.prompt_logprobs:
            logprobs = _echo_logprobs(s.tokenizer, st, k, ids, lps, tops or [], offset)
        elif want_logprobs:
            logprobs = _completion_logprobs(s.tokenizer, ids, lps, offset, tops)
        choice = {
            "index": i,
            "text": prefix + delta,
            "logprobs": logprobs,
            "finish_reason": openai_choices.finish_reason(st),
            **_token_ids(req, st, ids, opening),
        }
        if st.finished:
            choice["matched_stop"] = openai_choices.matched_stop(st)
            final[i] = st
        event = {**head, "choices": [choice]}
        if req.continuous_usage:  # the choice's usage so far (vLLM's continuous_usage_stats)
            event["usage"] = {
                "prompt_tokens": st.prompt_tokens,
                "completion_tokens": st.completion_tokens,
                "total_tokens": st.prompt_tokens + st.completion_tokens,
            }
        yield sse(event)
    if req.include_usage:
        states = [final[i] for i in sorted(final)]
        yield sse({**head, "choices": [], "usage": openai_choices.usage(prompts, states)})
    yield DONE
