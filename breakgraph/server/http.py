"""The FastAPI app: SGLang-native routes, health, metrics and server info, and error handling."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import tempfile
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import breakgraph
from breakgraph.common import envs, gc_watch
from breakgraph.common.sampling_params import SamplingParams
from breakgraph.server.asgi import HotRoutes
from breakgraph.server.auth import BearerAuth
from breakgraph.server.errors import APIError, EngineError
from breakgraph.server.generation import (
    GenerationRequest,
    GenerationState,
    merge_streams,
    run_to_completion,
    stream_generation,
)
from breakgraph.server.json_body import parse_json, read_body
from breakgraph.server.openai_api import router as openai_router
from breakgraph.server.openai_chat import chat_completions
from breakgraph.server.openai_completions import completions
from breakgraph.server.protocol import (
    GenerateReqInput,
    batch_fields,
    check_fits,
    check_logprobs,
    parse_model,
    per_sample,
    pop_n,
    prompts_of,
    sampling_from_dict,
    unsupported,
)
from breakgraph.server.sse import DONE, GenerationResponse, event_stream, sse
from breakgraph.server.state import ServerState, read_generation, server_state

logger = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 30.0


def create_app(state: ServerState) -> FastAPI:
    """The routes; the engine process's life is the launcher's (server/launch.py)."""
    app = FastAPI(title="breakgraph", version=breakgraph.__version__)
    app.state.server = state
    app.include_router(router)
    app.include_router(openai_router)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(EngineError, _engine_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    return app


def create_asgi_app(state: ServerState, api_key: str | None = None) -> HotRoutes | BearerAuth:
    """What uvicorn serves: :func:`create_app` with the generation routes called directly
    (server/asgi.py), behind the API key if one is set (server/auth.py)."""
    app = create_app(state)
    hot = {("POST", "/generate"): generate, ("POST", "/v1/completions"): completions,
           ("POST", "/v1/chat/completions"): chat_completions}  # fmt: skip
    routes = HotRoutes(app, hot)
    return BearerAuth(routes, api_key) if api_key else routes


async def _api_error(request: Request, e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def _engine_error(request: Request, e: EngineError) -> JSONResponse:
    return await _api_error(request, APIError(str(e), status=e.status))


async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
    return await _api_error(request, APIError(f"invalid request: {e.errors()}"))


async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    """Routing errors (404 no such path, 405 wrong method) in the same JSON shape."""
    message = f"{e.detail}: {request.method} {request.url.path}"
    body = APIError(message, status=e.status_code).body()
    return JSONResponse(body, status_code=e.status_code, headers=getattr(e, "headers", None))


async def _internal_error(request: Request, e: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s", request.url.path)
    return await _api_error(request, APIError(f"internal error: {e}", status=500))


router = APIRouter()


# ---- generation ----
def _native_output(
    state: GenerationState, index: int | None = None, token_text=None, sent: _Sent | None = None
) -> dict[str, Any]:
    """A response or stream event: everything so far, or with ``sent`` (an incremental
    stream) only what the stream's earlier events did not carry, ``sent`` moved past it."""
    if sent is None:
        meta = state.meta_info(token_text)
        out = {"text": state.text, "output_ids": list(state.output_ids), "meta_info": meta}
    else:
        meta = state.meta_info(token_text, since=sent.ids, with_input=sent.first)
        text = state.text if state.text is None else state.text[sent.text :]
        out = {"text": text, "output_ids": state.output_ids[sent.ids :], "meta_info": meta}
        sent.ids, sent.text, sent.first = len(state.output_ids), len(state.text or ""), False
    if index is not None:
        out["index"] = index
    return out


@dataclasses.dataclass
class _Sent:
    """How much of one stream's output its earlier events carried (incremental streams)."""

    ids: int = 0
    text: int = 0
    first: bool = True


@router.post("/generate")
async def generate(request: Request) -> Response:
    s, req, gen_reqs, is_batch = await read_generation(request, _prepare_generate)
    for r in gen_reqs:
        r.return_timeline = req.return_timeline
    s.require_alive()
    text = None
    if req.return_text_in_logprobs and s.tokenizer is not None:
        tokenizer = s.tokenizer

        def text(tok: int) -> str:
            return tokenizer.decode([tok], skip_special_tokens=False)

    if req.stream:
        streams = [stream_generation(s.client, s.tokenizer, r, s.stream_interval) for r in gen_reqs]
        items = merge_streams(streams) if is_batch else _single(streams[0])
        events = _native_events(
            items, batch=is_batch, token_text=text, incremental=s.incremental_streaming_output
        )
        return await event_stream(events)

    states = await run_to_completion(s.client, s.tokenizer, gen_reqs, request.is_disconnected)
    if states is None:
        return Response(status_code=499)  # client closed the connection; requests aborted
    outs = [_native_output(st, token_text=text) for st in states]
    return GenerationResponse(outs if is_batch else outs[0])


