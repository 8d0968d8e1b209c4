"""Tensor parallelism on the CPU (gloo, 2 ranks; 4 for a few): TP2 logits equal TP1's in float32, whole,
ragged, over a cached prefix and chunked (dense families, Qwen3-MoE, Gemma 4 text and MoE with
KV-shared layers, bounded replay on and off); greedy tokens equal; dummy weights equal; a dead worker fails the next step with a clear error; shutdown leaves no
process behind."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from breakgraph.distributed import TPGroup
from breakgraph.engine.args import EngineArgs
from breakgraph.engine.engine import Engine
from breakgraph.engine.flags import add_engine_args
from breakgraph.engine.request import SamplingParams
from breakgraph.layers.linear import default_weight_loader
from breakgraph.models.config import ModelConfig
from breakgraph.models.loader import load_model
from breakgraph.models.registry import check_tp_support
from breakgraph.models.sources import CONFIG_DIR
from tests.support.hf import LogitsTap, make_hf_model

ATOL = 1e-5
DENSE = ["llama", "qwen2", "qwen3"]  # qwen2: one KV head, replicated on both ranks


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for family in [*DENSE, "qwen3_moe"]:
        out[family] = tmp_path_factory.mktemp(f"tp-{family}")
        make_hf_model(family).save_pretrained(out[family])
    return out


@pytest.fixture(scope="module")
def gemma4_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Tiny Gemma 4: ``text`` (4 heads, 1 KV head replicated per rank, KV-shared layers, PLE,
    double-wide MLP) and ``moe`` (k is v on full layers with 2 KV heads split, experts)."""
    pytest.importorskip("transformers.models.gemma4")
    from tests.support.gemma4 import make_hf_gemma4

    out = {}
    for kind in ("text", "moe"):
        out[kind] = tmp_path_factory.mktemp(f"tp-gemma4-{kind}")
        make_hf_gemma4(kind).save_pretrained(out[kind])
    return out


def make_args(path, **kw) -> EngineArgs:
    args = EngineArgs(model_path=str(path), device="cpu", dtype="float32", max_total_tokens=2048)
    for k, v in kw.items():
        setattr(args, k, v)
    return args


@contextlib.contextmanager
def tp1_and_tp2(path, size: int = 2, **kw):
    """A TP1 and a TP``size`` engine over the same checkpoint, each with a logits tap."""
    tp1 = Engine(make_args(path, **kw))
    tp2 = Engine(make_args(path, tp_size=size, **kw))
    try:
        yield tp1, tp2, LogitsTap(tp1), LogitsTap(tp2)
    finally:
        tp2.shutdown()


def prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def assert_same_steps(a: LogitsTap, b: LogitsTap) -> None:
    assert len(a.steps) == len(b.steps) > 0
    for i, (x, y) in enumerate(zip(a.steps, b.steps, strict=True)):
        torch.testing.assert_close(y, x, atol=ATOL, rtol=0, msg=lambda m, i=i: f"step {i}: {m}")


@pytest.mark.parametrize("family", [*DENSE, "qwen3_moe"])
def test_tp2_logits_equal_tp1(checkpoints, family):
    """One whole prompt, a ragged batch, a request over a cached prefix, greedy decode."""
    _assert_tp2_logits_equal_tp1(checkpoints[family])


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_tp2_with_the_norms_reducing_equals_tp1(checkpoints, family, knobs):
    """BREAKGRAPH_AR_NORM=1: o and down hand partial sums to the norms after them, which
    all-reduce them (the final norm too; a MoE block still reduces its own output): the
    same tokens and logits as TP1."""
    knobs(AR_NORM=True)  # the workers inherit it
    _assert_tp2_logits_equal_tp1(checkpoints[family], reducing_norms=True)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_tp4_logits_equal_tp1(checkpoints, family):
    """Four ranks (issue 18's sizes, on gloo): llama's 2 KV heads each replicated on two
    ranks (neither TP2's split nor one head on every rank), the experts' intermediate size
    split four ways."""
    _assert_tp2_logits_equal_tp1(checkpoints[family], size=4)


def _assert_tp2_logits_equal_tp1(checkpoint, reducing_norms: bool = False, size: int = 2):
    with tp1_and_tp2(checkpoint, size) as (tp1, tp2, tap1, tap2):
        layers = tp2.model.model.layers
        assert all((layer.reduce_group is not None) == reducing_norms for layer in layers)
        (base,) = prompts([48], seed=2)
        batches = [
            (prompts([37]), greedy(1)),
            (prompts([5, 33, 1, 70], seed=3), greedy(1)),
            ([base], greedy(1)),
            ([base + [7, 8, 9, 10, 11]], greedy(1)),  # the whole base is cached
            (prompts([20, 45, 9], seed=4), greedy(6)),
        ]
        cached = []
        for ps, sp in batches:
            r1, r2 = tp1.generate(ps, sp), tp2.generate(ps, sp)
            assert [r.output_ids for r in r2] == [r.output_ids for r in r1]
            assert [r.cached_tokens for r in r2] == [r.cached_tokens for r in r1]
            cached.append(r2[0].cached_tokens)
        assert cached[3] == len(base)
        assert_same_steps(tap1, tap2)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3_moe"])
