"""``bench host api``: CPU time the API process spends per streamed output token, at a
concurrency: the host work around the engine that no graph hides (routing a step's outputs
to each request's task, detokenizing, one SSE event per request per step). At concurrency C
the API process has C events to produce per engine step: C x this cost must stay below the
step's time.

It starts ``breakgraph serve`` on the CPU from a tree (this one; with ``--ref COMMIT`` that
commit's too, interleaved over ``--rounds``, every other round in reverse order), runs
closed-loop streamed requests (``bench serving``'s client) and reads both processes' CPU time
from /proc around them. The engine's is printed too; on the CPU it is mostly the forward. A
fast engine step shows the API's cost best: the default model is a two-layer dummy one.
``--flags``/``--ref-flags``: more ``serve`` flags for this tree's/the ref's server (``--ref
HEAD --flags=...``: one flag against its absence).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def start_server(tree: Path, args, model: str, port: int, flags: str = ""):
    cmd = [sys.executable, "-m", "breakgraph.cli", "serve", "--port", str(port),
           "--device", "cpu", "--max-running-requests", str(args.concurrency),
           "--log-level", "warning", "--model-path", model, "--load-format", "dummy",
           *flags.split()]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"error: the server from {tree} exited ({proc.returncode})")
        try:
            return proc, url, get_json(url + "/get_server_info")
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"error: the server from {tree} did not start in 300 s")


async def load(url: str, concurrency: int, requests: int, input_len: int, output_len: int):
    from breakgraph.bench.http_client import ServerClient, random_ids
    from breakgraph.bench.serving import run_level

    rng = random.Random(0)
    async with ServerClient(url, max_connections=concurrency) as client:
        vocab = await client.vocab_size()
        await client.generate(random_ids(rng, input_len, vocab), 4)  # warm-up
        return await run_level(client, 1, concurrency, requests, input_len, output_len,
                               vocab, rng)  # fmt: skip


def measure(tree: Path, args, model: str, flags: str = "") -> dict[str, float]:
    proc, url, info = start_server(tree, args, model, free_port(), flags)
    requests = args.requests or 128
    try:
        epid = info["engine_pid"]  # /get_server_info's
        asyncio.run(load(url, args.concurrency, args.concurrency, args.input_len, 4))  # warm up
        api0, eng0, t0 = cpu_s(proc.pid), cpu_s(epid), time.perf_counter()
        level = asyncio.run(load(url, args.concurrency, requests, args.input_len, args.output_len))
        wall = time.perf_counter() - t0
        tokens = level.output_tok_s * level.wall_s
        return {
            "api_us_per_token": (cpu_s(proc.pid) - api0) / tokens * 1e6,
            "engine_us_per_token": (cpu_s(epid) - eng0) / tokens * 1e6,
            "output_tok_s": level.output_tok_s,
            "api_share": (cpu_s(proc.pid) - api0) / wall,
        }
    finally:
        proc.terminate()
        proc.wait(60)
