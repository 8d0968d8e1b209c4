"""``breakgraph bench serving``: closed-loop serving at several concurrencies against a running
server, reported as the tables of SGLang's prefill-graph PRs.

At concurrency C, C workers each send their next request when the previous one finishes
(random token ids, ``ignore_eos``, streamed) until the level's requests are done. Two rounds,
the second in reverse concurrency order, so a drift over time shows as a difference between
rounds. Per level: decode step p50 (inter-token latency), tok/s per user p50 (each request's
decode rate), output tok/s (all output tokens / the level's wall time) and TTFT p50.

The table's decode step is the client's: the gap between the events it reads, split over the
tokens each carries. At high concurrency the one client process reads events in bursts, and
it reads near zero (0.02 ms at 128 and 256 streams on an H200). The server timeline's line
adds the server's view, which holds there: each request's decode stage in the API process
(first output to last) over its tokens after the first, p50 over the requests.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass

HEADER = (
    "| concurrency | requests | decode step p50 (ms) | tok/s per user p50 | output tok/s "
    "| TTFT p50 (ms) |\n|---:|---:|---:|---:|---:|---:|"
)


@dataclass
class LevelResult:
    round: int
    concurrency: int
    requests: int
    wall_s: float
    decode_step_p50_ms: float
    decode_step_p90_ms: float
    tok_s_per_user_p50: float
    output_tok_s: float
    input_tok_s: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    e2e_p50_ms: float
    timeline_p50_ms: dict[str, float]  # the server's per-request stages (ms)
    # p50 over requests of their decode stage in the API process / tokens after the first
    server_decode_step_p50_ms: float | None = None

    def row(self) -> str:
        return (
            f"| {self.concurrency} | {self.requests} | {self.decode_step_p50_ms:.2f} "
            f"| {self.tok_s_per_user_p50:.1f} | {self.output_tok_s:.1f} | {self.ttft_p50_ms:.2f} |"
        )


async def run_level(
    client,
    rnd: int,
    concurrency: int,
    n_requests: int,
    input_len: int,
    output_len: int,
    vocab: int,
    rng: random.Random,
) -> LevelResult:
    from breakgraph.bench.http_client import percentile, random_ids, stage_medians

    prompts = [random_ids(rng, input_len, vocab) for _ in range(n_requests)]
    pending = iter(prompts)
    results = []

    async def worker() -> None:
        for prompt in pending:  # a shared iterator: each worker takes the next prompt
            results.append(await client.generate(prompt, output_len))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall_s = time.perf_counter() - t0
    itl = [t for r in results for t in r.itl_ms]
    rates = [r.tok_s for r in results if r.tok_s is not None]
    ttft = [r.ttft_ms for r in results]
    return LevelResult(
        round=rnd,
        concurrency=concurrency,
        requests=len(results),
        wall_s=wall_s,
        decode_step_p50_ms=percentile(itl, 50),
        decode_step_p90_ms=percentile(itl, 90),
        tok_s_per_user_p50=percentile(rates, 50),
        output_tok_s=sum(r.completion_tokens for r in results) / wall_s,
        input_tok_s=sum(r.prompt_tokens for r in results) / wall_s,
        ttft_p50_ms=percentile(ttft, 50),
        ttft_p90_ms=percentile(ttft, 90),
        e2e_p50_ms=percentile([r.e2e_ms for r in results], 50),
        timeline_p50_ms=stage_medians([r.timeline_ms for r in results if r.timeline_ms]),
        server_decode_step_p50_ms=server_decode_step_p50(results),
    )


def server_decode_step_p50(results) -> float | None:
    """The p50 over requests of the server's decode stage per token after the first (the
    API process's view of the engine's pace), or None without timelines."""
    from breakgraph.bench.http_client import percentile

    steps = [
        r.timeline_ms["decode"] / (r.completion_tokens - 1)
        for r in results
        if r.completion_tokens > 1 and "decode" in r.timeline_ms
    ]
    return percentile(steps, 50) if steps else None


async def run_serving(
    url: str,
    concurrencies: list[int],
    input_len: int,
    output_len: int,
    requests_per_level: int | None = None,
    rounds: int = 2,
    seed: int = 0,
    on_level=None,
    client_factory=None,
) -> list[LevelResult]:
    """Every level of every round; ``on_level(round, level_or_None)`` reports progress
    (None: a round starts). ``client_factory``: as ``prefill.run_prefill``'s."""
    from breakgraph.bench.http_client import BenchError, ServerClient, random_ids

    if min(concurrencies, default=0) < 1 or min(input_len, output_len, rounds) < 1:
        raise BenchError("--concurrency, --input-len, --output-len and --rounds must be positive")
    rng = random.Random(seed)
    levels: list[LevelResult] = []
    async with (client_factory or ServerClient)(url, max_connections=max(concurrencies)) as client:
        vocab = await client.vocab_size()
        await client.generate(random_ids(rng, input_len, vocab), min(output_len, 16))  # warm-up
        for rnd in range(1, rounds + 1):
            order = concurrencies if rnd % 2 else list(reversed(concurrencies))
            if on_level:
                on_level(rnd, None)
            for c in order:
                await client.flush_cache()
                n = requests_per_level if requests_per_level else 4 * c
                level = await run_level(
                    client, rnd, c, max(n, c), input_len, output_len, vocab, rng
                )
                levels.append(level)
                if on_level:
                    on_level(rnd, level)
    return levels


def run_serving_bench(args) -> dict:
    from breakgraph.bench.http_client import BenchError
    from breakgraph.bench.plot import require_plot

    require_plot(args.plot)
    print(
        f"serving: {args.url}, input {args.input_len} tok, output {args.output_len} tok, "
        f"concurrency {' '.join(map(str, args.concurrency))}, {args.rounds} rounds",
        flush=True,
    )

    def on_level(rnd: int, level: LevelResult | None) -> None:
        print(f"\nround {rnd}\n{HEADER}" if level is None else level.row(), flush=True)

    try:
        levels = asyncio.run(
            run_serving(
                args.url,
                args.concurrency,
                args.input_len,
                args.output_len,
                requests_per_level=args.requests_per_level,
                rounds=args.rounds,
                seed=args.seed,
                on_level=on_level,
            )
        )
    except BenchError as e:
        raise SystemExit(f"error: {e}") from None
    from breakgraph.bench.http_client import format_stages

    print("\nserver timeline p50 per request (ms)")
    for lv in levels:
        step = lv.server_decode_step_p50_ms
        server = "" if step is None else f"server decode step p50 {step:.2f} ms; "
        print(f"  round {lv.round}, concurrency {lv.concurrency}: {server}"
              f"{format_stages(lv.timeline_p50_ms)}")  # fmt: skip
    result = {
        "bench": "serving",
        "url": args.url,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "concurrency": args.concurrency,
        "requests_per_level": args.requests_per_level,
        "rows": [asdict(lv) for lv in levels],
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        from breakgraph.bench.plot import plot_serving

        plot_serving([result], args.plot)
    return result
