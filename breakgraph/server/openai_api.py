"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from breakgraph.common.messages import ModelInfo
from breakgraph.server.errors import APIError
from breakgraph.server.generation import (
    GenerationRequest,
    GenerationState,
    merge_streams,
    run_to_completion,
    stamp_received,
    stream_generation,
)
from breakgraph.server.json_body import off_loop_if_large, parse_json, read_body
from breakgraph.server.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    build_sampling,
    chat_prompt,
    check_all_fit,
    completion_prompts,
)
from breakgraph.server.protocol import parse_model, per_sample
from breakgraph.server.sse import DONE, GenerationResponse, event_stream, sse
from breakgraph.server.state import ServerState, server_state
from breakgraph.tokenizer import Tokenizer

router = APIRouter(prefix="/v1")

DEFAULT_MODEL_ALIAS = "default"  # accepted in place of the served name, as in SGLang's examples


def _check_model(s: ServerState, name: str) -> None:
    if name not in (s.served_model_name, DEFAULT_MODEL_ALIAS):
        raise APIError(
            f"the model {name!r} does not exist; this server serves {s.served_model_name!r}",
            status=404,
            param="model",
        )


@router.get("/models")
async def list_models(request: Request) -> dict[str, Any]:
    s = server_state(request)
    return {
        "object": "list",
        "data": [
            {
                "id": s.served_model_name,
                "object": "model",
                "created": int(time.time()),
                "owned_by": "breakgraph",
                "root": s.model_path or s.info.model_source,
                "max_model_len": s.info.context_length,
            }
        ],
    }


def _finish_reason(state: GenerationState) -> str | None:
    if not state.finished:
        return None
    return (state.finish_reason or {}).get("type", "stop")


def _matched_stop(state: GenerationState) -> Any:
    return (state.finish_reason or {}).get("matched")


def _usage(prompts: list[list[int]], states: list[GenerationState]) -> dict[str, Any]:
    """Prompts count once each, as OpenAI bills them, whatever n is (states: prompt-major)."""
    n = len(states) // len(prompts)
    prompt_tokens = sum(len(p) for p in prompts)
    completion = sum(st.completion_tokens for st in states)
    cached = sum(st.cached_tokens for st in states[::n])
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _token_strings(tokenizer: Tokenizer | None, ids: list[int]) -> list[str]:
    if tokenizer is None:
        return [f"token_id:{t}" for t in ids]
    return [tokenizer.decode([t], skip_special_tokens=False) for t in ids]


class _Choices:
    """What each choice of a streamed response has sent so far (text chars, tokens)."""

    def __init__(self, n: int):
        self.chars = [0] * n
        self.tokens = [0] * n

    def take(self, i: int, st: GenerationState) -> tuple[str, list[int], list[float]]:
        text = st.text or ""
        delta = text[self.chars[i] :]
        ids = st.output_ids[self.tokens[i] :]
        lps = st.logprobs[self.tokens[i] :]
        self.chars[i], self.tokens[i] = len(text), len(st.output_ids)
        return delta, ids, lps


def _requests(
    prompts: list[list[int]],
    n: int,
    base_id: str,
    req: Any,
    logprob: bool,
    info: ModelInfo,
    top_k: int = 0,
    prompt_logprobs: bool = False,
) -> list[GenerationRequest]:
    """n requests per prompt (prompt-major), seeds as :func:`per_sample` gives them."""
    sampling, api_opts = build_sampling(req, req.max_new_tokens(), [len(p) for p in prompts], info)
    check_all_fit(prompts, sampling, info)
    per_choice = per_sample(sampling, n)
    return [
        GenerationRequest(
            ids,
            per_choice[j],
            logprob,
            f"{base_id}-{i * n + j}",
            **api_opts,
            logprob_start_len=0 if prompt_logprobs else -1,
            top_logprobs_num=top_k,
        )
        for i, ids in enumerate(prompts)
        for j in range(n)
    ]


