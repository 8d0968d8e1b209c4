"""Where a prefill step's graph arm spends the time its floor does not: one request's step
(``bench step``'s engine and batch), each arm profiled over a few calls with a sync before
each, as ``bench step`` times it. Per arm: the wall time, the GPU's span (first kernel's start
to the last one's end), its busy time (kernels and copies, overlaps merged), the delay from
the call to the first kernel, and the kernels by total time, so that a gap between an arm
and the floor reads as host time before the GPU starts, idle gaps inside, or extra kernels.

    python benchmarks/step_gap.py --model qwen3-0.6b --tokens 256 [--prefix 0] [--calls 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile


def gpu_events(prof) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every kernel and memcpy/memset on the device."""
    out = []
    for e in prof.events():
        # the device's kernels and copies (the "call" annotation has a device range too)
        if e.device_type == torch.autograd.DeviceType.CUDA and e.name != "call":
            start = e.time_range.start
            out.append((start, start + e.time_range.elapsed_us(), e.name))
    return sorted(out)


def busy_us(events: list[tuple[float, float, str]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e, _ in events:
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def profile_arm(fn, calls: int) -> dict:
    sync = torch.cuda.synchronize
    for _ in range(3):
        fn()
    sync()
    walls, spans, busies, delays = [], [], [], []
    by_name: dict[str, float] = defaultdict(float)
    for _ in range(calls):
        sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            with torch.profiler.record_function("call"):
                t0 = time.perf_counter()
                fn()
                sync()
                walls.append((time.perf_counter() - t0) * 1e3)
        cpu = torch.autograd.DeviceType.CPU
        call = next(e for e in prof.events() if e.name == "call" and e.device_type == cpu)
        ev = gpu_events(prof)
        spans.append((ev[-1][1] - ev[0][0]) / 1e3)
        busies.append(busy_us(ev) / 1e3)
        delays.append((ev[0][0] - call.time_range.start) / 1e3)
        for s, e, name in ev:
            by_name[name] += (e - s) / calls
    return {
        "wall": statistics.median(walls),
        "span": statistics.median(spans),
        "busy": statistics.median(busies),
        "delay": statistics.median(delays),
        "kernels": sorted(by_name.items(), key=lambda kv: -kv[1]),
    }


def main() -> None:
    from breakgraph.bench.step import StepBench

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--prefix", type=int, default=0)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--top", type=int, default=8)
    a = p.parse_args()
    sb = StepBench(a.model, a.tokens, a.prefix, "cuda")
    runner, batch = sb.engine.runner, sb.batch(a.tokens, a.prefix)
    graphs = runner.prefill_graphs

    @torch.inference_mode()
    def breakable():
        return graphs.run(batch, whole=False)

    arms = {"graphs": lambda: runner.forward(batch), "breakable": breakable}
    arms["floor"] = runner.capture_whole(batch)
    print(f"{a.model} N={a.tokens} P={a.prefix}: whole bucket {graphs.whole_bucket(batch)}")
    results = {name: profile_arm(fn, a.calls) for name, fn in arms.items()}
    print(f"  {'arm':<10} {'wall':>7} {'span':>7} {'busy':>7} {'delay':>7}  (ms, medians)")
    for name, r in results.items():
        print(f"  {name:<10} {r['wall']:7.3f} {r['span']:7.3f} {r['busy']:7.3f} {r['delay']:7.3f}")
    floor = dict(results["floor"]["kernels"])
    for name, r in results.items():
        if name == "floor":
            continue
        print(f"  {name}: kernels by time (us per call; floor's beside)")
        for k, us in r["kernels"][: a.top]:
            print(f"    {us:9.1f} {floor.get(k, 0.0):9.1f}  {k[:90]}")
        extra = [(k, us) for k, us in r["kernels"] if k not in floor]
        for k, us in extra[: a.top]:
            print(f"    {us:9.1f}   not in floor  {k[:90]}")


if __name__ == "__main__":
    main()