def test_tp2_chunked_prefill_equals_tp1(checkpoints, family):
    with tp1_and_tp2(checkpoints[family], chunked_prefill_size=16) as (tp1, tp2, tap1, tap2):
        ps = prompts([50, 9], seed=5)
        r1, r2 = tp1.generate(ps, greedy(3)), tp2.generate(ps, greedy(3))
        assert len(tap2.steps) >= 5  # 59 prompt tokens in 16-token steps, then decode
        assert [r.output_ids for r in r2] == [r.output_ids for r in r1]
        assert_same_steps(tap1, tap2)


def assert_prompt_logprobs_equal(tp1: Engine, tp2: Engine, ps, top_k: int) -> None:
    """Prompt logprobs (steps through ``forward_prompt`` on every rank) of TP2 equal TP1's."""
    kw = dict(return_logprob=True, logprob_start_len=0, top_logprobs_num=top_k)
    r1, r2 = tp1.generate(ps, greedy(2), **kw), tp2.generate(ps, greedy(2), **kw)
    for a, b in zip(r1, r2, strict=True):
        assert b.output_ids == a.output_ids
        got, want = torch.tensor(b.input_logprobs[1:]), torch.tensor(a.input_logprobs[1:])
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_tp2_prompt_logprobs_equal_tp1(checkpoints):
    """Steps with prompt logprobs go through forward_prompt on every rank."""
    with tp1_and_tp2(checkpoints["qwen3"]) as (tp1, tp2, _, _):
        assert_prompt_logprobs_equal(tp1, tp2, prompts([12, 30], seed=6), top_k=3)


@pytest.mark.parametrize(
    ("algorithm", "overlap"), [("NGRAM", False), ("STANDALONE", False), ("STANDALONE", True)]
)
def test_tp2_speculative_decoding_equals_tp1_plain(checkpoints, algorithm, overlap):
    """Verify steps under TP: the workers compute every row's logits as rank 0 does (the LM
    head's gather is collective); a draft model runs whole on rank 0 only. With overlap its
    verify steps run back to back: rank 0 broadcasts each chained step's carried base and
    the workers rebuild its rows on the device (engine/spec_chain.py)."""
    base = prompts([7], seed=4)[0]
    ps = [(base * 6)[:40], *prompts([9, 21], seed=5)]
    path = checkpoints["llama"]
    plain = Engine(make_args(path)).generate(ps, greedy(20))
    kw = dict(
        speculative_algorithm=algorithm, speculative_num_draft_tokens=3,
        speculative_draft_model_path=str(path), overlap_schedule=overlap,
    )  # fmt: skip
    tp1 = Engine(make_args(path, **kw))
    tp2 = Engine(make_args(path, tp_size=2, **kw))
    try:
        tap1, tap2 = LogitsTap(tp1), LogitsTap(tp2)
        tp1.generate(ps, greedy(20))
        chained = []
        spec = tp2.scheduler.spec
        schedule = spec.schedule_chained

        def chain(*a):
            out = schedule(*a)
            chained.append(out is not None)
            return out

        spec.schedule_chained = chain
        got = tp2.generate(ps, greedy(20))
        assert [r.output_ids for r in got] == [r.output_ids for r in plain]
        assert tp2.scheduler.spec_stats.accepted > 0
        assert any(chained) == overlap
        assert_same_steps(tap1, tap2)  # every verify row's logits, TP2 as TP1
    finally:
        tp2.shutdown()


def test_dummy_weights_equal_and_dead_worker_fails_cleanly(checkpoints):
    """Dummy TP2 weights are TP1's; then a killed worker makes the next step raise naming
    its rank (no hang), and shutdown leaves no child process."""
    with tp1_and_tp2(checkpoints["qwen3"], load_format="dummy") as (tp1, tp2, tap1, tap2):
        ps = prompts([17, 40], seed=7)
        assert [r.output_ids for r in tp2.generate(ps, greedy(3))] == [
            r.output_ids for r in tp1.generate(ps, greedy(3))
        ]
        assert_same_steps(tap1, tap2)

        (worker,) = tp2.tp_driver.procs
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="TP worker rank 1"):
            tp2.generate(ps, greedy(1))
        assert time.monotonic() - start < 10
    assert not [p for p in mp.active_children() if p.name.startswith("breakgraph-tp")]


def test_worker_dying_mid_generation_stops_the_engine_at_once(checkpoints, caplog):
    """A worker killed while rank 0 generates: the step it breaks (or the next) raises naming
    its rank within seconds, and rank 0's watchdog logs it (on NCCL it also aborts the group,
    which would otherwise wait out the collective timeout); no process is left behind."""
    engine = Engine(make_args(checkpoints["qwen3"], tp_size=2))
    try:
        (worker,) = engine.tp_driver.procs
        engine.generate(prompts([8]), greedy(2))
        killed = threading.Event()

        def kill():
            os.kill(worker.pid, signal.SIGKILL)
            killed.set()

        threading.Timer(0.3, kill).start()
        deadline = time.monotonic() + 30
        with caplog.at_level(logging.ERROR, logger="breakgraph.engine.tp.driver"):
            with pytest.raises(RuntimeError, match="TP worker rank 1"):
                while time.monotonic() < deadline:  # generating when the kill lands
                    engine.generate(prompts([8, 5]), greedy(400))
            assert killed.wait(5)
            for _ in range(100):  # the watchdog's line (its thread may log after the raise)
                if "TP worker rank 1 exited" in caplog.text:
                    break
                time.sleep(0.05)
        assert time.monotonic() < deadline
        assert "TP worker rank 1 exited (exit code -9)" in caplog.text
    finally:
        engine.shutdown()
    assert not [p for p in mp.active_children() if p.name.startswith("breakgraph-tp")]


