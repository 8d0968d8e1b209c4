"""A light streaming client: C concurrent /generate streams (128 random ids in, 256 tokens
out), counting each request's SSE events and bytes, parsing no JSON, so that the client is
not the bound at high concurrency (``bench serving``'s is, since it parses every event).

Usage: python events_client.py URL CONCURRENCY
"""

from __future__ import annotations

import asyncio
import random
import sys
import time

import aiohttp
import orjson


async def one(session: aiohttp.ClientSession, url: str, rng: random.Random) -> tuple[int, int]:
    body = {
        "input_ids": [rng.randrange(1000, 100000) for _ in range(128)],
        "sampling_params": {"max_new_tokens": 256, "temperature": 0, "ignore_eos": True},
        "stream": True,
    }
    events = size = 0
    headers = {"content-type": "application/json"}
    async with session.post(url + "/generate", data=orjson.dumps(body), headers=headers) as r:
        async for line in r.content:
            if line.startswith(b"data:"):
                events += 1
                size += len(line)
    return events, size


async def main(url: str, concurrency: int) -> None:
    rng = random.Random(0)
    connector = aiohttp.TCPConnector(limit=concurrency + 4)
    async with aiohttp.ClientSession(connector=connector, read_bufsize=1 << 20) as session:
        await one(session, url, rng)  # warm-up
        start = time.perf_counter()
        got = await asyncio.gather(*(one(session, url, rng) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    events = sorted(e for e, _ in got)
    sizes = sorted(b for _, b in got)
    print(f"C={concurrency}: events per request p50 {events[len(events) // 2]} (min {events[0]}, "
          f"max {events[-1]}), bytes per request p50 {sizes[len(sizes) // 2]}, wall {wall:.2f} s, "
          f"{concurrency * 256 / wall:.0f} tok/s (no parse)")  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