def _prepare_generate(
    raw: bytes, s: ServerState
) -> tuple[GenerateReqInput, list[GenerationRequest], bool]:
    """Parse, validate and tokenize a /generate body (off the event loop when large)."""
    req = parse_model(GenerateReqInput, parse_json(raw))
    unsupported(req)
    prompts, is_batch = prompts_of(req, s.tokenizer, s.info)
    sampling, logprob, rids, starts, tops = batch_fields(req, len(prompts))
    gen_reqs = []
    rows = zip(prompts, sampling, logprob, rids, starts, tops, strict=True)
    for ids, sp_dict, lp, rid, start, top in rows:
        if sp_dict is not None and not isinstance(sp_dict, dict):
            raise APIError(f"sampling_params must be an object, got {type(sp_dict).__name__}")
        sp_dict, n = pop_n(sp_dict)
        sp, api_opts = sampling_from_dict(sp_dict)
        check_fits(ids, sp, s.info)
        check_logprobs(len(ids), start, top)
        start, top = (-1 if start is None else start), top or 0
        for j, sp_j in enumerate(per_sample(sp, n)):
            rid_j = rid if rid is None or n == 1 else f"{rid}-{j}"
            gen_reqs.append(GenerationRequest(ids, sp_j, lp, rid_j, **api_opts,
                                              logprob_start_len=start, top_logprobs_num=top))  # fmt: skip
        is_batch = is_batch or n > 1  # n samples answer as a list, prompt-major
    given = [r.rid for r in gen_reqs if r.rid is not None]
    if len(set(given)) != len(given):
        raise APIError("rid values must be unique")
    return req, gen_reqs, is_batch


async def _single(states: AsyncIterator[GenerationState]):
    try:
        async for st in states:
            yield 0, st
    finally:
        await states.aclose()


async def _native_events(
    items, batch: bool = False, token_text=None, incremental: bool = False
) -> AsyncIterator[bytes]:
    sent: dict[int, _Sent] = {}
    try:
        async for i, st in items:
            since = sent.setdefault(i, _Sent()) if incremental else None
            yield sse(_native_output(st, i if batch else None, token_text, since))
        yield DONE
    finally:
        await items.aclose()


# ---- health and control ----
@router.get("/health")
async def health(request: Request) -> Response:
    s = server_state(request)
    return Response(status_code=200 if s.client.admitting else 503)


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """Healthy if a 1-token generation completes."""
    s = server_state(request)
    s.require_alive()
    bos = s.tokenizer.bos_token_id if s.tokenizer is not None else None
    req = GenerationRequest(
        [bos if bos is not None else 0],
        SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True),
        rid=f"health-{uuid.uuid4().hex}",
    )
    try:
        async with asyncio.timeout(HEALTH_GENERATE_TIMEOUT_S):
            await run_to_completion(s.client, s.tokenizer, [req])
    except (TimeoutError, EngineError) as e:
        logger.error("health_generate failed: %r", e)
        return Response(status_code=503)
    return Response(status_code=200)


@router.get("/version")
async def version() -> dict[str, str]:
    """The package's version (SGLang's route)."""
    return {"version": breakgraph.__version__}


@router.get("/get_model_info")
async def get_model_info(request: Request) -> dict[str, Any]:
    s = server_state(request)
    return {
        "model_path": s.model_path or s.info.model_source,
        "tokenizer_path": s.model_path if s.tokenizer is not None else None,
        "served_model_name": s.served_model_name,
        "is_generation": True,
        "architecture": s.info.architecture,
        "vocab_size": s.info.vocab_size,
        "context_length": s.info.context_length,
        "has_tokenizer": s.tokenizer is not None,
    }


