"""``breakgraph bench step``: one request's prefill step, N new tokens after a cached prefix
of P, timed for several arms in one process on the same weights.

Arms: breakgraph eager, breakgraph graphs (the prefill bank the engine picks: the whole
graph for a lone request whose context fits a whole bucket, then also ``breakable``, the
breakable bank on the same step), the floor (the same forward captured whole as one CUDA
graph at that fixed shape), HF transformers eager (sdpa), and HF under
``torch.compile(mode="reduce-overhead")`` where it compiles within a bound.
A model with KV-shared layers (Gemma 4) gets each breakgraph arm twice, from two engines on
the same weights: "all rows" (``--no-kv-sharing-fast-prefill``) and "bounded" (the shared
layers replayed on each request's last row only), each with its own floor.
Prints ms per arm (median of reps, wall clock with a sync: host-bound arms pay their host
time), ratios to the floor and to HF eager, and kernel launches per step (profiler).
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

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
    """Kernels (and graph launches) one call issues, counted by the profiler."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    names = (
        "cudaLaunchKernel",
        "cuLaunchKernel",
        "cudaGraphLaunch",
        "cuLaunchKernelEx",
        "cudaLaunchKernelExC",
    )
    return sum(1 for e in prof.events() if e.name in names)


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


class HFArms:
    """The HF transformers twin of the engine's model, on the same weights."""

    def __init__(self, engine, compile_timeout_s: float):
        import transformers

        cfg = dict(engine.model_config.raw)
        cfg.setdefault("torch_dtype", "bfloat16")
        arch = engine.model_config.architecture
        model_type = cfg.pop("model_type", None) or arch_model_type(arch)
        config = transformers.AutoConfig.for_model(model_type, **cfg)
        config._attn_implementation = "sdpa"
        # built in the engine's dtype on the device: a float32 copy first would not fit
        # beside the engine's weights for a large model (the 30B MoE's 61 GB in bf16)
        with torch.device(engine.device):
            self.model = getattr(transformers, arch)._from_config(config, dtype=engine.dtype)
        self.model.eval()
        experts = getattr(self.model.config, "_experts_implementation", None)
        if experts is not None and getattr(self.model.config, "num_experts", None):
            print(f"HF experts implementation: {experts}", flush=True)
        self.device = engine.device
        vocab = engine.vocab_size
        self.id_range = (min(1000, vocab // 2), min(30000, vocab - 1))  # as StepBench's
        self.compile_timeout_s = compile_timeout_s
        self.compiled = None

    def inputs(self, new_tokens: int, prefix_tokens: int):
        from transformers import DynamicCache

        g = torch.Generator().manual_seed(new_tokens)
        ids = torch.randint(*self.id_range, (1, new_tokens), generator=g).to(self.device)
        cache = None
        if prefix_tokens:
            cache = DynamicCache(config=self.model.config)
            with torch.inference_mode():
                pre = torch.randint(*self.id_range, (1, prefix_tokens), generator=g).to(self.device)
                self.model(pre, past_key_values=cache, use_cache=True)
        return ids, cache

    def eager_fn(self, new_tokens: int, prefix_tokens: int):
        ids, cache = self.inputs(new_tokens, prefix_tokens)

        def run():
            with torch.inference_mode():
                out = self.model(
                    ids, past_key_values=cache, use_cache=cache is not None, logits_to_keep=1
                )
            if cache is not None:
                cache.crop(-new_tokens)  # drop what this step appended
            return out.logits

        return run

    def compiled_fn(self, new_tokens: int) -> tuple[Callable[[], object] | None, str]:
        """torch.compile(reduce-overhead) at P=0; None with a reason if it does not compile in time."""
        if self.compiled is None:
            self.compiled = torch.compile(self.model, mode="reduce-overhead")
        ids, _ = self.inputs(new_tokens, 0)

        def run():
            with torch.inference_mode():
                return self.compiled(ids, use_cache=False, logits_to_keep=1).logits

        t0 = time.perf_counter()
        try:
            for _ in range(3):  # compile, record, then replay
                run()
                if time.perf_counter() - t0 > self.compile_timeout_s:
                    return None, f"did not compile within {self.compile_timeout_s:.0f} s"
        except Exception as e:  # noqa: BLE001 - a compile failure is a result to report
            return None, f"compile failed: {type(e).__name__}: {str(e)[:80]}"
        return run, f"compiled in {time.perf_counter() - t0:.0f} s"


def arch_model_type(arch: str) -> str:
    return {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}[
        arch
    ]


def bench_point(
    benches: dict[str, StepBench],
    hf: HFArms | None,
    n: int,
    p: int,
    reps: int,
    do_compile: bool,
) -> PointResult:
    """``benches``: arm suffix -> engine ("" for a model without KV-shared layers)."""
    res = PointResult(next(iter(benches.values())).model_name, n, p)

    def add(arm, fn, note=""):
        if fn is None:
            res.arms.append(ArmResult(arm, None, None, note))
            return
        res.arms.append(ArmResult(arm, time_ms(fn, reps), count_launches(fn), note))

    for suffix, sb in benches.items():
        runner, batch = sb.engine.runner, sb.batch(n, p)
        tag = f" {suffix}" if suffix else ""
        add("breakgraph eager" + tag, lambda r=runner, b=batch: r.forward_eager(b))
        graphs = runner.prefill_graphs
        bucket = graphs.bank.bucket_for(n) if graphs else None
        if bucket:
            whole = graphs.whole_bucket(batch)
            add(
                "breakgraph graphs" + tag,
                lambda r=runner, b=batch: r.forward(b),
                f"whole bucket {whole}" if whole else f"bucket {bucket}",
            )
            if whole and runner.tp is None:  # the breakable bank on the same step

                @torch.inference_mode()
                def breakable(g=graphs, b=batch):
                    return g.run(b, whole=False)

                add("breakable" + tag, breakable, f"bucket {bucket}")
        else:
            add("breakgraph graphs" + tag, None, "no bucket")
        if sb.engine.device.type == "cuda":
            add("floor" + tag, runner.capture_whole(batch))
    if hf is not None:
        try:
            add("HF eager", hf.eager_fn(n, p))
        except Exception as e:  # noqa: BLE001 - an HF failure is a result to report
            add("HF eager", None, f"failed: {type(e).__name__}: {str(e)[:80]}")
        if do_compile and p == 0:
            fn, note = hf.compiled_fn(n)
            add("HF compile", fn, note)
        else:
            add("HF compile", None, "P > 0 not measured" if p else "skipped")
    return res


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
    return "\n".join(lines)


def run_step_bench(args) -> list[PointResult]:
    if args.plot:  # fail before the run, not after it
        from breakgraph.bench.plot import require_matplotlib

        require_matplotlib()
    device = (
        args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    points: list[PointResult] = []
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
                pt = bench_point(benches, hf, n, p, args.reps, do_compile)
                points.append(pt)
                print(format_table([pt]), flush=True)
        for b in benches.values():
            b.engine.shutdown()  # TP workers, if any
        del sb, benches, hf
        if device == "cuda":
            torch.cuda.empty_cache()
    save_results(points, args.json, args.plot, "plot_step")
    return points


def save_results(points: list, json_path: str | None, plot_path: str | None, plot_fn: str) -> None:
    """Write a bench's points as JSON and draw them with ``bench.plot.<plot_fn>``."""
    rows = [asdict(p) for p in points]
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)
    if plot_path:
        from breakgraph.bench import plot

        getattr(plot, plot_fn)(rows, plot_path)
