"""``breakgraph bench grammar``: the decode step with every request held to a JSON schema
against the same step unconstrained, per batch size, in-process; and the compile times of the
twenty test schemas (grammar_setup.py).

The model is a built-in config's shape on dummy weights with the embedded SmolLM2 tokenizer's
vocabulary, so that xgrammar has real token strings (grammar_setup.checkpoint_dir). Each arm
is a closed loop through ``Engine.step`` (overlap scheduling, graph replay, the mask's fill
and apply, sampling at temperature 1, the read-back; all as served): the batch starts full
and a request that finishes (its grammar's end, or ``--output-len``) is replaced at once. A
step counts only when it decodes the full batch (not a replacement's prefill, nor a step
short of a request) and after ``--warmup-steps`` such steps, by which time the kernels are
compiled and the schema's grammar is in xgrammar's cache. The arms alternate over
``--rounds``; each reports the median step. For the constrained arm the mask's cost is split,
per counted step: the host's fill (xgrammar), the whole mask on the host (fill, upload,
apply: on CUDA its launches, on the CPU the work itself), and the device's upload and apply
(CUDA: two events around them on the stream; the CPU: the mask's host time past the fill).
Under overlap scheduling the fill runs while the GPU runs the step's forward: it costs the
step only where the host's work outlasts the forward. Every constrained answer that ended by
its grammar is parsed as JSON.
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from breakgraph.bench.grammar_setup import (
    CATALOG_SCHEMA,
    bench_tokenizer,
    checkpoint_dir,
    compile_times,
    format_compile_times,
)
from breakgraph.bench.timing import resolve_device

KEPT_ANSWERS = 16  # finished constrained answers kept per point in --json


@dataclass
class ArmSteps:
    """One arm's counted steps (ms each) and what it finished."""

    step_ms: list[float] = field(default_factory=list)
    gpu_ms: list[float] = field(default_factory=list)  # the forward on the device (CUDA)
    fill_ms: list[float] = field(default_factory=list)  # constrained: xgrammar's fill
    mask_ms: list[float] = field(default_factory=list)  # constrained: the whole mask, host
    apply_ms: list[float] = field(default_factory=list)  # constrained: upload and apply
    finished: int = 0  # requests finished by their grammar (constrained) or length
    output_tokens: int = 0  # theirs, in all
    answers: list[str] = field(default_factory=list)  # constrained answers that ended
    invalid: list[str] = field(default_factory=list)  # ... and did not parse


@dataclass
class GrammarPoint:
    model: str
    batch_size: int
    free_ms: float  # median decode step, unconstrained
    json_ms: float  # median decode step, every row held to the schema
    ratio: float  # json / free (the goal: <= 1.10)
    fill_ms: float  # per constrained step: xgrammar's fill of the batch's rows (host)
    mask_ms: float  # per constrained step: the mask on the host (fill, upload, apply)
    apply_ms: float  # per constrained step: the upload and apply on the device (the CPU: the
    # mask's host time past the fill, as the CPU applies it inside the call)
    free_gpu_ms: float | None  # CUDA: the forward's device time per step
    json_gpu_ms: float | None
    steps: int  # counted steps per arm
    json_finished: int  # constrained answers that ended by the grammar
    json_mean_tokens: float  # their mean length
    json_valid: int  # of them, parsed as JSON
    answers: list[str] = field(default_factory=list)  # some of them (KEPT_ANSWERS)


class _MaskTimer:
    """Time of the engine's ``GrammarMask`` per step, wrapped on the instance (the engine's
    code runs unchanged): the host time of its ``apply`` and, inside it, of xgrammar's fill;
    on CUDA also a pair of events, from the fill's end to the apply's, which on the stream
    bracket the upload and the apply it queues (read once the arm is over: no sync in a
    step). A GPU that waits for the host's fill does so before the first event."""

    def __init__(self, mask, cuda: bool):
        self.fill = self.apply = 0.0
        self.events: list = []
        self._start = None
        apply, fill = mask.apply, mask._fill

        def event():
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e

        def timed_apply(*a):
            t0 = time.perf_counter()
            try:
                return apply(*a)
            finally:
                if self._start is not None:
                    self.events.append((self._start, event()))
                    self._start = None
                self.apply += time.perf_counter() - t0

        def timed_fill(*a):
            t0 = time.perf_counter()
            try:
                return fill(*a)
            finally:
                self.fill += time.perf_counter() - t0
                if cuda:
                    self._start = event()

        mask.apply, mask._fill = timed_apply, timed_fill

    def take(self) -> tuple[float, float, list]:
        """(fill ms, apply ms, CUDA event pairs) since the last call."""
        out = (self.fill * 1e3, self.apply * 1e3, self.events)
        self.fill, self.apply, self.events = 0.0, 0.0, []
        return out