def test_trace_reports_every_ranks_host_time_per_step(checkpoints, knobs, capfd, caplog):
    """BREAKGRAPH_TP_TRACE=1: at shutdown rank 0 logs its sends and each worker its pipe,
    build and launch times per step, as percentiles in µs (the worker's on its stderr)."""
    import re

    from breakgraph.engine.tp.trace import StepTrace

    knobs(TP_TRACE=True)  # read by rank 0 and by the spawned worker
    engine = Engine(make_args(checkpoints["llama"], tp_size=2))
    engine.generate(prompts([8]), greedy(3))
    engine.shutdown()
    err = capfd.readouterr().err
    rank0 = r"TP rank 0 trace, \d+ steps, us: send p50 \d+ p90 \d+ p99 \d+"
    assert re.search(rank0, caplog.text), caplog.text
    pattern = r"TP rank 1 trace, \d+ steps, us: pipe p50 \d+ .*; build p50 \d+ .*; launch p50"
    assert re.search(pattern, err), err
    trace = StepTrace(1, ("a", "b"))
    trace.add(0.0, 1e-6, 3e-6)
    trace.add(0.0, 2e-6, 3e-6)
    assert (
        trace.report() == "TP rank 1 trace, 2 steps, us: a p50 2 p90 2 p99 2; b p50 2 p90 2 p99 2"
    )


def test_shutdown_stops_workers(checkpoints):
    engine = Engine(make_args(checkpoints["llama"], tp_size=2))
    procs = list(engine.tp_driver.procs)
    engine.generate(prompts([8]), greedy(2))
    engine.shutdown()
    engine.shutdown()  # idempotent
    assert all(p.exitcode == 0 for p in procs)
    assert not [p for p in mp.active_children() if p.name.startswith("breakgraph-tp")]


WATCHDOG_SCRIPT = r"""
import logging, multiprocessing as mp, sys, time
import torch
from breakgraph.distributed import TPGroup
from breakgraph.engine.tp import driver
logging.basicConfig(level=logging.INFO)
calls = []
def abort(group):  # NCCL's abort with its peer killed may never return (NVIDIA/nccl#863)
    calls.append(group)
    if sys.argv[1] == "hangs":
        time.sleep(3600)
driver.abort_tp_group = abort
fork = mp.get_context("fork")
worker = fork.Process(target=int)  # a worker that exits at once
other = fork.Process(target=time.sleep, args=(3600,))  # one still in a collective
other.start()
print("other", other.pid, flush=True)
worker.start()
stop, _ = mp.Pipe(duplex=False)
one_shot = object() if sys.argv[1] == "one_shot" else None  # its kernels never see an abort
group = TPGroup(0, 3, torch.device("cpu"), one_shot)
driver._watch_workers([worker, other], stop, group, abort_s=0.5)
other.kill()
other.join()
print("returned", len(calls))
"""


@pytest.mark.parametrize("abort", ["returns", "hangs", "one_shot"])
def test_watchdog_aborts_a_dead_workers_group_or_exits(abort):
    """Rank 0's watchdog on a worker's exit: says so naming the rank and aborts the group (the
    engine raises at its next step); an abort that does not return in time (NCCL reclaiming
    with a killed peer), or with the one-shot all-reduce on an engine that does not stop in
    that time (a step stuck on the GPU in its barrier), kills the other workers and exits the
    process with code 1 and one line why: never a hang, no orphan."""
    out = subprocess.run(
        [sys.executable, "-c", WATCHDOG_SCRIPT, abort], capture_output=True, text=True, timeout=60
    )
    assert "TP worker rank 1 exited (exit code 0)" in out.stderr, out.stderr
    lines = out.stdout.split()
    other = int(lines[lines.index("other") + 1])
    if abort == "returns":
        assert out.returncode == 0 and "returned 1" in out.stdout, out.stderr
    else:
        assert out.returncode == 1 and "returned" not in out.stdout, out.stderr
        why = {"hangs": "abort did not return in 0.5 s", "one_shot": "did not stop in 0.5 s"}
        assert f"{why[abort]} (" in out.stderr or f"{why[abort]}: exiting" in out.stderr
    deadline = time.monotonic() + 10
    while not _gone(other) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(other)


STUCK_TEARDOWN_SCRIPT = r"""
import logging, sys, time
import torch
from breakgraph.distributed import TPGroup
from breakgraph.engine.tp import teardown
logging.basicConfig(level=logging.INFO)
teardown.destroy_quietly = lambda group: time.sleep(3600)  # NCCL's abort that never returns
teardown.leave_group(TPGroup(0, 2, torch.device("cpu")), 0.2)
print("results written", flush=False)  # still in the buffer: the exit must flush it
teardown.exit_if_stuck(3)
print("not reached")
"""


