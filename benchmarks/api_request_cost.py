"""CPU time per request of a running server's two processes, and the TTFT a raw socket sees:
sequential streamed /generate requests of PROMPT new token ids and one output token, each
on one kept-alive connection (no client library in the timing). The API process's CPU per
request is the host time a short request costs it, most of it on the request's TTFT.
Usage: python benchmarks/api_request_cost.py --port 30000 [--requests 600] [--tokens 16]
[--vocab 1000] (prompt ids are drawn below --vocab: a tiny model's vocabulary fits)."""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess

import orjson
from client_overhead import via_socket  # benchmarks/, the script's own folder


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_pids(port: int) -> tuple[int, list[int]]:
    """The API process serving ``port`` and its children (the engine among them)."""
    api = int(subprocess.check_output(["pgrep", "-f", f"serve.*--port {port}"]).split()[0])
    kids = subprocess.run(["pgrep", "-P", str(api)], capture_output=True, text=True).stdout
    return api, [int(p) for p in kids.split()]


async def run(port: int, requests: int, tokens: int, vocab: int) -> None:
    api, engine = server_pids(port)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    rng = random.Random(0)

    async def one() -> float:
        body = orjson.dumps({"input_ids": [rng.randrange(1, vocab) for _ in range(tokens)],
                             "stream": True,
                             "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}})  # fmt: skip
        return await via_socket((reader, writer), body)

    for _ in range(50):  # warm-up
        await one()
    api0, eng0 = cpu_s(api), sum(cpu_s(p) for p in engine)
    ttfts = [await one() for _ in range(requests)]
    api1, eng1 = cpu_s(api), sum(cpu_s(p) for p in engine)
    writer.close()
    print(f"socket TTFT p50 {statistics.median(ttfts) * 1e3:.3f} ms, API CPU per request "
          f"{(api1 - api0) / requests * 1e6:.0f} us, engine side {(eng1 - eng0) / requests * 1e6:.0f} us")  # fmt: skip


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=1000)
    args = ap.parse_args()
    asyncio.run(run(args.port, args.requests, args.tokens, args.vocab))
