"""``breakgraph bench decode``: one decode step per batch size, decode CUDA graph vs eager,
each request over a context of C tokens (dummy weights, in-process).

Each row also gives the kernels one step launches (counted on the eager step, which runs the
kernels the graph captures) per step and per layer, and on CUDA the step's bandwidth floor:
the bytes a step must read (this rank's weights, where an embedding table counts only as the
LM head and a MoE layer only the experts ``batch x top_k`` can touch, plus every request's
KV, sliding layers at full context: an upper bound) over the device-copy bandwidth measured
in the same process.

Step times are medians with a device sync around each step: a step pays its host time (and
under TP the workers' latency, which rank 0's first all-reduce waits for). "back-to-back" is
the graph step's mean over steps launched without a sync between them, as overlap scheduling
runs them: what is left there is the GPU's own time, or a host slower than the GPU.
``--variants`` compares decode graphs captured under different kernel tables instead
(decode_variants.py; with ``--draft-tokens``, their verify steps). ``--draft-tokens k``
times a speculative verify step instead (each request's last token and k drafts, a row each,
as serving replays it) against the same floor (its rows share their request's KV) and, in
the same engine, the plain decode step's graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from breakgraph.bench.decode_setup import decode_batch, decode_engine, verify_batch
from breakgraph.bench.plot import require_plot
from breakgraph.bench.timing import (
    count_launches,
    explain_eager,
    profile_calls,
    resolve_device,
    save_results,
    time_ms,
)


@dataclass
class DecodePoint:
    model: str
    batch_size: int
    context: int
    eager_ms: float
    graph_ms: float | None
    eager_launches: int | None
    graph_launches: int | None
    kernels_per_layer: float | None = None
    floor_ms: float | None = None  # bytes read per step / measured copy bandwidth
    gpu_ms_by_kind: dict[str, float] | None = None  # --profile: the step's kernel time by kind
    gpu_gaps_by_kind: dict[str, list[float]] | None = None  # --profile: gaps_by_kind
    back_to_back_ms: float | None = None  # graph steps with no sync between them (mean)
    graph_note: str = ""  # why there is no graph time: the key the step dispatched to
    draft_tokens: int = 0  # --draft-tokens: a verify step of 1 + k rows a request
    plain_graph_ms: float | None = None  # --draft-tokens: the plain decode step's graph


# kernel names by kind, first match wins (cuBLAS/CUTLASS GEMMs have many names)
KERNEL_KINDS = (
    ("all-reduce", ("nccl", "allreduce", "all_reduce")),
    ("attention", ("_decode_", "_extend_", "attention", "flash")),
    ("gemm", ("gemm", "gemv", "cutlass", "cublas", "nvjet", "sm90_xmma", "splitk", "_moe_")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, keys in KERNEL_KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def gpu_time_by_kind(fn, reps: int = 5) -> tuple[dict[str, float], dict[str, list[float]]]:
    """ms of GPU kernel time per call of ``fn`` by kind (graph replays included: the profiler
    sees the kernels inside a CUDA graph), and their sum as "total"; and the gaps between the
    kernels by the kind of the kernel before each (``gaps_by_kind``)."""
    from torch.autograd import DeviceType

    prof = profile_calls(fn, reps)
    ms: dict[str, float] = {}
    for ev in prof.key_averages():
        t = ev.self_device_time_total / 1e3 / reps  # us -> ms, per call
        if t > 0:
            kind = kernel_kind(ev.key)
            ms[kind] = ms.get(kind, 0.0) + t
    ms["total"] = sum(ms.values())
    kernels = [
        (ev.time_range.start, ev.time_range.end, ev.name)
        for ev in prof.events()
        if ev.device_type == DeviceType.CUDA and ev.time_range.end > ev.time_range.start
    ]
    return ms, gaps_by_kind(kernels, reps)


def gaps_by_kind(kernels: list[tuple[float, float, str]], reps: int) -> dict[str, list[float]]:
    """Where the GPU sits idle between kernels (start and end in µs, any order): each gap
    charged to the kind of the kernel before it, as [ms per step, gaps per step, the largest
    in µs]. Inside a graph a gap is a launch's latency, or a wait the graph holds (a host node,
    a peer); the host's own time between steps lands on a step's last kernel as its largest
    gap. Overlapping kernels (several streams) leave no gap."""
    out: dict[str, list[float]] = {}
    kernels = sorted(kernels)
    busy_until = kernels[0][1] if kernels else 0.0
    for (_, end, name), (start, next_end, _) in zip(kernels, kernels[1:], strict=False):
        busy_until = max(busy_until, end)
        if start > busy_until:
            gap = out.setdefault(kernel_kind(name), [0.0, 0.0, 0.0])
            gap[0] += (start - busy_until) / 1e3 / reps
            gap[1] += 1 / reps
            gap[2] = max(gap[2], start - busy_until)
        busy_until = max(busy_until, next_end)
    return out


def step_read_bytes(
    model, batch_size: int, context: int, kv_slot_bytes: int, top_k: int, rows_each: int = 1
) -> int:
    """Bytes one decode step reads at least: weights (embedding tables only as the LM head;
    MoE experts only as many as ``batch_size * rows_each * top_k`` can touch) plus the KV of
    context (once a request: a verify step's ``rows_each`` rows share it)."""
    from breakgraph.layers.linear import ParallelLMHead, VocabParallelEmbedding
    from breakgraph.layers.moe import FusedMoE

    lm_heads = {id(m.weight) for m in model.modules() if isinstance(m, ParallelLMHead)}
    scale: dict[int, float] = {}
    for m in model.modules():
        if isinstance(m, VocabParallelEmbedding) and id(m.weight) not in lm_heads:
            scale[id(m.weight)] = 0.0  # a gather of batch_size rows
        elif isinstance(m, FusedMoE):
            touched = min(1.0, batch_size * rows_each * max(top_k, 1) / m.num_experts)
            for p in m.parameters(recurse=False):
                scale[id(p)] = touched
    seen, total = set(), 0.0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size() * scale.get(id(p), 1.0)
    return int(total) + batch_size * context * kv_slot_bytes


def run_decode_bench(args) -> list[DecodePoint]:
    if args.variants:
        from breakgraph.bench.decode_variants import run_variants

        return run_variants(args)
    require_plot(args.plot)
    device = resolve_device(args.device)
    max_bs = max(args.batch_sizes)
    points = []
    bandwidth = None
    if device == "cuda":
        from breakgraph.bench.kernels import copy_bandwidth_bytes_per_ms

        bandwidth = copy_bandwidth_bytes_per_ms() * 1e3  # bytes/s
    if bandwidth:
        print(f"device copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    k = args.draft_tokens
    for model in args.models:
        eng, rows, slots = decode_engine(
            model, device, max_bs, args.context, draft_tokens=k, tp_size=args.tp_size,
            disable_custom_all_reduce=args.disable_custom_all_reduce,
        )  # fmt: skip
        runner = eng.runner
        num_layers = eng.model_config.num_hidden_layers
        raw = eng.model_config.raw
        top_k = raw.get("num_experts_per_tok") or raw.get("top_k_experts") or 0
        slot_bytes = eng.kv_pool.model_slot_bytes(eng.model, eng.dtype)
        for bs in args.batch_sizes:
            batch = decode_batch(eng, rows, slots, bs, args.context)
            plain = None
            if k:  # the plain step's graph for the ratio, then the verify step's arms
                plain = batch
                batch = verify_batch(eng, rows, slots, bs, args.context, k)
            eager = lambda b=batch, r=runner: r.forward_eager(b)  # noqa: E731
            graph = lambda b=batch, r=runner: r.forward(b)  # noqa: E731
            key = runner.dispatch(batch)  # the key serving replays
            has_graph = not key.eager
            pt = DecodePoint(
                model,
                bs,
                args.context,
                time_ms(eager, args.reps),
                time_ms(graph, args.reps) if has_graph else None,
                count_launches(eager),
                count_launches(graph) if has_graph else None,
                graph_note="" if has_graph else str(key),
                draft_tokens=k,
            )
            if plain is not None and not runner.dispatch(plain).eager:
                pt.plain_graph_ms = time_ms(lambda b=plain, r=runner: r.forward(b), args.reps)
            if has_graph and device == "cuda":
                pt.back_to_back_ms = time_ms(graph, args.reps, back_to_back=True)
            if pt.eager_launches is not None:
                pt.kernels_per_layer = round(pt.eager_launches / num_layers, 1)
            if bandwidth:
                read = step_read_bytes(eng.model, bs, args.context, slot_bytes, top_k, 1 + k)
                pt.floor_ms = read / bandwidth * 1e3
            if getattr(args, "profile", False) and device == "cuda":
                pt.gpu_ms_by_kind, pt.gpu_gaps_by_kind = gpu_time_by_kind(
                    graph if has_graph else eager
                )
            points.append(pt)
            print(format_decode_point(pt), flush=True)
        eng.shutdown()  # TP workers, if any
        del eng, runner, rows, slots
        if device == "cuda":
            torch.cuda.empty_cache()
    save_results(points, args.json, args.plot, "plot_decode")
    return points


def format_decode_point(pt: DecodePoint) -> str:
    g = f"{pt.graph_ms:8.3f}" if pt.graph_ms is not None else f"{'-':>8}"
    ratio = f"{pt.eager_ms / pt.graph_ms:6.1f}x" if pt.graph_ms else f"{'':7}"
    if pt.graph_ms is None:  # the dispatcher's reason, e.g. eager (no decode graphs)
        ratio = explain_eager(pt.graph_note) or pt.graph_note or "no graph"
    bs = f"{pt.batch_size}" + (f"+{pt.draft_tokens}d" if pt.draft_tokens else "")
    line = f"{pt.model:<14} bs={bs:<4} C={pt.context:<6} eager {pt.eager_ms:8.3f} ms  graph {g} ms  {ratio}"
    if pt.back_to_back_ms is not None:
        line += f"  back-to-back {pt.back_to_back_ms:.3f} ms"
    if pt.eager_launches is not None:
        line += f"  kernels {pt.eager_launches} ({pt.kernels_per_layer}/layer)"
    if pt.floor_ms:
        best = pt.graph_ms if pt.graph_ms is not None else pt.eager_ms
        line += f"  floor {pt.floor_ms:.3f} ms ({best / pt.floor_ms:.2f}x)"
    if pt.plain_graph_ms and pt.graph_ms:
        line += f"  plain step {pt.plain_graph_ms:.3f} ms (verify {pt.graph_ms / pt.plain_graph_ms:.2f}x)"
    if pt.gpu_ms_by_kind:
        by = pt.gpu_ms_by_kind
        total = by["total"] or 1.0
        parts = ", ".join(
            f"{k} {v:.3f} ms ({100 * v / total:.0f}%)" for k, v in by.items() if k != "total"
        )
        best = pt.graph_ms if pt.graph_ms is not None else pt.eager_ms
        idle = max(0.0, best - by["total"])  # the step's wall time the GPU ran no kernel
        line += f"\n    GPU kernels {by['total']:.3f} ms (idle {idle:.3f} ms): {parts}"
    if pt.gpu_gaps_by_kind:
        gaps = sorted(pt.gpu_gaps_by_kind.items(), key=lambda kv: -kv[1][0])
        line += "\n    gaps after: " + ", ".join(
            f"{k} {ms:.3f} ms ({n:.3g}/step, max {mx:.0f} us)" for k, (ms, n, mx) in gaps
        )
    return line
