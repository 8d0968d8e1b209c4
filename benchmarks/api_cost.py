"""CPU time the API process spends per streamed output token, at a concurrency: the host
work around the engine that no graph hides (routing a step's outputs to each request's task,
detokenizing, one SSE event per request per step). At concurrency C, the API process has
C events to produce per engine step: C x this cost must stay below the step's time.

It starts ``breakgraph serve`` on the CPU from a tree (this one; with ``--ref COMMIT`` that
commit's too, from ``git archive``, interleaved over ``--rounds``, every other round in
reverse order), runs closed-loop streamed requests (``bench serving``'s client) and reads
the API process's CPU time from /proc around them. The engine process's CPU time per token is printed too; on the CPU it is
mostly the forward.

Usage: python benchmarks/api_cost.py [--model-path P] [--concurrency 64] [--output-len 64]
       [--requests 128] [--ref COMMIT] [--rounds 2] [--flags="..."] [--ref-flags="..."]
(``--flags``/``--ref-flags``: more ``serve`` flags for this tree's/the ref's server, e.g.
``--ref HEAD --flags=--incremental-streaming-output``: one flag against its absence)
(a fast engine step shows the API's cost best: a tiny config of --load-format dummy, e.g.
``--model-path DIR`` with benchmarks/decode_host.py's TINY as DIR/config.json)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from decode_host import in_turn, trees  # benchmarks/ is the script's path

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


def start_server(tree: Path, a, port: int, flags: str = ""):
    cmd = [sys.executable, "-m", "breakgraph.cli", "serve", "--port", str(port),
           "--device", "cpu", "--max-running-requests", str(a.concurrency),
           "--log-level", "warning", *flags.split()]  # fmt: skip
    if a.model_path:
        cmd += ["--model-path", a.model_path, "--load-format", a.load_format]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server from {tree} exited ({proc.returncode})")
        try:
            info = get_json(url + "/get_server_info")
            return proc, url, info
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the server from {tree} did not start in 300 s")


async def load(url: str, concurrency: int, requests: int, input_len: int, output_len: int):
    from breakgraph.bench.http_client import ServerClient, random_ids
    from breakgraph.bench.serving import run_level

    rng = random.Random(0)
    async with ServerClient(url, max_connections=concurrency) as client:
        vocab = await client.vocab_size()
        await client.generate(random_ids(rng, input_len, vocab), 4)  # warm-up
        return await run_level(client, 1, concurrency, requests, input_len, output_len,
                               vocab, rng)  # fmt: skip


def measure(tree: Path, a, flags: str = "") -> dict[str, float]:
    proc, url, info = start_server(tree, a, free_port(), flags)
    try:
        epid = info["engine_pid"]  # /get_server_info's
        asyncio.run(load(url, a.concurrency, a.concurrency, a.input_len, 4))  # warm both up
        api0, eng0, t0 = cpu_s(proc.pid), cpu_s(epid), time.perf_counter()
        level = asyncio.run(load(url, a.concurrency, a.requests, a.input_len, a.output_len))
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default="", help="default: the server's own default model")
    ap.add_argument("--load-format", default="dummy", choices=["auto", "dummy"])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--input-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--ref", help="a commit to measure against (git archive of it)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--flags", default="", help="more serve flags for this tree's server")
    ap.add_argument("--ref-flags", default="", help="more serve flags for the ref's server")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        arms = trees(a.ref, Path(tmp))
        got: dict[str, list[dict[str, float]]] = {name: [] for name in arms}
        for rnd in range(a.rounds):
            for name, tree in in_turn(arms, rnd):
                got[name].append(measure(tree, a, a.flags if name == "this" else a.ref_flags))
                print(name, json.dumps({k: round(v, 2) for k, v in got[name][-1].items()}),
                      flush=True)  # fmt: skip
        med = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in got.items()}
        for name, m in med.items():
            print(f"{name:5s} concurrency {a.concurrency}: API {m['api_us_per_token']:.1f} µs "
                  f"CPU per output token (busy {m['api_share']:.0%}), engine "
                  f"{m['engine_us_per_token']:.1f} µs, {m['output_tok_s']:.0f} tok/s")  # fmt: skip
        if a.ref:
            ratio = med["this"]["api_us_per_token"] / med["ref"]["api_us_per_token"]
            print(f"API CPU per output token, this/ref: {ratio:.3f}x")


if __name__ == "__main__":
    main()
