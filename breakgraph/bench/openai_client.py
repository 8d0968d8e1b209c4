"""The server benches' client (``http_client.ServerClient``) speaking OpenAI's ``/v1/completions``
instead of breakgraph's ``/generate``: what any OpenAI-compatible engine answers, so that
``bench peers`` drives breakgraph and another engine (vLLM) with the same requests.

A request is a token-id prompt (``"prompt": [ids]``), greedy, ``ignore_eos``, streamed with
``stream_options`` ``include_usage`` and ``continuous_usage_stats``: each chunk carries its
choice's completion tokens so far, so a chunk holding several tokens (a server coalesces those
that pile up) is split over them as ``ServerClient.generate`` splits an event, and a text-less
stream (no tokenizer on either side) is still timed token by token. TTFT runs from sending to
the first chunk with a token. Cached prompt tokens come from the final usage chunk
(``prompt_tokens_details``; vLLM reports them with ``--enable-prompt-tokens-details``).
"""

from __future__ import annotations

import asyncio
import time

import orjson

from breakgraph.bench.http_client import BenchError, RequestResult, ServerClient, stream_events

STREAM_OPTIONS = {"include_usage": True, "continuous_usage_stats": True}


class OpenAIClient(ServerClient):
    """``ServerClient`` over ``/v1/completions``, for a server whose vocabulary and served
    model name the caller knows; ``flush_path`` drops its prefix cache (None: none to call)."""

    def __init__(
        self,
        url: str,
        max_connections: int = 16,
        timeout_s: float = 1800.0,
        *,
        model: str,
        vocab: int,
        flush_path: str | None = None,
    ):
        super().__init__(url, max_connections, timeout_s)
        self.model = model
        self.vocab = vocab
        self.flush_path = flush_path

    async def vocab_size(self) -> int:
        return self.vocab

    async def flush_cache(self, timeout_s: float = 30.0) -> None:
        """POST ``flush_path``, retried while the server refuses (requests still finishing);
        a JSON body with ``"success": false`` is a refusal too (vLLM's)."""
        if self.flush_path is None:
            return
        deadline = time.monotonic() + timeout_s
        while True:
            async with self.http.post(self.flush_path) as r:
                status, text = r.status, await r.text()
            try:
                refused = orjson.loads(text).get("success") is False if status == 200 else True
            except (orjson.JSONDecodeError, AttributeError):  # an empty or non-object body
                refused = status != 200
            if not refused:
                return
            if status == 404 or time.monotonic() > deadline:
                raise BenchError(f"{self.flush_path} failed ({status}): {text[:200]}")
            await asyncio.sleep(0.05)

    async def generate(self, input_ids: list[int], max_new_tokens: int) -> RequestResult:
        body = {
            "model": self.model,
            "prompt": input_ids,
            "max_tokens": max_new_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": STREAM_OPTIONS,
        }
        content = orjson.dumps(body)  # before the clock starts, as ServerClient.generate
        headers = {"content-type": "application/json"}
        t0 = time.perf_counter()
        first = last = None
        tokens = 0
        itl: list[float] = []
        finish = None
        usage: dict = {}
        async with self.http.post("/v1/completions", data=content, headers=headers) as resp:
            async for now, event in stream_events(resp, "/v1/completions"):
                if not event.get("choices"):  # the final usage chunk
                    usage = event.get("usage") or usage
                    continue
                choice = event["choices"][0]
                finish = choice.get("finish_reason") or finish
                step = event.get("usage")
                if step is not None:
                    count = step["completion_tokens"]
                else:  # a server without continuous usage: its token ids, else one a chunk
                    count = tokens + len(choice.get("token_ids") or [None])
                new = count - tokens
                if new <= 0:
                    continue
                if first is None:
                    first = now
                else:
                    itl += [(now - last) * 1e3 / new] * new
                last, tokens = now, count
        end = time.perf_counter()
        if first is None:
            raise BenchError("/v1/completions stream ended without a token")
        details = usage.get("prompt_tokens_details") or {}
        return RequestResult(
            prompt_tokens=usage.get("prompt_tokens", len(input_ids)),
            cached_tokens=details.get("cached_tokens") or 0,
            completion_tokens=usage.get("completion_tokens", tokens),
            ttft_ms=(first - t0) * 1e3,
            e2e_ms=(end - t0) * 1e3,
            decode_ms=(last - first) * 1e3,
            itl_ms=itl,
            finish_reason=None if finish is None else {"type": finish},
        )