def test_a_stuck_teardown_ends_the_process_with_its_code_not_an_abort():
    """A TP group's teardown that does not return leaves a thread in C++ that makes the
    interpreter's exit abort the process (SIGABRT) after its work is done: the engine process
    and the CLI end with ``exit_if_stuck`` instead, output flushed and their exit code kept."""
    out = subprocess.run(
        [sys.executable, "-c", STUCK_TEARDOWN_SCRIPT], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 3, out.stderr
    assert out.stdout.split() == ["results", "written"]
    assert "TP group teardown did not finish" in out.stderr
    assert "exiting without finalizers" in out.stderr


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")  # a zombie waiting for init to reap it is gone too


def test_workers_exit_when_rank0_dies(checkpoints, tmp_path):
    out = _run_script(
        tmp_path,
        f"""
        import os, sys
        from breakgraph.engine.args import EngineArgs
        from breakgraph.engine.engine import Engine
        if __name__ == "__main__":
            e = Engine(EngineArgs(model_path={str(checkpoints["llama"])!r}, device="cpu",
                                  dtype="float32", max_total_tokens=512, tp_size=2))
            print(e.tp_driver.procs[0].pid, flush=True)
            os._exit(0)  # no shutdown: the worker must notice by itself
        """,
    )
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout.split()[-1])
    deadline = time.monotonic() + 15
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _gone(pid), f"TP worker {pid} outlived rank 0"


def _run_script(tmp_path, body: str, timeout: float = 120) -> subprocess.CompletedProcess:
    (tmp_path / "rank0.py").write_text(textwrap.dedent(body))
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, str(tmp_path / "rank0.py")],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_worker_dying_at_startup_fails_the_engine_at_once(checkpoints, tmp_path):
    """A worker that cannot start (here the script has no ``__main__`` guard, so the spawned
    worker's import of it fails) makes Engine() raise naming it, instead of rank 0 waiting in
    the group's rendezvous until it times out (300 s)."""
    start = time.monotonic()
    out = _run_script(
        tmp_path,
        f"""
        from breakgraph.engine.args import EngineArgs
        from breakgraph.engine.engine import Engine
        Engine(EngineArgs(model_path={str(checkpoints["llama"])!r}, device="cpu",
                          dtype="float32", max_total_tokens=512, tp_size=2))
        """,
    )
    assert out.returncode != 0
    assert "TPWorkerError: TP worker rank 1 exited (exit code 1) during startup" in out.stderr
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_moe_expert_shards_are_slices_of_tp1(checkpoints, load_format):
    """Each rank's experts hold its intermediate slice of TP1's (gate and up rows each sliced,
    down's columns), from per-expert checkpoint tensors read lazily or from dummy weights; the
    router is whole on every rank. Model level: no process group needed to load."""
    path = str(checkpoints["qwen3_moe"])
    kw = dict(load_format=load_format, dtype="float32", device="cpu")
    whole = dict(load_model(path, **kw).model.named_parameters())
    shards = [
        dict(load_model(path, tp_group=TPGroup(r, 2), **kw).model.named_parameters())
        for r in range(2)
    ]
    mlp = "model.layers.0.mlp"
    gate_up, down = whole[f"{mlp}.experts.gate_up_proj"], whole[f"{mlp}.experts.down_proj"]
    gate, up = gate_up.chunk(2, dim=1)
    assert gate.shape[1] == 48
    for r, shard in enumerate(shards):
        rows = slice(24 * r, 24 * (r + 1))
        want = torch.cat([gate[:, rows], up[:, rows]], dim=1)
        torch.testing.assert_close(shard[f"{mlp}.experts.gate_up_proj"], want, atol=0, rtol=0)
        torch.testing.assert_close(
            shard[f"{mlp}.experts.down_proj"], down[:, :, rows], atol=0, rtol=0
        )
        torch.testing.assert_close(
            shard[f"{mlp}.gate.weight"], whole[f"{mlp}.gate.weight"], atol=0, rtol=0
        )


def test_gemma4_tp2_logits_equal_tp1(gemma4_checkpoints):
    """Bounded replay on (the default): prompts longer than the 8-token window, a ragged
    batch, a cached prefix, greedy decode; then prompt logprobs, whose steps run every layer
    on every row (the computation of kv_sharing_fast_prefill off) on every rank."""
    with tp1_and_tp2(gemma4_checkpoints["text"]) as (tp1, tp2, tap1, tap2):
        (base,) = prompts([30], seed=2)
        batches = [
            (prompts([5, 33, 1, 21], seed=3), greedy(1)),
            ([base], greedy(1)),
            ([base + [7, 8, 9]], greedy(1)),  # the whole base is cached
            (prompts([20, 14], seed=4), greedy(4)),
        ]
        cached = []
        for ps, sp in batches:
            r1, r2 = tp1.generate(ps, sp), tp2.generate(ps, sp)
            assert [r.output_ids for r in r2] == [r.output_ids for r in r1]
            cached.append(r2[0].cached_tokens)
        assert cached[2] == len(base)
        assert_same_steps(tap1, tap2)

        assert_prompt_logprobs_equal(tp1, tp2, prompts([12, 19], seed=6), top_k=2)


