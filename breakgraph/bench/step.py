"""``breakgraph bench step``: one request's prefill step, N new tokens after a cached prefix
of P, timed for several arms in one process on the same weights.

Arms: breakgraph eager, breakgraph graphs (the key serving would replay, ``runner.dispatch``:
the whole graph for a lone request whose context fits a whole bucket, then also
``breakable``, the breakable bank's bucket on the same step), the floor (the same forward
captured whole as one CUDA graph at that fixed shape; TP 1), on CUDA the FLOP limit (the
step's matrix FLOPs over a bf16 GEMM's rate measured in the run: bench/flop_limit.py), HF
transformers eager (sdpa), and HF under ``torch.compile(mode="reduce-overhead")`` where it
compiles within a bound. A model with KV-shared layers (Gemma 4) gets each breakgraph arm
twice, from two engines on the same weights: "all rows" (``--no-kv-sharing-fast-prefill``)
and "bounded" (the shared layers replayed on each request's last row only), each with its
own floor.
Prints ms per arm (median of reps, wall clock with a sync: host-bound arms pay their host
time), ratios to the floor and to HF eager, and kernel launches per step (profiler);
``--profile`` adds where each graph arm's time goes beside the floor's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from breakgraph.bench.attention_tflops import matrix_tflops
from breakgraph.bench.flop_limit import flop_limit_ms, step_flops
from breakgraph.bench.hf import HFArms
from breakgraph.bench.plot import require_plot
from breakgraph.bench.timing import (
    count_launches,
    explain_eager,
    profile_arm,
    resolve_device,
    save_results,
    time_ms,
)

logger = logging.getLogger(__name__)


@dataclass
class ArmResult:
    arm: str
    ms: float | None
    launches: int | None = None
    note: str = ""


@dataclass
class PointResult:
    model: str
    new_tokens: int
    prefix_tokens: int
    arms: list[ArmResult] = field(default_factory=list)

    def ms(self, arm: str) -> float | None:
        return next((a.ms for a in self.arms if a.arm == arm), None)


class StepBench:
    """Holds an engine on a model shape and builds one-request extend batches on it."""

    def __init__(
        self,
        model: str,
        max_new: int,
        max_prefix: int,
        device: str,
        dtype: str = "auto",
        fast_prefill: bool | None = None,
        tp_size: int = 1,
        disable_custom_all_reduce: bool = False,
    ):
        from breakgraph.engine.args import EngineArgs
        from breakgraph.engine.engine import Engine

        self.model_name = model
        chunk = max(256, -(-max_new // 256) * 256)
        self.engine = Engine(
            EngineArgs(
                model_path=model,
                load_format="dummy",
                dtype=dtype,
                device=device,
                max_total_tokens=max_new + max_prefix + 16,
                chunked_prefill_size=chunk,
                max_running_requests=4,
                disable_cuda_graph=True,  # decode graphs are not measured here
                context_length=max(max_new + max_prefix + 16, 4096),
                kv_sharing_fast_prefill=fast_prefill,
                tp_size=tp_size,
                disable_custom_all_reduce=disable_custom_all_reduce,
            )
        )
        eng = self.engine
        self.req_idx = eng.req_pool.alloc()
        total = max_new + max_prefix
        slots = eng.allocator.alloc(total)
        eng.req_pool.write(self.req_idx, 0, slots)
        self.slots = slots

    def batch(self, new_tokens: int, prefix_tokens: int):
        from breakgraph.forward_batch import ForwardBatch, ForwardMode

        g = torch.Generator().manual_seed(new_tokens)
        low = min(1000, self.engine.vocab_size // 2)  # past the special tokens of a real vocabulary
        ids = torch.randint(low, self.engine.vocab_size - 1, (new_tokens,), generator=g).tolist()
        loc = self.slots[prefix_tokens : prefix_tokens + new_tokens].tolist()
        return ForwardBatch.build(
            ForwardMode.EXTEND, ids, loc, [self.req_idx], [prefix_tokens], [new_tokens],
            self.engine.device,
        )  # fmt: skip


def whole_step_floor(runner, batch) -> Callable[[], torch.Tensor]:
    """The step captured whole as one CUDA graph at its fixed shape, attention inline (the
    floor a graph bank is measured against) -> its replay."""
    from breakgraph.graph import BreakableGraph

    def fwd() -> torch.Tensor:
        return runner.forward_eager(batch)

    with torch.inference_mode():
        fwd()  # warm: allocations and Triton compiles happen outside the capture
        graph = BreakableGraph(split_at_breaks=False)
        graph.capture(fwd)
    return graph.replay


def engine_arms(runner, batch, tp_size: int) -> list[tuple[str, Callable | None, str]]:
    """(arm, its call or None, note) of one engine: eager, the key serving replays, the
    breakable bank beside a whole graph, and the floor (CUDA, TP 1)."""
    from breakgraph.engine.graphs.key import PREFILL, PREFILL_WHOLE, StepKey

    arms: list[tuple[str, Callable | None, str]] = [
        ("breakgraph eager", lambda: runner.forward_eager(batch), "")
    ]
    key = runner.dispatch(batch)
    if key.eager:
        arms.append(("breakgraph graphs", None, str(key)))
    else:
        arms.append(("breakgraph graphs", lambda: runner.forward(batch), str(key)))
    if key.bank == PREFILL_WHOLE:  # the breakable bank on the same step
        breakable = StepKey(PREFILL, key.size)
        arms.append(("breakable", lambda: runner.forward(batch, breakable), str(breakable)))
    if batch.input_ids.is_cuda:
        if tp_size == 1:
            arms.append(("floor", whole_step_floor(runner, batch), ""))
        else:
            arms.append(("floor", None, "not measured under TP"))
    return arms


def bench_point(
    benches: dict[str, StepBench],
    hf: HFArms | None,
    n: int,
    p: int,
    reps: int,
    do_compile: bool,
    tp_size: int = 1,
    profile: bool = False,
    no_compile_reason: str = "skipped",
    matrix_rate: float | None = None,
) -> PointResult:
    """``benches``: arm suffix -> engine ("" for a model without KV-shared layers);
    ``no_compile_reason``: the HF compile arm's note where ``do_compile`` is off;
    ``matrix_rate``: the bf16 GEMM rate (TFLOP/s) measured in this run, for the FLOP limit."""
    res = PointResult(next(iter(benches.values())).model_name, n, p)

    def add(arm, fn, note=""):
        if fn is None:
            res.arms.append(ArmResult(arm, None, None, note))
            return
        res.arms.append(ArmResult(arm, time_ms(fn, reps), count_launches(fn), note))

    for suffix, sb in benches.items():
        tag = f" {suffix}" if suffix else ""
        arms = engine_arms(sb.engine.runner, sb.batch(n, p), tp_size)
        for arm, fn, note in arms:
            add(arm + tag, fn, note)
        if matrix_rate:
            model = sb.engine.runner.model
            res.arms.append(flop_limit_arm("FLOP limit" + tag, model, suffix, n, p, matrix_rate))
        if profile and torch.cuda.is_available():
            graphed = {
                arm + tag: fn for arm, fn, _ in arms if fn is not None and "eager" not in arm
            }
            print(format_profile(graphed, "floor" + tag), flush=True)
    if hf is not None:
        try:
            add("HF eager", hf.eager_fn(n, p))
        except Exception as e:  # noqa: BLE001 - an HF failure is a result to report
            add("HF eager", None, f"failed: {type(e).__name__}: {str(e)[:80]}")
        if do_compile and p == 0:
            fn, note = hf.compiled_fn(n)
            add("HF compile", fn, note)
        else:
            add("HF compile", None, "P > 0 not measured" if p else no_compile_reason)
    return res


def flop_limit_arm(arm: str, model, suffix: str, n: int, p: int, rate: float) -> ArmResult:
    """The FLOP limit at ``rate`` TFLOP/s (bench/flop_limit.py). Gemma 4's bounded arm runs its
    KV-shared layers on each request's last row only: only its all-rows arm is counted."""
    if suffix == "bounded":
        return ArmResult(arm, None, None, "not counted: see the all-rows arm's")
    flops = step_flops(model, n, p)
    if flops is None:
        return ArmResult(arm, None, None, "not counted: the model's attention is its own")
    note = f"{flops / 1e12:.2f} TFLOP at {rate:.0f} TFLOP/s (bf16 GEMM, this run)"
    return ArmResult(arm, flop_limit_ms(flops, rate), None, note)


