"""How the in-process benches time and profile a call, and write their results."""

from __future__ import annotations

import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict

import torch

LAUNCH_EVENTS = (
    "cudaLaunchKernel",
    "cuLaunchKernel",
    "cudaGraphLaunch",
    "cuLaunchKernelEx",
    "cudaLaunchKernelExC",
)


def resolve_device(name: str) -> str:
    """``auto``: CUDA where there is a GPU, else the CPU."""
    if name != "auto":
        return name
    return "cuda" if torch.cuda.is_available() else "cpu"


def time_ms(
    fn: Callable[[], object], reps: int, warmup: int = 3, back_to_back: bool = False
) -> float:
    """Median wall time of ``fn`` with a device sync before and after each call; with
    ``back_to_back`` the mean over ``reps`` calls with no sync between them."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    if back_to_back:
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        return (time.perf_counter() - start) * 1e3 / reps
    samples = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def count_launches(fn: Callable[[], object]) -> int | None:
    """Kernels (and graph launches) one call issues, counted by the profiler; None on the CPU."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.name in LAUNCH_EVENTS)


def profile_calls(fn: Callable[[], object], reps: int):
    """The torch profiler's record (CUDA activity) of ``reps`` calls of ``fn`` after one
    untimed call: graph replays included, the profiler sees the kernels inside a graph."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return prof


def busy_us(events: list[tuple[float, float, str]]) -> float:
    """The time some of ``events`` (start, end, name; sorted by start) ran, overlaps merged."""
    total, end = 0.0, float("-inf")
    for s, e, _ in events:
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def profile_arm(fn: Callable[[], object], calls: int) -> dict:
    """Where one synced call of ``fn`` spends its time (medians over ``calls``, ms): ``wall``;
    the GPU's ``span`` (first kernel's start to the last one's end) and ``busy`` time
    (kernels and copies, overlaps merged); the ``delay`` from the call to its first kernel;
    and ``kernels``, (name, µs per call) by total time."""
    from torch.profiler import ProfilerActivity, profile, record_function

    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    walls, spans, busies, delays = [], [], [], []
    by_name: dict[str, float] = defaultdict(float)
    for _ in range(calls):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            with record_function("call"):
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                walls.append((time.perf_counter() - t0) * 1e3)
        call = next(e for e in prof.events() if e.name == "call" and e.device_type == cpu)
        # the device's kernels and copies (the "call" annotation has a device range too)
        ev = sorted(
            (e.time_range.start, e.time_range.start + e.time_range.elapsed_us(), e.name)
            for e in prof.events()
            if e.device_type == cuda and e.name != "call"
        )
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


def replay_us(fns: list, reps: int = 20) -> float:
    """µs per call: the callables of ``fns`` captured in turn in one CUDA graph (each distinct
    one called once before, outside the capture), the median of ``reps`` replays. Not
    ``graph_us``: Triton's do_bench_cudagraph sizes its repetitions from its own estimate,
    where the ranks of a collective must all replay alike; and a list of launches on distinct
    weights reads them from DRAM one after another, as a decode graph does."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in dict.fromkeys(fns):  # lazy inits, workspaces, compiles
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(fns))
    return sorted(times)[len(times) // 2]


def save_results(points: list, json_path: str | None, plot_path: str | None, plot_fn: str) -> None:
    """Write a bench's points (dataclasses) as JSON and draw them with ``bench.plot.<plot_fn>``."""
    rows = [asdict(p) for p in points]
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)
    if plot_path:
        from breakgraph.bench import plot

        getattr(plot, plot_fn)(rows, plot_path)


# why a step ran eagerly (the dispatcher's reason, engine/graphs/dispatch.py), for a reader
EAGER_REASONS = {
    "no prefill graphs": "graphs are captured on CUDA only, unless turned off",
    "no decode graphs": "graphs are captured on CUDA only, unless turned off",
    "over the largest bucket": "past the largest prefill bucket (--cuda-graph-max-tokens-prefill)",
    "padding": "its bucket would pad it more than --prefill-graph-max-pad-factor",
}


def explain_eager(note: str) -> str | None:
    """``note`` (a StepKey's text, e.g. "eager (no prefill graphs)") with why, if known."""
    for reason, why in EAGER_REASONS.items():
        if f"eager ({reason})" in note:
            return f"eager ({reason}): {why}"
    return None
