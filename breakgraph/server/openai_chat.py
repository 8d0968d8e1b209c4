"""OpenAI's /v1/chat/completions: a conversation through the model's chat template in, n
choices out (a message each, or a stream of deltas), with the chat logprobs shape."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from breakgraph.server import openai_choices, tool_parser
from breakgraph.server.generation import GenerationState
from breakgraph.server.openai_protocol import ChatCompletionRequest, chat_prompt
from breakgraph.server.sse import DONE, GenerationResponse, event_stream, sse
from breakgraph.server.state import ServerState, read_generation


def _chat_logprobs(
    tokenizer, ids: list[int], lps: list[float], tops: list[list[list]] | None = None
) -> dict:
    tokens = openai_choices.token_strings(tokenizer, ids)
    content = []
    for j, (t, lp) in enumerate(zip(tokens, lps, strict=False)):
        top = []
        if tops is not None and j < len(tops):
            names = openai_choices.token_strings(tokenizer, [int(tid) for _, tid in tops[j]])
            top = [
                {"token": name, "logprob": v, "bytes": list(name.encode())}
                for name, (v, _) in zip(names, tops[j], strict=True)
            ]
        content.append({"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": top})
    return {"content": content}


async def chat_completions(request: Request) -> Response:
    s, req, gen_reqs, prompts = await read_generation(request, _prepare_chat)
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
    states = await openai_choices.run(request, s, gen_reqs)
    if states is None:
        return Response(status_code=499)
    parsers = _tool_parsers(s, req, len(states))
    choices = [
        {
            "index": i,
            "message": tool_parser.chat_message(st.text or "", parser),
            "logprobs": _chat_logprobs(s.tokenizer, st.output_ids, st.logprobs, st.top_logprobs)
            if req.logprobs
            else None,
            "finish_reason": tool_parser.finish_reason(openai_choices.finish_reason(st), parser),
            "matched_stop": openai_choices.matched_stop(st),
        }
        for i, (st, parser) in enumerate(zip(states, parsers, strict=True))
    ]
    head = {"id": cid, "object": "chat.completion", "created": created, "model": req.model}
    return GenerationResponse(
        {**head, "choices": choices, "usage": openai_choices.usage(prompts, states)}
    )


def _tool_parsers(s: ServerState, req: ChatCompletionRequest, n: int):
    """Each choice's tool-call parser (tool_parser.py), or None where no call can come."""
    _, choice = req.tool_choice_checked()
    template = s.tokenizer.chat_template if s.tokenizer is not None else None
    return [tool_parser.parser_for(choice, template) for _ in range(n)]


def _prepare_chat(raw: bytes, s: ServerState):
    """Parse, validate, template and tokenize a chat body (off the event loop when large)."""
    req = openai_choices.parse_request(ChatCompletionRequest, raw, s)
    prompts = [chat_prompt(req, s.tokenizer, s.info)]
    cid = f"chatcmpl-{uuid.uuid4().hex}"
    top_k = (req.top_logprobs or 0) if req.logprobs else 0
    gen_reqs = openai_choices.requests(prompts, req.n, cid, req, req.logprobs, s.info, top_k=top_k)
    return req, gen_reqs, prompts


async def _chat_events(
    s: ServerState, req: ChatCompletionRequest, prompts, gen_reqs, head
) -> AsyncIterator[bytes]:
    sent = openai_choices.SentSoFar(len(gen_reqs))
    started: set[int] = set()
    final: dict[int, GenerationState] = {}
    parsers = _tool_parsers(s, req, len(gen_reqs))
    async for i, st in openai_choices.stream(s, gen_reqs):
        if i not in started:
            started.add(i)
            role = {"index": i, "delta": {"role": "assistant", "content": ""}}
            yield sse({**head, "choices": [{**role, "logprobs": None, "finish_reason": None}]})
        start = sent.tokens[i]
        delta, ids, lps = sent.take(i, st)
        parser, calls = parsers[i], []
        if parser is not None:  # the text of tool calls goes out as tool_calls
            delta, calls = parser.feed(delta)
            if st.finished:
                rest, more = parser.finish()
                delta, calls = delta + rest, calls + more
        if delta or (ids and req.logprobs):
            tops = st.top_logprobs[start : start + len(ids)]
            choice = {
                "index": i,
                "delta": {"content": delta},
                "logprobs": _chat_logprobs(s.tokenizer, ids, lps, tops) if req.logprobs else None,
                "finish_reason": None,
            }
            yield sse({**head, "choices": [choice]})
        if calls:
            first = len(parser.calls) - len(calls)
            delta_calls = [c.openai(first + k) for k, c in enumerate(calls)]
            choice = {"index": i, "delta": {"tool_calls": delta_calls}, "logprobs": None,
                      "finish_reason": None}  # fmt: skip
            yield sse({**head, "choices": [choice]})
        if st.finished:
            final[i] = st
            choice = {
                "index": i,
                "delta": {},
                "logprobs": None,
                "finish_reason": tool_parser.finish_reason(
                    openai_choices.finish_reason(st), parser
                ),  # fmt: skip
                "matched_stop": openai_choices.matched_stop(st),
            }
            yield sse({**head, "choices": [choice]})
    if req.include_usage:
        states = [final[i] for i in sorted(final)]
        yield sse({**head, "choices": [], "usage": openai_choices.usage(prompts, states)})
    yield DONE
