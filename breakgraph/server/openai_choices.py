"""What the two OpenAI generation routes (completions, chat) share: the body parsed for the
served model, a request per choice (``n`` per prompt), run to completion or streamed, and the
parts of a choice in a response (finish reason, matched stop, usage, token strings).
"""

from __future__ import annotations

from typing import Any, TypeVar

from fastapi import Request

from breakgraph.common.messages import ModelInfo
from breakgraph.server.errors import APIError
from breakgraph.server.generation import (
    GenerationRequest,
    GenerationState,
    merge_streams,
    run_to_completion,
    stream_generation,
)
from breakgraph.server.json_body import parse_json
from breakgraph.server.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    build_sampling,
    check_all_fit,
)
from breakgraph.server.protocol import parse_model, per_sample
from breakgraph.server.state import ServerState
from breakgraph.tokenizer import Tokenizer

DEFAULT_MODEL_ALIAS = "default"  # accepted in place of the served name, as in SGLang's examples
M = TypeVar("M", CompletionRequest, ChatCompletionRequest)


def parse_request(model: type[M], raw: bytes, s: ServerState) -> M:
    """A route's body as its request model: parsed, validated, and naming the served model."""
    req = parse_model(model, parse_json(raw))
    if req.model is None:
        req.model = s.served_model_name
    if req.model not in (s.served_model_name, DEFAULT_MODEL_ALIAS):
        raise APIError(
            f"the model {req.model!r} does not exist; this server serves {s.served_model_name!r}",
            status=404,
            param="model",
        )
    req.check()
    return req


def finish_reason(state: GenerationState) -> str | None:
    if not state.finished:
        return None
    return (state.finish_reason or {}).get("type", "stop")


def matched_stop(state: GenerationState) -> Any:
    return (state.finish_reason or {}).get("matched")


def usage(prompts: list[list[int]], states: list[GenerationState]) -> dict[str, Any]:
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


def token_strings(tokenizer: Tokenizer | None, ids: list[int]) -> list[str]:
    if tokenizer is None:
        return [f"token_id:{t}" for t in ids]
    return [tokenizer.decode([t], skip_special_tokens=False) for t in ids]


class SentSoFar:
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


def requests(
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
    try:
        lens = [len(p) for p in prompts]
        sampling, api_opts = build_sampling(req, req.max_new_tokens(), lens, info)
        check_all_fit(prompts, sampling, info)
    except APIError as e:
        raise req.in_request_terms(e) from None
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


async def run(
    request: Request, s: ServerState, gen_reqs: list[GenerationRequest]
) -> list[GenerationState] | None:
    s.require_alive()
    return await run_to_completion(s.client, s.tokenizer, gen_reqs, request.is_disconnected)


def stream(s: ServerState, gen_reqs: list[GenerationRequest]):
    s.require_alive()
    interval = s.stream_interval
    return merge_streams([stream_generation(s.client, s.tokenizer, r, interval) for r in gen_reqs])