@pytest.mark.parametrize("size", [2, 4])
def test_gemma4_moe_tp2_logits_equal_tp1(gemma4_checkpoints, size):
    """The MoE block (dense MLP and experts, each all-reduced before its norm), k is v on the
    full layers: a ragged batch with prompts past the window, bounded replay, greedy decode
    (few steps: the CPU runs the experts one by one). At TP4 each of the full layers' 2 KV
    heads is on two ranks, the sliding layers' one on all four, and each expert keeps a
    quarter of its intermediate size (6)."""
    with tp1_and_tp2(gemma4_checkpoints["moe"], size) as (tp1, tp2, tap1, tap2):
        ps = prompts([3, 21], seed=3)
        r1, r2 = tp1.generate(ps, greedy(3)), tp2.generate(ps, greedy(3))
        assert [r.output_ids for r in r2] == [r.output_ids for r in r1]
        assert_same_steps(tap1, tap2)


def test_gemma4_tp2_chunked_prefill_equals_tp1(gemma4_checkpoints):
    with tp1_and_tp2(gemma4_checkpoints["text"], chunked_prefill_size=16) as (tp1, tp2, t1, t2):
        ps = prompts([40, 9], seed=5)
        r1, r2 = tp1.generate(ps, greedy(3)), tp2.generate(ps, greedy(3))
        assert len(t2.steps) >= 4  # 49 prompt tokens in 16-token steps, then decode
        assert [r.output_ids for r in r2] == [r.output_ids for r in r1]
        assert_same_steps(t1, t2)


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_gemma4_shards_are_slices_of_tp1(gemma4_checkpoints, load_format):
    """Every parameter of each rank is its loader's slice of TP1's (k-is-v q/k, split and
    replicated KV heads, PLE table, experts), read lazily or drawn as dummy weights; the KV
    pool of a rank holds its KV heads. Model level: no process group needed to load."""
    path = str(gemma4_checkpoints["moe"])
    kw = dict(load_format=load_format, dtype="float32", device="cpu")
    whole = load_model(path, **kw).model
    params = dict(whole.named_parameters())
    for r in range(2):
        shard = load_model(path, tp_group=TPGroup(r, 2), **kw).model
        for name, p in shard.named_parameters():
            got = p.detach().clone()
            getattr(p, "weight_loader", default_weight_loader)(p, params[name])  # the slice
            torch.testing.assert_close(got, p.detach(), atol=0, rtol=0, msg=name)
        # layers 0, 1, 3: sliding (1 KV head, replicated); 2: full (2 KV heads, k is v)
        assert shard.kv_cache_shapes() == [(1, 16), (1, 16), (1, 32), (1, 16)]
        attn = shard.model.layers[2].self_attn
        assert (attn.num_heads, attn.qkv_proj.weight.shape[0]) == (2, 3 * 32)
    assert whole.kv_cache_shapes() == [(1, 16), (1, 16), (2, 32), (1, 16)]


def test_gemma4_tp2_without_fast_prefill_equals_tp1(gemma4_checkpoints):
    """--no-kv-sharing-fast-prefill reaches every rank (the shared layers on all rows on
    both, or their all-reduces would not pair up)."""
    path = gemma4_checkpoints["text"]
    with tp1_and_tp2(path, kv_sharing_fast_prefill=False) as (tp1, tp2, tap1, tap2):
        assert not tp2.model.kv_sharing_fast_prefill
        ps = prompts([5, 33, 21], seed=8)
        r1, r2 = tp1.generate(ps, greedy(2)), tp2.generate(ps, greedy(2))
        assert [r.output_ids for r in r2] == [r.output_ids for r in r1]
        assert_same_steps(tap1, tap2)


def test_gemma4_builtin_configs_pass_tp_checks():
    for name in ("gemma-4-e2b", "gemma-4-e4b", "gemma-4-26b-a4b"):
        check_tp_support(ModelConfig.from_file(CONFIG_DIR / f"{name}.json"), 8)


def test_unsupported_size_fails_at_startup(checkpoints):
    start = time.monotonic()
    with pytest.raises(ValueError, match="attention heads"):
        Engine(make_args("gemma-4-e2b", load_format="dummy", tp_size=3))  # 8 heads
    with pytest.raises(ValueError, match="attention heads"):
        Engine(make_args(checkpoints["llama"], tp_size=3))  # 4 heads
    assert time.monotonic() - start < 5  # refused before any worker is spawned
    assert not [p for p in mp.active_children() if p.name.startswith("breakgraph-tp")]


def test_moe_intermediate_size_must_divide_by_tp():
    config = ModelConfig.from_file(CONFIG_DIR / "qwen3-30b-a3b.json")
    check_tp_support(config, 8)  # 768 / 8 per rank
    config.raw["moe_intermediate_size"] = 100
    with pytest.raises(ValueError, match="MoE intermediate size 100"):
        check_tp_support(config, 8)
    config.raw["mlp_only_layers"] = list(range(config.num_hidden_layers))
    check_tp_support(config, 8)  # no MoE layer left