@router.get("/get_server_info")
async def get_server_info(request: Request) -> dict[str, Any]:
    """The server's arguments, the model, and the engine's stats: its answer, or while a long
    step runs what it last published (``stats_age_s`` says how old; client.latest_stats)."""
    s = server_state(request)
    s.require_alive()
    stats, age_s = await s.client.latest_stats()
    return {
        **s.server_args,
        "version": breakgraph.__version__,
        "served_model_name": s.served_model_name,
        **dataclasses.asdict(s.info),
        "max_total_num_tokens": s.info.kv_capacity_tokens,
        "num_inflight_requests": s.client.num_inflight,
        **stats,
        **gc_watch.report("api_gc_"),  # this (API) process's own collections
        "stats_age_s": round(age_s, 3),
        "internal_states": [stats],
    }


@router.api_route("/flush_cache", methods=["GET", "POST"])  # SGLang's docs curl it (GET)
async def flush_cache(request: Request) -> JSONResponse:
    """Drop the prefix cache; refused while requests run (409, the one error shape)."""
    s = server_state(request)
    s.require_alive()
    if await s.client.flush_cache():
        return JSONResponse({"success": True, "message": "Cache flushed."})
    raise APIError(
        f"the cache was not flushed: {s.client.num_inflight} request(s) in flight; "
        "flush when the server is idle",
        status=409,
    )


@router.post("/start_profile")
async def start_profile(request: Request) -> dict[str, Any]:
    """Start the engine's torch profiler between two steps (SGLang's endpoint; rank 0's host
    ops and kernels: engine/profiling.py). Body, optional: ``{"output_dir": DIR}`` (default
    ``BREAKGRAPH_TORCH_PROFILER_DIR``, else breakgraph-profiles in the temp folder); 409
    while one runs. POST only: a crawler's GET must not start one (its trace grows with every
    step until /stop_profile)."""
    s = server_state(request)
    s.require_alive()
    output_dir = envs.TORCH_PROFILER_DIR.get() or os.path.join(
        tempfile.gettempdir(), "breakgraph-profiles"
    )
    raw = await read_body(request, s.max_request_bytes)
    if raw.strip():
        body = parse_json(raw)
        if not isinstance(body, dict) or set(body) - {"output_dir"}:
            raise APIError('give {"output_dir": DIR} or no body (other options: none yet)')
        output_dir = body.get("output_dir", output_dir)
        if not isinstance(output_dir, str) or not output_dir:
            raise APIError(f"output_dir must be a folder's path, got {output_dir!r}")
    output_dir = os.path.abspath(output_dir)
    return _profile_answer(await s.client.profile(True, output_dir), output_dir=output_dir)


@router.post("/stop_profile")
async def stop_profile(request: Request) -> dict[str, Any]:
    """Stop the profiler and write its Chrome trace (gzipped JSON; Perfetto opens it): the
    answer names the file. 409 when none runs."""
    s = server_state(request)
    s.require_alive()
    reply = await s.client.profile(False)
    return _profile_answer(reply, trace=reply.trace)


def _profile_answer(reply, **fields: str) -> dict[str, Any]:
    if not reply.ok:
        raise APIError(reply.message, status=409 if reply.conflict else 500)
    return {"success": True, "message": reply.message, **fields}


@router.post("/abort_request")
async def abort_request(request: Request) -> dict[str, Any]:
    s = server_state(request)
    body = parse_json(await read_body(request, s.max_request_bytes))
    if not isinstance(body, dict) or not ({"rid", "abort_all"} & set(body)):
        raise APIError('give {"rid": ...} or {"abort_all": true}')
    abort_all = body.get("abort_all", False)
    if not isinstance(abort_all, bool):
        raise APIError(f"abort_all must be a boolean, got {abort_all!r}")
    if abort_all:
        return {"success": True, "aborted": s.client.abort_all()}
    rid = body.get("rid")
    if not isinstance(rid, str):
        raise APIError(f'rid must be a string (or give "abort_all": true), got {rid!r}')
    aborted = s.client.abort_samples(rid)
    return {"success": aborted > 0, "aborted": aborted}


@router.get("/metrics")
async def metrics(request: Request) -> PlainTextResponse:
    """Prometheus: the API process's counters and histograms, and the engine's gauges (a
    scrape never waits for a long step: client.latest_stats)."""
    s = server_state(request)
    stats = (await s.client.latest_stats())[0] if s.client.alive else None
    return PlainTextResponse(
        s.client.metrics.render(stats), media_type="text/plain; version=0.0.4; charset=utf-8"
    )
