"""Where a synced batch-1 decode graph step's time beyond a back-to-back one goes (#19).

Per model and context, the engine's graph step (``runner.forward``: the input copies and the
replay) timed four ways, medians over 30 synced calls: the wall time with a sync after; the
host time until the call returns (the copies and the graph's submission); the GPU span
between events recorded before and after the call (the GPU waits for the submission); and,
back to back, the step and the bare replay. ``benchmarks/h200-2026-12-02b/decode/
synced_gap.log``: the host submits for 0.13-0.15 ms, the GPU span is 0.09-0.10 ms over
back to back, so most of a synced step's excess is the graph's submission.
Usage: python benchmarks/decode_sync_gap.py
"""

from __future__ import annotations

import statistics
import time

import torch

from breakgraph.bench.decode import decode_batch, decode_engine
from breakgraph.bench.step import time_ms
from breakgraph.kernels import decode_attention


def measure(model: str, ctx: int) -> str:
    eng, rows, slots = decode_engine(model, "cuda", 1, ctx)
    runner = eng.runner
    batch = decode_batch(eng, rows, slots, 1, ctx)

    def step():
        return runner.forward(batch)

    with torch.inference_mode():
        for _ in range(5):
            step()
        launch, span, wall = [], [], []
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(30):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            e0.record()
            step()
            t1 = time.perf_counter()
            e1.record()
            torch.cuda.synchronize()
            launch.append((t1 - t0) * 1e3)
            wall.append((time.perf_counter() - t0) * 1e3)
            span.append(e0.elapsed_time(e1))
        b2b = time_ms(step, 50, back_to_back=True)
        graphs = runner.decode_graphs
        long = batch.seq_lens_cpu[0] >= decode_attention.LONG_CONTEXT_MIN_TOKENS
        bank = graphs.long_bank if long else graphs.bank
        graph = bank.graphs[1]
        e0.record()
        for _ in range(50):
            graph.replay()
        e1.record()
        torch.cuda.synchronize()
    eng.shutdown()
    torch.cuda.empty_cache()
    m = statistics.median
    return (f"{model} ctx={ctx}: wall {m(wall):.3f}  host launch {m(launch):.3f}  event span "
            f"{m(span):.3f}  b2b {b2b:.3f}  replay-only b2b {e0.elapsed_time(e1) / 50:.3f}")  # fmt: skip


if __name__ == "__main__":
    for model in ("llama-3.1-8b", "qwen3-0.6b"):
        for ctx in (1024, 8192):
            print(measure(model, ctx), flush=True)
