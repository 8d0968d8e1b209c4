"""Serving-shape warm-up: internal requests through the scheduler and runner that cover
every shape class selecting a different kernel variant, so nothing compiles in traffic."""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

from breakgraph.engine.request import SamplingParams
from breakgraph.kernels import fused_moe, skinny_gemm
from breakgraph.kernels.extend_attention import DIRECT_MIN_KEYS

logger = logging.getLogger(__name__)


@dataclass
class WarmupReport:
    requests: int
    seconds: float
    compiles: int


def _run(engine, prompts: list[list[int]], params: list[SamplingParams]) -> None:
    rids = [
        engine.add_request(p, sp, rid=f"warmup-{random.getrandbits(48):x}")
        for p, sp in zip(prompts, params, strict=True)
    ]
    pending = set(rids)
    while pending:
        for out in engine.step():
            if out.finished:
                pending.discard(out.rid)


def small_row_classes(most: int = 4) -> set[int]:
    """The row bounds of up to ``most`` rows in the kernels' per-M config tables (the skinny
    GEMM's, the MoE GEMV path's): a prompt of each size compiles each class's variant."""
    bounds = {m for entries in skinny_gemm.active_table().values() for m, _ in entries}
    bounds |= {m for m, _ in fused_moe.GEMV_TABLE}
    return {m for m in bounds if m <= most}


def warmup_serving_shapes(engine, seed: int = 0) -> WarmupReport:
    """Run the shape classes (see the module docstring); flush the cache; raise if it cannot."""
    from breakgraph.kernels import jit_watch

    rng = random.Random(seed)
    vocab = engine.vocab_size
    cap = engine.allocator.capacity
    chunk = engine.args.chunked_prefill_size
    runner = engine.runner
    before = jit_watch.stats().total
    start = time.perf_counter()

    def rand(n: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(n)]

    greedy = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(
        max_new_tokens=2, temperature=0.7, top_p=0.9, top_k=50, min_p=0.05, ignore_eos=True
    )
    seeded = SamplingParams(max_new_tokens=2, temperature=1.0, seed=1, ignore_eos=True)
    sent = 0

    def go(prompts, params=None):
        nonlocal sent
        prompts = [p for p in prompts if 0 < len(p) < min(cap, engine.context_len) - 4]
        if prompts:
            _run(engine, prompts, params or [greedy] * len(prompts))
            sent += len(prompts)

    # prefill sizes: every graph bucket, eager sizes around and above them, odd sizes, and
    # the row classes of the skinny GEMM's and the MoE GEMV path's tables up to 4 rows (each
    # its own compile), which an eager prefill of a few tokens takes
    buckets = runner.prefill_graphs.bank.sizes if runner.prefill_graphs is not None else []
    sizes = sorted(set(buckets) | small_row_classes()
                   | {1, 7, 16, 33, 100, 255, chunk, min(chunk + 1, cap // 2)})  # fmt: skip
    for n in sizes:
        go([rand(min(n, chunk))])
    # prefix hits with 1-token, multiple-of-16, odd and long extends, over a short, a long
    # and a very long prefix (attention splits the keys of a long prefix; past
    # DIRECT_MIN_KEYS a small grid takes the split kernel unsplit: other kernel variants)
    longest = min(2 * DIRECT_MIN_KEYS, cap // 2, engine.context_len - 1100)
    for prefix in (600, 4096, longest) if longest > 4096 else (600, 4096):
        base = rand(prefix if prefix == longest else min(prefix, cap // 8))
        go([base])
        for e in (1, 16, 7, 256, min(1000, cap // 8), min(3000, cap // 8)):
            go([base + rand(e)])  # one at a time: a lone request's grid picks the split path
    # a chunked prompt (longer than one prefill step), if the pool holds it
    if 2 * chunk + 10 < min(cap, engine.context_len):
        go([rand(chunk + chunk // 2)])
    # concurrent prefills of mixed sizes, greedy and sampled
    go([rand(n) for n in (5, 64, 300, 17)], [greedy, sampled, seeded, sampled])
    # every decode batch size with a graph, and sizes above the largest at doubling steps:
    # with graphs those replay in pieces (their sampling and read-back still see the whole
    # batch); without, eager decode (its kernel's split count, a compile-time constant,
    # halves as bs doubles)
    decode_sizes = runner.decode_graphs.bank.sizes if runner.decode_graphs is not None else [1]
    max_run = engine.max_running_requests
    eager_sizes, bs = set(), max(decode_sizes) + 1
    while bs <= max_run:
        eager_sizes.add(bs)
        bs *= 2
    for bs in sorted(set(decode_sizes) | eager_sizes | {max_run}):
        if bs * 40 < cap:
            go(
                [rand(8 + i % 5) for i in range(bs)],
                [greedy if i % 2 else sampled for i in range(bs)],
            )
    if not engine.flush_cache():
        raise RuntimeError("warm-up could not flush the prefix cache: requests still hold it")
    report = WarmupReport(sent, time.perf_counter() - start, jit_watch.stats().total - before)
    logger.info(
        "serving-shape warm-up: %d requests in %.1f s, %d kernel compilations",
        report.requests,
        report.seconds,
        report.compiles,
    )
    return report