def _prompt(base: list[int], length: int, rng: random.Random, vocab: int) -> list[int]:
    """``base`` then random ids up to ``length``: every request's prompt differs."""
    return (base + [rng.randrange(3, vocab) for _ in range(length)])[:length]


def run_arm(eng, args, bs: int, schema: str | None, rng: random.Random, timer) -> ArmSteps:
    """``args.steps`` counted steps of a closed loop of ``bs`` requests, held to ``schema``
    (JSON text) or unconstrained."""
    from breakgraph.engine.request import SamplingParams

    sched, tok = eng.scheduler, eng.tokenizer
    base = tok.encode("Describe a product catalog as JSON.")
    sampling = SamplingParams(
        max_new_tokens=args.output_len, temperature=1.0,
        json_schema=schema, ignore_eos=schema is None,
    )  # fmt: skip
    live: dict[str, list[int]] = {}
    out = ArmSteps()
    events = []  # CUDA: each counted constrained step's event pairs around the mask

    def add() -> None:
        ids = _prompt(base, args.prompt_len, rng, eng.vocab_size)
        live[eng.add_request(ids, sampling)] = []

    for _ in range(bs):
        add()
    warm, left = args.warmup_steps, 50 * (args.steps + args.warmup_steps) + 1000
    try:
        while len(out.step_ms) < args.steps:
            if not eng.has_work and eng.compiling:  # a grammar's first compile
                eng.grammars.wait(0.05)
                continue
            left -= 1
            if left < 0:
                raise RuntimeError(f"bench grammar: bs {bs}: fewer than {args.steps} full steps")
            full = not sched.prefill.has_work and not eng.compiling
            full = full and len(sched.decode.running) == bs
            timer.take()
            t0 = time.perf_counter()
            deltas = eng.step()
            ms = (time.perf_counter() - t0) * 1e3
            refused = eng.take_rejected()
            if refused:
                raise SystemExit(f"error: bench grammar: {refused[0][1]}")
            fill_ms, mask_ms, pairs = timer.take()
            gpu_ms = eng.last_step_timing.gpu_ms
            for d in deltas:
                live[d.rid].extend(d.token_ids)
                if d.finished:
                    _finished(out, tok, live.pop(d.rid), d.finish_reason, schema is not None)
                    add()
            if not (full and sched.last_step_tokens == bs):
                continue
            if warm > 0:
                warm -= 1
                continue
            out.step_ms.append(ms)
            if gpu_ms is not None:
                out.gpu_ms.append(gpu_ms)
            if schema is not None:
                out.fill_ms.append(fill_ms)
                out.mask_ms.append(mask_ms)
                out.apply_ms.append(mask_ms - fill_ms)  # the CPU's apply: in the call
                events.append(pairs)
        if eng.device.type == "cuda" and schema is not None:
            torch.cuda.synchronize()  # the arm is over: read its events
            out.apply_ms = [sum(a.elapsed_time(b) for a, b in p) for p in events]
    finally:
        for rid in live:
            eng.abort(rid)
        sched.drain()
        eng.release_finished()
    return out