async def _run(
    request: Request, s: ServerState, gen_reqs: list[GenerationRequest]
) -> list[GenerationState] | None:
    s.require_alive()
    return await run_to_completion(s.client, s.tokenizer, gen_reqs, request.is_disconnected)


def _streams(s: ServerState, gen_reqs: list[GenerationRequest]):
    s.require_alive()
    interval = s.stream_interval
    return merge_streams([stream_generation(s.client, s.tokenizer, r, interval) for r in gen_reqs])


# ---- /v1/completions ----
def _completion_logprobs(
    tokenizer,
    ids: list[int],
    lps: list[float | None],
    offset: int,
    tops: list[list[list] | None] | None = None,
) -> dict:
    """OpenAI's legacy logprobs: tokens, token_logprobs, top_logprobs ({token: logprob} per
    position, None where there is none), text_offset."""
    tokens = _token_strings(tokenizer, ids)
    offsets = []
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    top_logprobs = None
    if tops is not None:
        top_logprobs = [
            None
            if entry is None
            else dict(zip(_token_strings(tokenizer, [int(t) for _, t in entry]),
                          [lp for lp, _ in entry], strict=True))
            for entry in tops
        ]  # fmt: skip
    return {
        "tokens": tokens,
        "token_logprobs": lps,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


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


@router.post("/completions")
async def completions(request: Request) -> Response:
    received_at, received_perf = time.time(), time.perf_counter()
    s = server_state(request)
    raw = await read_body(request, s.max_request_bytes)
    req, prompts, gen_reqs = await off_loop_if_large(raw, _prepare_completion, raw, s)
    stamp_received(gen_reqs, received_at, received_perf)
    want_logprobs = req.logprobs is not None
    cid = gen_reqs[0].rid.rsplit("-", 1)[0]
    created = int(time.time())
    head = {"id": cid, "object": "text_completion", "created": created, "model": req.model}

    if req.stream:
        return await event_stream(
            _completion_events(s, req, prompts, gen_reqs, head, want_logprobs)
        )
    states = await _run(request, s, gen_reqs)
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
                "finish_reason": _finish_reason(st),
                "matched_stop": _matched_stop(st),
            }
        )
    return GenerationResponse({**head, "choices": choices, "usage": _usage(prompts, states)})


def _prepare_completion(raw: bytes, s: ServerState):
    """Parse, validate and tokenize a /v1/completions body (off the event loop when large)."""
    req = parse_model(CompletionRequest, parse_json(raw))
    _check_model(s, req.model)
    req.check()
    prompts = completion_prompts(req.prompt, s.tokenizer, s.info)
    cid = f"cmpl-{uuid.uuid4().hex}"
    gen_reqs = _requests(
        prompts, req.n, cid, req, req.logprobs is not None, s.info,
        top_k=req.logprobs or 0, prompt_logprobs=req.prompt_logprobs,
    )  # fmt: skip
    return req, prompts, gen_reqs


async def _completion_events(
    s: ServerState, req: CompletionRequest, prompts, gen_reqs, head, want_logprobs
) -> AsyncIterator[bytes]:
    sent = _Choices(len(gen_reqs))
    final: dict[int, GenerationState] = {}
    echoed: set[int] = set()
    k = req.logprobs or 0
    prompt_chars: dict[int, int] = {}  # echo: each choice's prompt text length, decoded once
    async for i, st in _streams(s, gen_reqs):
        first = req.echo and i not in echoed
        prefix = _prompt_text(s.tokenizer, st.input_ids) if first else ""
        if first:
            prompt_chars[i] = len(prefix)
        offset = 0 if first else sent.chars[i] + prompt_chars.get(i, 0)
        start = sent.tokens[i]
        delta, ids, lps = sent.take(i, st)
        if not delta and not st.finished and not first:
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
            "finish_reason": _finish_reason(st),
        }
        if st.finished:
            choice["matched_stop"] = _matched_stop(st)
            final[i] = st
        yield sse({**head, "choices": [choice]})
    if req.include_usage:
        states = [final[i] for i in sorted(final)]
        yield sse({**head, "choices": [], "usage": _usage(prompts, states)})
    yield DONE