def test_tp_flag_and_alias():
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert EngineArgs.from_namespace(parser.parse_args(["--tp", "2"])).tp_size == 2
    assert EngineArgs.from_namespace(parser.parse_args(["--tp-size", "4"])).tp_size == 4
    assert EngineArgs.from_namespace(parser.parse_args([])).tp_size == 1
    with pytest.raises(SystemExit):
        parser.parse_args(["--tp-size", "0"])


def test_custom_all_reduce_is_cuda_only_and_falls_back_where_it_cannot_be_set_up(
    checkpoints, caplog
):
    """The custom all-reduce is on unless --disable-custom-all-reduce; gloo ranks (the CPU)
    use the collective without a word; where the one-shot path cannot be set up the ranks
    agree on the collective and say why."""
    import argparse

    from breakgraph.distributed.group import _one_shot_all_reduce

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    parsed = EngineArgs.from_namespace(parser.parse_args(["--disable-custom-all-reduce"]))
    assert parsed.disable_custom_all_reduce and not EngineArgs().disable_custom_all_reduce
    caplog.set_level(logging.WARNING, logger="breakgraph.distributed.group")
    assert _one_shot_all_reduce(0, 2, torch.device("cpu")) is None
    assert "TP rank 0: custom all-reduce off, all-reduces go to NCCL (needs CUDA)" in caplog.text
    caplog.clear()
    path = checkpoints["llama"]
    with tp1_and_tp2(path) as (tp1, tp2, tap1, tap2):
        assert tp2.tp_driver.group.one_shot is None
        assert "custom all-reduce" not in caplog.text
        ps = prompts([7, 19])
        r1, r2 = tp1.generate(ps, greedy(3)), tp2.generate(ps, greedy(3))
        assert [r.output_ids for r in r2] == [r.output_ids for r in r1]
        assert_same_steps(tap1, tap2)


def test_tp_group_routes_small_all_reduces_to_the_one_shot_path():
    """What the one-shot path takes: bf16/fp32, contiguous, 16-byte multiples up to its size
    (every rank decides alike from the shape); the rest goes to the collective."""
    from breakgraph.distributed.group import OneShotAllReduce

    class Recording(OneShotAllReduce):  # the routing only: no symmetric memory here
        def __init__(self, max_bytes: int):
            self.max_bytes, self.calls = max_bytes, []

        def __call__(self, x):
            self.calls.append(x)
            return x

    one_shot = Recording(1024)
    bf16 = torch.zeros(512, dtype=torch.bfloat16)
    assert one_shot.fits(bf16) and one_shot.fits(torch.zeros(256))
    assert not one_shot.fits(torch.zeros(513, dtype=torch.bfloat16))  # over max_bytes
    assert not one_shot.fits(torch.zeros(7, dtype=torch.bfloat16))  # 14 bytes
    assert not one_shot.fits(torch.zeros(8, dtype=torch.float16))  # the kernel has no fp16
    assert not one_shot.fits(torch.zeros(16, 2)[:, 0])  # strided
    assert not one_shot.fits(torch.zeros(0))
    group = TPGroup(0, 2, torch.device("cpu"), one_shot)
    assert group.all_reduce(bf16) is bf16 and one_shot.calls == [bf16]
    assert group == TPGroup(0, 2, torch.device("cpu"))  # the path is not the group's identity


def _children(pid: int) -> list[int]:
    """Child pids of every thread of ``pid`` (Linux)."""
    return [
        int(c)
        for t in Path(f"/proc/{pid}/task").iterdir()
        for c in (t / "children").read_text().split()
    ]


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")


