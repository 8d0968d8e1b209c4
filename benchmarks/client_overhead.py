"""How much of a measured TTFT is the client's: one server, the same streamed /generate
requests (32 new token ids by default, 1 output token) sent in turn through httpx, aiohttp (the benches'
client) and a raw asyncio socket; TTFT p50 of each after a warm-up.
Usage: python benchmarks/client_overhead.py [--url http://127.0.0.1:30000] [--requests 60]"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from urllib.parse import urlsplit

import aiohttp
import httpx
import orjson

HEADERS = {"content-type": "application/json"}


async def via_httpx(client: httpx.AsyncClient, content: bytes) -> float:
    t0, ttft = time.perf_counter(), None
    async with client.stream("POST", "/generate", content=content, headers=HEADERS) as r:
        async for line in r.aiter_lines():
            if ttft is None and line.startswith("data:"):
                ttft = time.perf_counter() - t0
    return ttft


async def via_aiohttp(session: aiohttp.ClientSession, content: bytes) -> float:
    t0, ttft = time.perf_counter(), None
    async with session.post("/generate", data=content, headers=HEADERS) as r:
        async for line in r.content:
            if ttft is None and line.startswith(b"data:"):
                ttft = time.perf_counter() - t0
    return ttft


async def via_socket(conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], content: bytes):
    reader, writer = conn
    t0, ttft = time.perf_counter(), None
    head = b"POST /generate HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
    writer.write(head + b"Content-Length: %d\r\n\r\n" % len(content) + content)
    while (line := await reader.readline()) != b"0\r\n":  # the chunked body's last chunk
        if ttft is None and line.startswith(b"data:"):
            ttft = time.perf_counter() - t0
    await reader.readline()
    return ttft


async def main(url: str, requests: int, tokens: int) -> None:
    rng = random.Random(0)
    parts = urlsplit(url)
    async with (
        httpx.AsyncClient(base_url=url) as hc,
        aiohttp.ClientSession(base_url=url) as session,
    ):
        conn = await asyncio.open_connection(parts.hostname, parts.port)
        ways = {"httpx": (via_httpx, hc), "aiohttp": (via_aiohttp, session),
                "socket": (via_socket, conn)}  # fmt: skip
        ttft: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(requests):
            for name, (fn, handle) in ways.items():
                # a prompt of its own: the same one again would be a prefix-cache hit
                body = {"input_ids": [rng.randrange(1000, 30000) for _ in range(tokens)],
                        "stream": True, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}  # fmt: skip
                ttft[name].append(await fn(handle, orjson.dumps(body)))
        conn[1].close()
    warm = requests // 6
    for name, xs in ttft.items():
        print(f"{name:>8}: TTFT p50 {statistics.median(xs[warm:]) * 1e3:.3f} ms")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--tokens", type=int, default=32, help="prompt length (new token ids)")
    args = ap.parse_args()
    asyncio.run(main(args.url, args.requests, args.tokens))