def format_profile(calls: dict[str, Callable], floor_arm: str, top: int = 8) -> str:
    """``--profile``: each graph arm's wall time, GPU span, busy time and delay to its first
    kernel, then its kernels by time beside the floor's, so that a gap to the floor reads as
    host time before the GPU starts, idle gaps inside, or extra kernels."""
    prof = {arm: profile_arm(fn, 5) for arm, fn in calls.items()}
    lines = [f"  {'profiled arm':<22} {'wall':>7} {'span':>7} {'busy':>7} {'delay':>7}  (ms)"]
    for arm, r in prof.items():
        cells = " ".join(f"{r[k]:7.3f}" for k in ("wall", "span", "busy", "delay"))
        lines.append(f"  {arm:<22} {cells}")
    floor = dict(prof[floor_arm]["kernels"]) if floor_arm in prof else {}
    for arm, r in prof.items():
        if arm == floor_arm:
            continue
        lines.append(f"  {arm}: kernels by time (µs per call; the floor's beside)")
        for k, us in r["kernels"][:top]:
            lines.append(f"    {us:9.1f} {floor.get(k, 0.0):9.1f}  {k[:90]}")
        extra = [(k, us) for k, us in r["kernels"] if k not in floor]
        lines += [f"    {us:9.1f}   not in floor  {k[:90]}" for k, us in extra[:top]]
    return "\n".join(lines)


