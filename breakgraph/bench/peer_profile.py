"""``bench peers --profile 'MODE TOKENS C'``: one more wave of a workload on each engine under
its torch profiler, and where each engine's GPU time went, kernel by kernel, side by side.

Each engine is asked through its own profiling routes: breakgraph's and SGLang's
``/start_profile`` take the trace folder in the body (``{"output_dir": DIR}``); vLLM 0.25.1
serves them only when started with ``--profiler-config`` naming the folder. After
``/stop_profile`` the traces are the folder's Chrome-trace files written since the start
(vLLM writes one per worker and one of its front end, gzipped). Their GPU events (kernels,
copies, fills) are summed by kernel name and by kind: attention, GEMM, MoE, norm,
all-reduce, copies, other.
"""

from __future__ import annotations

import gzip
import json
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
# (kind, substrings of a kernel's name, lower-cased), first match wins: MoE and attention
# before GEMM (a fused MoE kernel is a GEMM too; FA3's kernels name no GEMM)
KINDS = (
    ("moe", ("moe", "expert")),
    ("attention", ("attn", "attention", "flash", "fmha", "prefill", "decode_split", "paged")),
    ("gemm", ("gemm", "gemv", "cutlass", "xmma", "nvjet", "cublas", "matmul", "skinny")),
    ("all-reduce", ("allreduce", "all_reduce", "nccl", "one_shot")),
    ("norm", ("norm",)),
    ("copy", ("memcpy", "memset", "copy")),
)
TOP = 12


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


def profiler_argv(spec, trace_dir: str) -> list[str]:
    """The flags an engine needs at launch to be profiled into ``trace_dir`` (vLLM's)."""
    if spec.vllm_site is None:
        return []
    config = {"profiler": "torch", "torch_profiler_dir": trace_dir,
              "torch_profiler_with_stack": False}  # fmt: skip
    return ["--profiler-config", json.dumps(config)]


def _post(url: str, body: dict | None, timeout_s: float) -> None:
    data = b"" if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST")
    if body is not None:
        req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        r.read()


def start(spec, url: str, trace_dir: str) -> float:
    """Start the engine's profiler; the time it started (the traces written after it count)."""
    Path(trace_dir).mkdir(parents=True, exist_ok=True)
    started = time.time()
    body = None if spec.vllm_site is not None else {"output_dir": trace_dir}
    _post(url + "/start_profile", body, 60)
    return started


def stop(url: str, trace_dir: str, started: float, settle_s: float = 120.0) -> list[Path]:
    """Stop it and wait for its trace files: written since ``started``, their sizes steady
    for two seconds (vLLM's workers export after the answer)."""
    _post(url + "/stop_profile", None, 600)
    deadline, last = time.time() + settle_s, None
    while time.time() < deadline:
        files = sorted(
            p for p in Path(trace_dir).rglob("*")
            if p.is_file() and p.stat().st_mtime >= started and ".json" in p.name
        )  # fmt: skip
        sizes = [(p, p.stat().st_size) for p in files]
        if files and sizes == last:
            return files
        last = sizes
        time.sleep(2.0)
    return [p for p, _ in last or []]


async def profile_wave(
    spec, url: str, trace_dir: str, workload, hit_new_tokens: int, seed: int, client_factory
) -> dict:
    """One wave of ``workload`` ``(mode, tokens, concurrency)`` under the engine's profiler,
    summarized (:func:`summarize`). A hit's prefix is cached by a wave before the profile,
    so the profiled wave prefills only its new tokens."""
    from breakgraph.bench.prefill import run_prefill

    mode, tokens, concurrency = workload
    run = lambda **kw: run_prefill(url, mode, tokens, concurrency, hit_new_tokens,  # noqa: E731
                                   warmup_waves=0, waves=1, seed=seed,
                                   client_factory=client_factory, **kw)  # fmt: skip
    if mode == "hit":
        await run()
    started = start(spec, url, trace_dir)
    await run(keep_cache=mode == "hit")
    files = stop(url, trace_dir, started)
    return summarize(files)


def gpu_events(path: Path) -> list[dict]:
    """A Chrome trace's GPU events (``ph`` X of a GPU category)."""
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES]


def summarize(paths: list[Path], top: int = TOP) -> dict:
    """GPU time (ms) by kind and the ``top`` kernels by time, over every trace in ``paths``;
    ``span_ms``: first GPU event's start to the last one's end (per trace, summed)."""
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    span_us = 0.0
    for path in paths:
        events = gpu_events(path)
        if not events:
            continue
        span_us += max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
        for e in events:
            entry = by_name[e.get("name", "?")]
            entry[0] += e["dur"]
            entry[1] += 1
    kinds: dict[str, float] = defaultdict(float)
    for name, (us, _) in by_name.items():
        kinds[kind_of(name)] += us / 1e3
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "files": [str(p) for p in paths],
        "gpu_ms": sum(us for us, _ in by_name.values()) / 1e3,
        "span_ms": span_us / 1e3,
        "kinds": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
        "kernels": [[name, us / 1e3, n] for name, (us, n) in ranked],
    }


def format_profiles(workload: str, profiles: dict[str, dict]) -> list[str]:
    """Two or more engines' summaries of one workload's profiled wave, side by side."""
    names = list(profiles)
    lines = [f"\nprofile, one wave of {workload}: GPU ms by kind (and the GPU's span)",
             "| kind | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]  # fmt: skip
    kinds = sorted({k for p in profiles.values() for k in p["kinds"]},
                   key=lambda k: -max(p["kinds"].get(k, 0.0) for p in profiles.values()))  # fmt: skip
    for kind in kinds:
        cells = [f"{profiles[n]['kinds'].get(kind, 0.0):.2f}" for n in names]
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    lines.append("| all GPU events | " + " | ".join(f"{profiles[n]['gpu_ms']:.2f}" for n in names)
                 + " |")  # fmt: skip
    lines.append("| span | " + " | ".join(f"{profiles[n]['span_ms']:.2f}" for n in names) + " |")
    for name in names:
        lines.append(f"  {name}: kernels by GPU time (ms, calls)")
        for kernel, ms, n in profiles[name]["kernels"]:
            lines.append(f"    {ms:9.2f} {n:6d}  [{kind_of(kernel)}] {kernel[:100]}")
    return lines
