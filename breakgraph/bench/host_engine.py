"""``bench host decode | prefill``'s measurements, each run in an arm's own process. This file
runs there by path (``runpy``) with breakgraph imported from the arm's tree, an older
commit's too: it imports breakgraph only inside its functions, nothing from ``bench``."""

from __future__ import annotations

import statistics
import time
from collections import defaultdict


def timed_steps(sch):
    """``(spent, timed)``: ``timed(obj, name, key)`` makes ``obj.name``'s calls add their
    seconds to ``spent[key]``; the scheduler's forward, schedule, launch and process_outputs
    are timed so under their own names."""
    spent: dict[str, float] = defaultdict(float)

    def timed(obj, name: str, key: str) -> None:
        inner = getattr(obj, name)

        def call(*a, **kw):
            t = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                spent[key] += time.perf_counter() - t

        setattr(obj, name, call)

    for name in ("forward", "schedule", "launch", "process_outputs"):
        timed(sch, name, name)
    return spent, timed


def measure_decode(
    model: str, batch: int, steps: int, device: str, speculative: str | None = None,
    draft_tokens: int = 3,
) -> dict[str, float]:  # fmt: skip
    """Median µs per decode step of each host stage (runs inside an arm's process).
    ``speculative``: an algorithm whose verify steps are the steps timed (``draft_tokens``
    per request, every one kept: a synthetic acceptance of all of them; overlap on, so
    verify steps chain)."""
    import torch

    from breakgraph.common import envs
    from breakgraph.engine.args import EngineArgs
    from breakgraph.engine.engine import Engine
    from breakgraph.engine.request import SamplingParams

    if device == "cpu":
        torch.set_num_threads(1)
    per_req = 1 + draft_tokens if speculative else 1  # rows per request and step
    args = EngineArgs(model_path=model, load_format="dummy", device=device,
                      dtype="float32" if device == "cpu" else "auto",
                      max_total_tokens=batch * 256 * per_req + 4096,
                      max_running_requests=max(batch, 8))  # fmt: skip
    if speculative:
        args.speculative_algorithm = speculative
        args.speculative_num_draft_tokens = draft_tokens
        args.bench_synthetic_accept_length = float(per_req)
        args.overlap_schedule = True
    with envs.BENCH.override(True):
        engine = Engine(args)
    sch = engine.scheduler
    spent, _ = timed_steps(sch)
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(max_new_tokens=(steps + 8) * per_req, temperature=0.0, ignore_eos=True)
    low = min(3, engine.vocab_size // 2)
    for _ in range(batch):
        engine.add_request(
            torch.randint(low, min(1000, engine.vocab_size), (64,), generator=g).tolist(), sp
        )
    rows: dict[str, list[float]] = defaultdict(list)
    decodes = 0
    while engine.has_work:
        spent.clear()
        t = time.perf_counter()
        engine.step()
        total = time.perf_counter() - t
        if sch.last_step_tokens != batch * per_req or sch.prefill.waiting:
            continue  # prefill steps (and plain steps beside verify steps)
        decodes += 1
        if decodes <= 3:
            continue  # the first decodes (buffers grow)
        rows["schedule"].append(spent["schedule"])
        rows["launch"].append(spent["launch"] - spent["forward"])
        rows["process_outputs"].append(spent["process_outputs"])
        rows["host"].append(total - spent["forward"])
    engine.shutdown()
    return {k: statistics.median(v) * 1e6 for k, v in rows.items()}


def measure_prefill(model: str, tokens: int, requests: int, device: str) -> dict[str, float]:
    """Median µs per cold prompt of ``tokens`` tokens, one request at a time, of the schedule
    stage, the launch outside the forward's own host time, the radix insert after the launch
    and the read-back's host time (its wait for the device excluded); ``host``: the steps
    until its token is out, outside the forward and that wait (an arm's process)."""
    import torch

    from breakgraph.engine.args import EngineArgs
    from breakgraph.engine.engine import Engine
    from breakgraph.engine.request import SamplingParams

    if device == "cpu":
        torch.set_num_threads(1)
    args = EngineArgs(model_path=model, load_format="dummy", device=device,
                      dtype="float32" if device == "cpu" else "auto",
                      max_total_tokens=tokens * 4 + 4096, chunked_prefill_size=max(tokens, 256),
                      context_length=max(tokens + 64, 4096))  # fmt: skip
    engine = Engine(args)
    engine.release_finished(defer=True)  # as the server's loop: after the outputs are sent
    sch = engine.scheduler
    spent, timed = timed_steps(sch)
    timed(sch.prefill, "cache_computed", "cache")
    if device != "cpu":  # the read-back's wait outside the stage: the step's end first
        inner = sch.process_outputs

        def synced(*a, **kw):
            t = time.perf_counter()
            torch.cuda.synchronize()
            spent["sync"] += time.perf_counter() - t
            return inner(*a, **kw)

        sch.process_outputs = synced
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    low = min(1000, engine.vocab_size // 2)
    rows: dict[str, list[float]] = defaultdict(list)
    for i in range(requests + 5):
        engine.flush_cache()  # as bench prefill flushes before each wave: nothing to evict
        engine.add_request(
            torch.randint(low, engine.vocab_size - 1, (tokens,), generator=g).tolist(), sp
        )
        spent.clear()
        t = time.perf_counter()
        outs = engine.step()
        while not outs:  # overlap scheduling: the next step reads this one back
            outs = engine.step()
        total = time.perf_counter() - t
        assert len(outs) == 1 and outs[0].finished, "one cold prompt, one token"
        engine.release_finished()
        if i < 5:
            continue  # compiles, buffers
        rows["schedule"].append(spent["schedule"])
        rows["launch"].append(spent["launch"] - spent["forward"])
        rows["cache"].append(spent["cache"])
        rows["process_outputs"].append(spent["process_outputs"])
        rows["host"].append(total - spent["forward"] - spent["sync"])
    engine.shutdown()
    return {k: statistics.median(v) * 1e6 for k, v in rows.items()}