def format_table(points: list[PointResult]) -> str:
    lines = []
    for pt in points:
        floor = pt.ms("floor") or pt.ms("floor all rows")
        hf = pt.ms("HF eager")
        lines.append(f"\n{pt.model}  N={pt.new_tokens}  P={pt.prefix_tokens}")
        lines.append(f"  {'arm':<18} {'ms':>9} {'x floor':>8} {'x HF':>7} {'launches':>9}  note")
        for a in pt.arms:
            ms = f"{a.ms:9.2f}" if a.ms is not None else f"{'-':>9}"
            xf = f"{a.ms / floor:8.2f}" if a.ms and floor else f"{'-':>8}"
            xh = f"{a.ms / hf:7.2f}" if a.ms and hf else f"{'-':>7}"
            la = f"{a.launches:9d}" if a.launches is not None else f"{'-':>9}"
            lines.append(f"  {a.arm:<18} {ms} {xf} {xh} {la}  {a.note}")
        graphs, limit = pt.ms("breakgraph graphs"), pt.ms("FLOP limit")
        if graphs and limit:
            lines.append(f"  breakgraph graphs / FLOP limit: {graphs / limit:.2f}x")
        lines += [f"  - {why}" for why in _dash_reasons(pt, floor, hf)]
    return "\n".join(lines)


def _dash_reasons(pt: PointResult, floor: float | None, hf: float | None) -> list[str]:
    """Why the table shows ``-`` where it does: one line per column that has one."""
    timed = [a for a in pt.arms if a.ms is not None]
    out = []
    if any(a.ms is None for a in pt.arms):
        out.append("ms: the arm did not run; its note says why")
    out += sorted({why for a in pt.arms if (why := explain_eager(a.note))})
    if floor is None and timed:
        out.append("x floor: no floor, the step captured whole as one CUDA graph (CUDA, TP 1)")
    if hf is None and timed:
        out.append("x HF: no HF eager arm (--no-hf, transformers missing, or it failed)")
    if any(a.launches is None for a in timed if not a.arm.startswith("FLOP limit")):
        out.append("launches: kernel launches are counted by the CUDA profiler only")
    return out


def run_step_bench(args) -> list[PointResult]:
    require_plot(args.plot)
    device = resolve_device(args.device)
    points: list[PointResult] = []
    rate = None
    if device == "cuda":  # the FLOP limit's matrix rate: a dense bf16 GEMM's, this run
        rate = matrix_tflops(lambda fn: time_ms(fn, 20, back_to_back=True))
        print(f"bf16 GEMM rate (8192^3, cuBLAS): {rate:.0f} TFLOP/s", flush=True)
    for model in args.models:
        shape = (model, max(args.new_tokens), max(args.prefix_tokens), device, args.dtype)
        t0 = time.perf_counter()
        sb = StepBench(
            *shape, tp_size=args.tp_size, disable_custom_all_reduce=args.disable_custom_all_reduce
        )
        # engine start (weights, KV pool, graph capture) is long for big models: say where we are
        print(f"{model}: engine ready in {time.perf_counter() - t0:.1f} s", flush=True)
        benches = {"": sb}
        if getattr(sb.engine.runner.model, "bounded_prefill", False):
            benches = {"all rows": StepBench(*shape, fast_prefill=False), "bounded": sb}
        hf = None
        if not args.no_hf:
            try:
                hf = HFArms(sb.engine, args.compile_timeout)
            except Exception as e:  # noqa: BLE001
                logger.warning("HF arms unavailable: %s", e)
        for p in args.prefix_tokens:
            for n in args.new_tokens:
                do_compile = not args.no_compile and device == "cuda"
                why = "skipped: --no-compile" if args.no_compile else "skipped: CUDA only"
                pt = bench_point(
                    benches, hf, n, p, args.reps, do_compile, args.tp_size, args.profile, why,
                    matrix_rate=rate,
                )  # fmt: skip
                points.append(pt)
                print(format_table([pt]), flush=True)
        for b in benches.values():
            b.engine.shutdown()  # TP workers, if any
        del sb, benches, hf
        if device == "cuda":
            torch.cuda.empty_cache()
    save_results(points, args.json, args.plot, "plot_step")
    return points
