"""Does a batch-1 decode graph lose its launch latency when captured as two graphs? (#19)

A synced decode step at batch 1 spends about 0.1 ms before the GPU starts: the host submits
the whole graph (~260-330 kernels) before any of it runs (H200, seventeenth session:
``runner.forward`` returns after 0.13-0.15 ms, and the GPU span from an event recorded
before the call is 0.09-0.10 ms longer than a back-to-back step). Captured as two graphs split
before layer K, the GPU could start on the first few layers while the host submits the rest.

This times, in one process, the engine's one-graph capture against two-graph captures split
before layer K (the same static inputs, filled from a real 1K-context step; replays only, no
input copies): synced and back to back, and the logits' largest difference. The second
capture begins in a pre-hook of layer K, in the first one's memory pool.
Result (H200, eighteenth session; h200-2026-12-02c/decode/split_launch.log): no gain. Qwen3-0.6B
synced 0.839 ms one graph, 0.836-0.839 split before layer 1, 3 or 6; Llama-3.1-8B 4.157 against
4.153-4.156. That host's synced step was only 0.016 ms over back to back: little to take.
Usage: python benchmarks/decode_split_launch.py [MODEL ...]   (default qwen3-0.6b llama-3.1-8b)
"""

from __future__ import annotations

import sys

import torch

from breakgraph.bench.decode import decode_batch, decode_engine
from breakgraph.bench.step import time_ms


def split_capture(graphs, layers, k: int):
    """The bank's batch-1 forward captured as two graphs, the second from layer ``k`` on:
    (replay both, the captured logits)."""
    pool = torch.cuda.graph_pool_handle()
    first, second = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()

    def switch(module, args):
        first.capture_end()
        second.capture_begin(pool=pool)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    torch.cuda.synchronize()
    hook = layers[k].register_forward_pre_hook(switch)
    try:
        with torch.cuda.stream(stream):
            first.capture_begin(pool=pool)
            out = graphs._forward(**graphs.bank.views(1))
            second.capture_end()
    finally:
        hook.remove()
    torch.cuda.synchronize()

    def replay() -> None:
        first.replay()
        second.replay()

    return replay, out


def timed(fn) -> tuple[float, float]:
    """(median ms with a sync around each call, mean ms back to back)."""
    return time_ms(fn, 30), time_ms(fn, 50, back_to_back=True)


def main(models: list[str]) -> None:
    for model in models:
        eng, rows, slots = decode_engine(model, "cuda", 1, 1024)
        graphs = eng.runner.decode_graphs
        layers = eng.runner.model.model.layers
        one = graphs.bank.graphs[1]
        with torch.inference_mode():
            graphs.run(decode_batch(eng, rows, slots, 1, 1024))  # static inputs: a real step
            torch.cuda.synchronize()
            ref = one.replay().clone()
            synced, b2b = timed(one.replay)
            print(f"{model} one graph: synced {synced:.3f} b2b {b2b:.3f}", flush=True)
            for k in (1, 3, 6):
                replay, out = split_capture(graphs, layers, k)
                replay()
                torch.cuda.synchronize()
                diff = (out.float() - ref.float()).abs().max().item()
                synced, b2b = timed(replay)
                print(f"{model} split before layer {k}: synced {synced:.3f} b2b {b2b:.3f} "
                      f"dlogit {diff:.2g}", flush=True)  # fmt: skip
        eng.shutdown()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:] or ["qwen3-0.6b", "llama-3.1-8b"])