def test_serve_tp2_answers_as_tp1_and_sigterm_leaves_no_process(checkpoints, tmp_path):
    """`breakgraph serve --tp 2`: the engine process spawns its worker, /generate equals a
    TP1 engine's greedy tokens, and SIGTERM stops the API process, the engine and the worker."""
    import httpx

    from tests.support.server import ServerProcess

    path = checkpoints["llama"]
    want = Engine(make_args(path)).generate(prompts([9]), greedy(5))[0].output_ids
    srv = ServerProcess(
        ["--model-path", str(path), "--tp", "2", "--dtype", "float32"], tmp_path / "tp.log"
    ).wait_ready()
    try:
        body = {
            "input_ids": prompts([9])[0],
            "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
        }
        out = httpx.post(f"{srv.url}/generate", json=body, timeout=60).json()
        assert out["output_ids"] == want, srv.log()
        engine_pid = srv.engine_pid()
        workers = [p for p in _children(engine_pid) if "resource_tracker" not in _cmdline(p)]
        assert workers, "the engine process spawned no TP worker"
    finally:
        assert srv.stop() == 0, srv.log()
    deadline = time.monotonic() + 20
    while not all(_gone(p) for p in [engine_pid, *workers]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(_gone(p) for p in [engine_pid, *workers])


def test_serve_tp2_worker_death_is_503_and_exit(checkpoints, tmp_path):
    """A TP worker that dies under `serve --tp 2`: the next request is answered 503, the
    server exits 1 and its log names the rank; no process is left behind."""
    import httpx

    from tests.support.server import ServerProcess

    srv = ServerProcess(
        ["--model-path", str(checkpoints["llama"]), "--tp", "2", "--dtype", "float32"],
        tmp_path / "tp-death.log",
    ).wait_ready()
    engine_pid = srv.engine_pid()
    (worker,) = [p for p in _children(engine_pid) if "resource_tracker" not in _cmdline(p)]
    os.kill(worker, signal.SIGKILL)
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}}
    try:
        r = httpx.post(f"{srv.url}/generate", json=body, timeout=60)
        assert r.status_code == 503, r.text
    except httpx.TransportError:
        pass  # the server may already be gone when the answer would go out
    assert srv.proc.wait(30) == 1, srv.log()
    srv.stop()
    assert "TP worker rank 1 exited" in srv.log()
    deadline = time.monotonic() + 10
    while not (_gone(engine_pid) and _gone(worker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _gone(engine_pid) and _gone(worker)


def test_a_cuda_process_runs_host_ops_on_one_thread(monkeypatch):
    """On CUDA the engine's host-side torch ops are bookkeeping: one intra-op thread, so a
    busy core never stalls a 64K-slot table write for an OS time slice. The CPU keeps its
    threads (the forward runs there)."""
    from breakgraph.engine.rank import claim_device

    threads = torch.get_num_threads()
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    try:
        claim_device(torch.device("cpu"))
        assert torch.get_num_threads() == threads and chosen == []
        claim_device(torch.device("cuda", 1))
        assert torch.get_num_threads() == 1 and chosen == [1]
    finally:
        torch.set_num_threads(threads)


def test_shutdown_before_exit_leaves_the_group_to_the_os(checkpoints, tmp_path):
    """The server's engine process exits right after its shutdown: it stops the workers
    (they exit at once, code 0) without tearing the group down on any rank (NCCL's teardown
    waited 10 s and more on two H200s), then ends through ``exit_if_stuck`` with its code."""
    out = _run_script(
        tmp_path,
        f"""
        import time
        from breakgraph.engine.tp import teardown
        from breakgraph.engine.args import EngineArgs
        from breakgraph.engine.engine import Engine
        def hang(*a, **k):
            time.sleep(3600)
        teardown.destroy_tp_group = hang  # rank 0 must not tear down (nor wait on it)
        teardown.leave_group = hang
        if __name__ == "__main__":
            e = Engine(EngineArgs(model_path={str(checkpoints["llama"])!r}, device="cpu",
                                  dtype="float32", max_total_tokens=512, tp_size=2))
            e.generate([[1, 2, 3]], None)
            start = time.monotonic()
            e.shutdown(leave_group=False)
            print("stopped in", round(time.monotonic() - start, 1), "codes",
                  *[p.exitcode for p in e.tp_driver.procs])
            teardown.exit_if_stuck(5)
            print("not reached")
        """,
    )
    assert out.returncode == 5, out.stderr
    words = out.stdout.split()
    assert words[:2] == ["stopped", "in"] and float(words[2]) < 5, out.stdout
    assert words[3:] == ["codes", "0"], out.stdout


def test_step_messages_cross_the_pipe_whole():
    """Rank 0's step message (metadata as packed int32s, the key as a nested record) comes
    back whole: every bank of the key, mode and field, with and without table writes; so do
    the setup and stop messages; anything else is refused."""
    from breakgraph.engine.graphs.key import BANKS, StepKey
    from breakgraph.engine.tp.wire import CODEC, StepMessage, Stop, WorkerSetup

    def i32(*v):
        return np.asarray(v, dtype=np.int32)

    writes = {"write_rows": i32(1, 4), "write_cols": i32(2, 5), "write_slots": i32(3, 6)}
    keys = [StepKey(bank, 16 * i, rest=i, tail=2 * i) for i, bank in enumerate(BANKS)]
    for i, key in enumerate(keys):
        mode, tw = ("decode", {}) if i % 2 else ("extend", writes)
        msg = StepMessage(mode, i32(5, 6, 7), i32(1, 2), i32(1024, 0), i32(1, 2), key,
                          prompt_rows=3, top_k=2, sent_at=12.5, **tw)  # fmt: skip
        back = CODEC.decode(CODEC.encode(msg))
        for name in ("mode", "key", "prompt_rows", "top_k", "sent_at"):
            assert getattr(back, name) == getattr(msg, name)
        for name in ("out_cache_loc", "req_pool_indices", "prefix_lens", "extend_lens"):
            assert getattr(back, name).tolist() == getattr(msg, name).tolist()
        assert (back.table_writes is None) == (not tw)
        if tw:
            assert [a.tolist() for a in back.table_writes] == [[1, 4], [2, 5], [3, 6]]
    assert CODEC.decode(CODEC.encode(Stop())) == Stop()
    assert CODEC.decode(CODEC.encode(WorkerSetup(77))) == WorkerSetup(77)
    with pytest.raises(TypeError):
        CODEC.encode(None)


@pytest.fixture(scope="module")
def deepseek_v4_checkpoint(tmp_path_factory) -> Path:
    from tests.support.deepseek_v4 import make_hf_deepseek_v4

    path = tmp_path_factory.mktemp("tp-deepseek-v4")
    make_hf_deepseek_v4().save_pretrained(path)
    return path


def test_deepseek_v4_tp2_logits_equal_tp1(deepseek_v4_checkpoint):
    """Query heads, output groups, indexer heads (scores all-reduced) and experts split; the
    one K = V head and the compressors replicated: a ragged batch over several windows, a
    prefix resumed on a window boundary (rows before it recomputed), chunks ending inside
    windows, greedy decode."""
    with tp1_and_tp2(deepseek_v4_checkpoint, chunked_prefill_size=29) as (tp1, tp2, t1, t2):
        (base,) = prompts([50], seed=2)
        batches = [
            (prompts([5, 33, 1, 21], seed=3), greedy(1)),
            ([base], greedy(1)),
            ([base + [7, 8, 9]], greedy(1)),  # resumed at 48 of the 50 cached tokens
            (prompts([40, 9], seed=4), greedy(4)),
        ]
        cached = []
        for ps, sp in batches:
            r1, r2 = tp1.generate(ps, sp), tp2.generate(ps, sp)
            assert [r.output_ids for r in r2] == [r.output_ids for r in r1]
            cached.append(r2[0].cached_tokens)
        assert cached[2] == 48
        assert_same_steps(t1, t2)


@pytest.fixture(scope="module")
def deepseek_v4_mtp_dir(tmp_path_factory) -> Path:
    """The tiny V4's config with one MTP layer (served with dummy weights: HF's checkpoint
    drops ``mtp.*``)."""
    from tests.support.deepseek_v4 import make_hf_deepseek_v4

    path = tmp_path_factory.mktemp("tp-deepseek-v4-mtp")
    make_hf_deepseek_v4(num_nextn_predict_layers=1).save_pretrained(path)
    return path


def _record_drafts(engine: Engine) -> list[list[list[int]]]:
    """Each verify step's drafts, per request (rank 0's, read after the step)."""
    seen: list = []
    drafter = engine.scheduler.spec.drafter
    propose = drafter.propose

    def record(reqs, lens, prefixes):
        drafts = propose(reqs, lens, prefixes)
        seen.append((drafts, list(lens)))
        return drafts

    drafter.propose = record
    return seen


def _drafts(seen) -> list[list[list[int]]]:
    return [[row[:n] for row, n in zip(d.tolist(), lens, strict=True)] for d, lens in seen]


V4_SPEC_PROMPTS = [(prompts([7], seed=4)[0] * 6)[:40], *prompts([9, 21], seed=5)]


def test_deepseek_v4_tp2_ngram_rewinds_every_ranks_state(deepseek_v4_checkpoint):
    """A verify step advances every rank's per-request state (V4's open compressor windows)
    through all its rows: each rank puts it back where a draft is rejected (rank_ops.py)."""
    plain = Engine(make_args(deepseek_v4_checkpoint)).generate(V4_SPEC_PROMPTS, greedy(20))
    tp2 = Engine(
        make_args(
            deepseek_v4_checkpoint, tp_size=2, speculative_algorithm="NGRAM",
            speculative_num_draft_tokens=3,
        )
    )  # fmt: skip
    try:
        spec = tp2.generate(V4_SPEC_PROMPTS, greedy(20))
        assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
        stats = tp2.scheduler.spec_stats
        assert stats.drafted > stats.accepted  # rejections: rewinds ran
    finally:
        tp2.shutdown()


@pytest.mark.parametrize(("synthetic", "overlap"), [(None, False), (2.5, True)])
def test_deepseek_v4_tp2_nextn_drafts_as_tp1(deepseek_v4_mtp_dir, synthetic, overlap):
    """NEXTN under TP: the MTP layer is sharded as the target's layers and every rank runs its
    rows and draft steps (rank 0 sends each op): the same drafts as TP1's, and greedy tokens
    equal plain decoding's. With synthetic acceptance (drafts kept whatever the target says)
    the rows over kept drafts and the backlog are exercised at every step; with overlap, the
    mirrored rows take the step's input ids on the device on every rank."""
    from breakgraph.common import envs

    kw = dict(load_format="dummy", speculative_algorithm="NEXTN", speculative_num_draft_tokens=3)
    kw |= dict(bench_synthetic_accept_length=synthetic, overlap_schedule=overlap)
    with envs.BENCH.override(synthetic is not None):
        tp1 = Engine(make_args(deepseek_v4_mtp_dir, **kw))
        tp2 = Engine(make_args(deepseek_v4_mtp_dir, tp_size=2, **kw))
    try:
        seen1, seen2 = _record_drafts(tp1), _record_drafts(tp2)
        r1 = tp1.generate(V4_SPEC_PROMPTS, greedy(16))
        r2 = tp2.generate(V4_SPEC_PROMPTS, greedy(16))
        assert [r.output_ids for r in r2] == [r.output_ids for r in r1]
        assert _drafts(seen2) == _drafts(seen1) and seen1
        assert tp2.scheduler.spec_stats == tp1.scheduler.spec_stats
        if synthetic is None:
            plain = Engine(make_args(deepseek_v4_mtp_dir, load_format="dummy"))
            want = plain.generate(V4_SPEC_PROMPTS, greedy(16))
            assert [r.output_ids for r in r2] == [r.output_ids for r in want]
        else:
            assert tp2.scheduler.spec_stats.accepted > 0
    finally:
        tp2.shutdown()