def _finished(out: ArmSteps, tok, ids: list[int], reason: dict | None, held: bool) -> None:
    kind = (reason or {}).get("type")
    if kind == "abort":
        raise RuntimeError(f"bench grammar: a request was aborted: {reason}")
    if held and kind != "stop":
        return  # cut off by --output-len: not a whole answer
    out.finished += 1
    out.output_tokens += len(ids)
    if held:
        text = tok.decode(ids, skip_special_tokens=True)
        out.answers.append(text)
        try:
            json.loads(text)
        except ValueError:
            out.invalid.append(text)


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def measure_model(
    model: str, args, schema: dict, device: str, tokenizer, workdir: Path
) -> list[GrammarPoint]:
    from breakgraph.engine.args import EngineArgs
    from breakgraph.engine.engine import Engine

    max_bs = max(args.batch_sizes)
    path = checkpoint_dir(model, tokenizer, workdir / model)
    per_request = args.prompt_len + args.output_len + 8
    eng = Engine(
        EngineArgs(
            model_path=str(path), load_format="dummy", device=device,
            max_running_requests=max_bs, cuda_graph_max_bs=max_bs,
            max_total_tokens=2 * max_bs * per_request, context_length=per_request + 64,
            cuda_graph_backend_prefill="disabled",  # a replacement's prefill is not timed
        )
    )  # fmt: skip
    timer = _MaskTimer(eng.scheduler.grammar_mask, eng.device.type == "cuda")
    source = json.dumps(schema)
    rng = random.Random(args.seed)
    points = []
    try:
        for bs in args.batch_sizes:
            arms = {"free": ArmSteps(), "json": ArmSteps()}
            for r in range(args.rounds):
                order = ("free", "json") if r % 2 == 0 else ("json", "free")
                for arm in order:
                    got = run_arm(eng, args, bs, source if arm == "json" else None, rng, timer)
                    merge(arms[arm], got)
            pt = point(model, bs, arms)
            points.append(pt)
            print(format_point(pt), flush=True)
            if arms["json"].invalid:
                print(f"  answers that did not parse: {arms['json'].invalid[:3]}", flush=True)
    finally:
        eng.shutdown()
    return points


def merge(into: ArmSteps, got: ArmSteps) -> None:
    for f in ("step_ms", "gpu_ms", "fill_ms", "mask_ms", "apply_ms", "answers", "invalid"):
        getattr(into, f).extend(getattr(got, f))
    into.finished += got.finished
    into.output_tokens += got.output_tokens


def point(model: str, bs: int, arms: dict[str, ArmSteps]) -> GrammarPoint:
    free, held = arms["free"], arms["json"]
    free_ms, json_ms = statistics.median(free.step_ms), statistics.median(held.step_ms)
    return GrammarPoint(
        model=model, batch_size=bs, free_ms=free_ms, json_ms=json_ms,
        ratio=json_ms / free_ms, fill_ms=statistics.median(held.fill_ms),
        mask_ms=statistics.median(held.mask_ms), apply_ms=statistics.median(held.apply_ms),
        free_gpu_ms=_median(free.gpu_ms), json_gpu_ms=_median(held.gpu_ms),
        steps=min(len(free.step_ms), len(held.step_ms)), json_finished=held.finished,
        json_mean_tokens=held.output_tokens / held.finished if held.finished else 0.0,
        json_valid=held.finished - len(held.invalid), answers=held.answers[:KEPT_ANSWERS],
    )  # fmt: skip


def format_point(pt: GrammarPoint) -> str:
    line = (
        f"{pt.model:<14} bs={pt.batch_size:<3} free {pt.free_ms:8.3f} ms  json {pt.json_ms:8.3f}"
        f" ms  {pt.ratio:5.3f}x  | fill {pt.fill_ms:.3f}  mask (host) {pt.mask_ms:.3f}  apply "
        f"(device) {pt.apply_ms:.3f} ms"
    )
    if pt.free_gpu_ms is not None and pt.json_gpu_ms is not None:
        line += f"  | forward on the GPU {pt.free_gpu_ms:.3f} / {pt.json_gpu_ms:.3f} ms"
    return line + (
        f"  | {pt.steps} steps; {pt.json_finished} answers ended "
        f"(mean {pt.json_mean_tokens:.0f} tokens), {pt.json_valid} parsed"
    )


def run_grammar_bench(args) -> dict:
    device = resolve_device(args.device)
    models = args.models or (["llama-3.1-8b"] if device == "cuda" else ["smollm2-135m"])
    schema = json.loads(Path(args.schema).read_text()) if args.schema else CATALOG_SCHEMA
    tokenizer = bench_tokenizer(args.tokenizer)
    times = compile_times(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    print(format_compile_times(times), flush=True)
    points: list[GrammarPoint] = []
    with tempfile.TemporaryDirectory(prefix="bench-grammar-") as tmp:
        for model in models:
            points += measure_model(model, args, schema, device, tokenizer, Path(tmp))
    result = {
        "bench": "grammar",
        "device": device,
        "models": models,
        "vocab_size": tokenizer.vocab_size,
        "schema": schema,
        "output_len": args.output_len,
        "compile": {**asdict(times), **times.summary()},
        "points": [asdict(p) for p in points],
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result
