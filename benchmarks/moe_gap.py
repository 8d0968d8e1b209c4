"""The MoE layer (qwen3-30b-a3b expert shapes) and its dense reference timed four ways in one
process, twice each: triton's do_bench (an L2 flush before each call), back to back (events
around 50 calls), synced per call, and the profiler's per-kernel sum and span per call. It
asks whether the graph's time beyond its kernels' sum is gaps inside the graph (it was not:
the kernels themselves ran slower as the GPU warmed, dense's as much; benchmarks/README.md,
sixteenth session).
Usage: python benchmarks/moe_gap.py [M=8192]"""

from __future__ import annotations

import statistics
import sys

import torch

from breakgraph.bench import moe as bm
from breakgraph.bench.decode import profile_calls
from breakgraph.bench.kernels import bench_ms


def event_ms(fn, calls: int) -> float:
    """GPU ms between two events around ``calls`` calls, per call."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(calls):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / calls


def back_to_back(fn, calls: int = 50) -> float:
    event_ms(fn, 5)
    return event_ms(fn, calls)


def synced(fn, calls: int = 30) -> float:
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        times.append(event_ms(fn, 1))
    return statistics.median(times)


def profiled(fn, calls: int = 20) -> tuple[list[tuple[str, float]], float]:
    """Mean ms of each kernel of one call, and the span of a call (its kernels and gaps)."""
    prof = profile_calls(fn, calls)
    ks = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    per = len(ks) // calls
    names = [(ks[i].name[:22], sum(k.device_time for k in ks[i::per]) / calls / 1e3) for i in range(per)]  # fmt: skip
    span = (ks[-1].time_range.end - ks[per].time_range.start) / (calls - 1) / 1e3
    return names, span


def main() -> None:
    m = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    s = bm.expert_shapes("qwen3-30b-a3b")
    layer = bm.Layer(m, s)
    arms = [("moe graph", bm.graphed(layer)), ("dense", bm.dense_reference(m, s))]
    for name, fn in arms * 2:
        parts, span = profiled(fn)
        total = sum(ms for _, ms in parts)
        print(f"{name:10s} do_bench {bench_ms(fn):.3f}  b2b {back_to_back(fn):.3f}  "
              f"synced {synced(fn):.3f}  prof kernels {total:.3f} prof span/call {span:.3f}")  # fmt: skip
        print("    " + "  ".join(f"{k} {ms:.3f}" for k, ms in parts), flush=True)


if __name__ == "__main__":
    main()