# ---- /v1/chat/completions ----
def _chat_logprobs(
    tokenizer, ids: list[int], lps: list[float], tops: list[list[list]] | None = None
) -> dict:
    tokens = _token_strings(tokenizer, ids)
    content = []
    for j, (t, lp) in enumerate(zip(tokens, lps, strict=False)):
        top = []
        if tops is not None and j < len(tops):
            names = _token_strings(tokenizer, [int(tid) for _, tid in tops[j]])
            top = [
                {"token": name, "logprob": v, "bytes": list(name.encode())}
                for name, (v, _) in zip(names, tops[j], strict=True)
            ]
        content.append({"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": top})
    return {"content": content}


@router.post("/chat/completions")
async def chat_completions(request: Request) -> Response:
    received_at, received_perf = time.time(), time.perf_counter()
    s = server_state(request)
    raw = await read_body(request, s.max_request_bytes)
    req, prompts, gen_reqs = await off_loop_if_large(raw, _prepare_chat, raw, s)
    stamp_received(gen_reqs, received_at, received_perf)
    cid = gen_reqs[0].rid.rsplit("-", 1)[0]
    created = int(time.time())

    if req.stream:
        head = {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": req.model,
        }
        return await event_stream(_chat_events(s, req, prompts, gen_reqs, head))
    states = await _run(request, s, gen_reqs)
    if states is None:
        return Response(status_code=499)
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": st.text or ""},
            "logprobs": _chat_logprobs(s.tokenizer, st.output_ids, st.logprobs, st.top_logprobs)
            if req.logprobs
            else None,
            "finish_reason": _finish_reason(st),
            "matched_stop": _matched_stop(st),
        }
        for i, st in enumerate(states)
    ]
    head = {"id": cid, "object": "chat.completion", "created": created, "model": req.model}
    return GenerationResponse({**head, "choices": choices, "usage": _usage(prompts, states)})


def _prepare_chat(raw: bytes, s: ServerState):
    """Parse, validate, template and tokenize a chat body (off the event loop when large)."""
    req = parse_model(ChatCompletionRequest, parse_json(raw))
    _check_model(s, req.model)
    req.check()
    prompts = [chat_prompt(req, s.tokenizer, s.info)]
    cid = f"chatcmpl-{uuid.uuid4().hex}"
    top_k = (req.top_logprobs or 0) if req.logprobs else 0
    return req, prompts, _requests(prompts, req.n, cid, req, req.logprobs, s.info, top_k=top_k)


async def _chat_events(
    s: ServerState, req: ChatCompletionRequest, prompts, gen_reqs, head
) -> AsyncIterator[bytes]:
    sent = _Choices(len(gen_reqs))
    started: set[int] = set()
    final: dict[int, GenerationState] = {}
    async for i, st in _streams(s, gen_reqs):
        if i not in started:
            started.add(i)
            role = {"index": i, "delta": {"role": "assistant", "content": ""}}
            yield sse({**head, "choices": [{**role, "logprobs": None, "finish_reason": None}]})
        start = sent.tokens[i]
        delta, ids, lps = sent.take(i, st)
        if delta or (ids and req.logprobs):
            tops = st.top_logprobs[start : start + len(ids)]
            choice = {
                "index": i,
                "delta": {"content": delta},
                "logprobs": _chat_logprobs(s.tokenizer, ids, lps, tops) if req.logprobs else None,
                "finish_reason": None,
            }
            yield sse({**head, "choices": [choice]})
        if st.finished:
            final[i] = st
            choice = {
                "index": i,
                "delta": {},
                "logprobs": None,
                "finish_reason": _finish_reason(st),
                "matched_stop": _matched_stop(st),
            }
            yield sse({**head, "choices": [choice]})
    if req.include_usage:
        states = [final[i] for i in sorted(final)]
        yield sse({**head, "choices": [], "usage": _usage(prompts, states)})
    yield DONE
