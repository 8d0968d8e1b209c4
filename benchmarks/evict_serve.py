"""TTFT with the prefix cache full (issue 14): every new prompt's allocation evicts.

A server that has run a while holds every finished request's KV in its radix tree, until
the pool is full. This fills each server's pool with distinct --tokens-id prompts (one
output token each, --concurrency at once), then sends --requests more one at a time, each
of which evicts, and prints their TTFT p50 and the server's stages (the eviction runs in
"schedule"). Several servers: rounds alternate which one goes first. Size the pool with
``--max-total-tokens`` on the servers: the fill sends 1.1x what it holds (/get_server_info).
Usage: python benchmarks/evict_serve.py URL [URL ...] [--tokens 64] [--requests 25] [--rounds 4]
(two servers of two trees: `OLD=<tree> bash benchmarks/h200_serve.sh evictab`)"""

from __future__ import annotations

import argparse
import asyncio
import random

import aiohttp

from breakgraph.bench.http_client import (
    ServerClient,
    format_stages,
    median,
    random_ids,
    stage_medians,
)


async def pool_tokens(url: str) -> int:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/get_server_info") as r:
        info = await r.json()
    return int(info["max_total_num_tokens"])


async def fill(url: str, tokens: int, concurrency: int, rng: random.Random) -> int:
    n = int(await pool_tokens(url) * 1.1) // tokens
    async with ServerClient(url, max_connections=concurrency) as c:
        await c.flush_cache()
        vocab = await c.vocab_size()
        for first in range(0, n, concurrency):
            wave = min(concurrency, n - first)
            await asyncio.gather(
                *(c.generate(random_ids(rng, tokens, vocab), 1) for _ in range(wave))
            )
    return n


async def one_round(url: str, tokens: int, requests: int, rng: random.Random):
    async with ServerClient(url, max_connections=1) as c:
        vocab = await c.vocab_size()
        return [await c.generate(random_ids(rng, tokens, vocab), 1) for _ in range(requests)]


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("urls", nargs="+")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=25)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    rng = random.Random(0)
    for url in args.urls:
        n = await fill(url, args.tokens, args.concurrency, rng)
        print(f"{url}: filled with {n} prompts of {args.tokens} ids", flush=True)
    for r in range(args.rounds):
        order = args.urls if r % 2 == 0 else args.urls[::-1]
        for url in order:
            res = await one_round(url, args.tokens, args.requests, rng)
            ttft = median([x.ttft_ms for x in res])
            stages = format_stages(stage_medians([x.timeline_ms for x in res]))
            print(f"round {r} {url}: TTFT p50 {ttft:.2f} ms  {stages}", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
