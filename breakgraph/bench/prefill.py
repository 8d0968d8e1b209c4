"""``breakgraph bench prefill cold|hit TOKENS CONCURRENCY``: TTFT of concurrent prefills against
a running server, the workload of SGLang's prefill repro.

A wave sends CONCURRENCY streamed requests at once (random token ids, ``max_new_tokens=1``,
greedy, ``ignore_eos``); two warm-up waves, then five measured ones. ``cold``: prompts of
TOKENS tokens, the prefix cache flushed before every wave, so nothing hits. ``hit``: one
request first caches a TOKENS-token prefix; every prompt is then that prefix + 1,024 new
tokens (``--keep-cache``: the prefix an earlier run with the same ``--seed`` cached is
reused, not flushed and prefilled again). Reports TTFT p50/p90 over the measured requests
and input tok/s (a wave's prompt tokens / its wall time, median over waves).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field


@dataclass
class Wave:
    ttft_ms: list[float]
    wall_ms: float
    prompt_tokens: int
    cached_tokens: int
    timelines_ms: list[dict[str, float]] = field(default_factory=list)  # per request

    @property
    def input_tok_s(self) -> float:
        return self.prompt_tokens / (self.wall_ms / 1e3)


@dataclass
class PrefillResult:
    mode: str  # cold | hit
    tokens: int  # cold: the prompt; hit: the cached prefix
    concurrency: int
    new_tokens: int  # uncached tokens per prompt (cold: = tokens)
    url: str
    vocab_size: int
    warmup_waves: int
    waves: list[Wave] = field(default_factory=list)
    ttft_p50_ms: float = 0.0
    ttft_p90_ms: float = 0.0
    input_tok_s: float = 0.0  # all prompt tokens, cached ones included
    new_input_tok_s: float = 0.0  # uncached prompt tokens only
    cached_tokens_per_req: float = 0.0
    timeline_p50_ms: dict[str, float] = field(default_factory=dict)  # the server's, by stage

    @property
    def label(self) -> str:
        size = f"{self.tokens}+{self.new_tokens}" if self.mode == "hit" else f"{self.tokens}"
        return f"{self.mode} {size} x{self.concurrency}"

    def summary(self) -> str:
        line = (
            f"{self.label}: TTFT p50 {self.ttft_p50_ms:.2f} ms, p90 {self.ttft_p90_ms:.2f} ms, "
            f"input {self.input_tok_s:.0f} tok/s"
        )
        if self.mode == "hit":
            line += f", cached {self.cached_tokens_per_req:.0f} tok/req"
        from breakgraph.bench.http_client import format_stages

        return line + f"\n  timeline p50 (ms): {format_stages(self.timeline_p50_ms)}"

    def to_dict(self) -> dict:
        d = asdict(self)
        for w, wd in zip(self.waves, d["waves"], strict=True):
            wd["input_tok_s"] = w.input_tok_s
        return {"bench": "prefill", "label": self.label, **d}


async def _wave(client, prompts: list[list[int]]) -> Wave:
    t0 = time.perf_counter()
    results = await asyncio.gather(*(client.generate(p, max_new_tokens=1) for p in prompts))
    wall_ms = (time.perf_counter() - t0) * 1e3
    return Wave(
        ttft_ms=[r.ttft_ms for r in results],
        wall_ms=wall_ms,
        prompt_tokens=sum(r.prompt_tokens for r in results),
        cached_tokens=sum(r.cached_tokens for r in results),
        timelines_ms=[r.timeline_ms for r in results if r.timeline_ms],
    )


async def run_prefill(
    url: str,
    mode: str,
    tokens: int,
    concurrency: int,
    hit_new_tokens: int = 1024,
    warmup_waves: int = 2,
    waves: int = 5,
    seed: int = 0,
    client_factory=None,
    keep_cache: bool = False,
) -> PrefillResult:
    """``client_factory(url, max_connections=...)``: the client (default ``ServerClient``,
    breakgraph's /generate; ``bench peers`` passes its OpenAI one)."""
    from breakgraph.bench.http_client import (
        BenchError,
        ServerClient,
        median,
        percentile,
        random_ids,
        stage_medians,
    )

    if min(tokens, concurrency, waves, hit_new_tokens) < 1 or warmup_waves < 0:
        raise BenchError("TOKENS, CONCURRENCY, --waves and --hit-new-tokens must be positive")
    rng = random.Random(seed)
    async with (client_factory or ServerClient)(url, max_connections=concurrency) as client:
        vocab = await client.vocab_size()
        res = PrefillResult(
            mode=mode,
            tokens=tokens,
            concurrency=concurrency,
            new_tokens=tokens if mode == "cold" else hit_new_tokens,
            url=url,
            vocab_size=vocab,
            warmup_waves=warmup_waves,
        )
        prefix: list[int] = []
        if mode == "hit":
            if not keep_cache:
                await client.flush_cache()
            prefix = random_ids(rng, tokens, vocab)
            await client.generate(prefix, max_new_tokens=1)
            if keep_cache:  # fresh new tokens (unseeded): none that an earlier run cached
                rng = random.Random()
        for i in range(warmup_waves + waves):
            if mode == "cold":
                await client.flush_cache()
            prompts = [prefix + random_ids(rng, res.new_tokens, vocab) for _ in range(concurrency)]
            wave = await _wave(client, prompts)
            if i >= warmup_waves:
                res.waves.append(wave)
    ttfts = [t for w in res.waves for t in w.ttft_ms]
    n_reqs = len(ttfts)
    res.ttft_p50_ms = percentile(ttfts, 50)
    res.ttft_p90_ms = percentile(ttfts, 90)
    res.input_tok_s = median([w.input_tok_s for w in res.waves])
    res.new_input_tok_s = median(
        [(w.prompt_tokens - w.cached_tokens) / (w.wall_ms / 1e3) for w in res.waves]
    )
    res.cached_tokens_per_req = sum(w.cached_tokens for w in res.waves) / n_reqs
    res.timeline_p50_ms = stage_medians([t for w in res.waves for t in w.timelines_ms])
    return res


def run_prefill_bench(args) -> PrefillResult:
    from breakgraph.bench.http_client import BenchError
    from breakgraph.bench.plot import require_plot

    require_plot(args.plot)
    try:
        res = asyncio.run(
            run_prefill(
                args.url,
                args.mode,
                args.tokens,
                args.concurrency,
                hit_new_tokens=args.hit_new_tokens,
                warmup_waves=args.warmup_waves,
                waves=args.waves,
                seed=args.seed,
                keep_cache=args.keep_cache,
            )
        )
    except BenchError as e:
        raise SystemExit(f"error: {e}") from None
    print(res.summary(), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res.to_dict(), f, indent=1)
    if args.plot:
        from breakgraph.bench.plot import plot_prefill

        plot_prefill([res.to_dict()], args.plot)
    return res
