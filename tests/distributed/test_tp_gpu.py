"""Tensor parallelism on two GPUs (NCCL): TP2 equals TP1 (float32 logits within the
all-reduce's rounding, greedy tokens), graph replay equals eager under TP2, no host sync
inside a step on rank 0, the floor graph replays on both ranks. Needs ``nvidia-h200-x2``."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA devices", allow_module_level=True)

from tests.support.gpu import engine, forbid_host_syncs_in_steps, run_workload  # noqa: E402
from tests.support.hf import LogitsTap  # noqa: E402

ATOL = 1e-4  # float32: the all-reduce sums partial products in another order


def assert_close_steps(a: LogitsTap, b: LogitsTap) -> None:
    assert len(a.steps) == len(b.steps) > 0
    for x, y in zip(a.steps, b.steps, strict=True):
        torch.testing.assert_close(y, x, atol=ATOL, rtol=ATOL)


def test_tp2_custom_all_reduce_equals_nccl_with_graphs(small_dir):
    """The custom all-reduce (on by default): the one-shot all-reduce over symmetric memory is set up on
    both ranks (not the NCCL fallback) and TP2 with it equals TP1 (greedy tokens, float32
    logits), graphs capturing it; no host sync inside a step. First in the file: the first TP
    group of the process, as a server's is (symmetric memory registers groups by name, and a
    later group reuses the name of an aborted one)."""
    tp1 = engine(small_dir, graphs=True)
    tp2 = engine(small_dir, graphs=True, tp_size=2)
    try:
        assert tp2.tp_driver.group.one_shot is not None, "the one-shot path fell back to NCCL"
        forbid_host_syncs_in_steps(tp2)
        tap1, tap2 = LogitsTap(tp1), LogitsTap(tp2)
        assert run_workload(tp2) == run_workload(tp1)
        assert tp2.runner.count("decode", "decode_long", "decode_penalized") > 0
        assert_close_steps(tap1, tap2)
    finally:
        tp2.shutdown()


def test_tp2_equals_tp1_with_graphs(small_dir):
    tp1 = engine(small_dir, graphs=True)
    tp2 = engine(small_dir, graphs=True, tp_size=2, disable_custom_all_reduce=True)  # NCCL
    try:
        assert tp2.tp_driver.group.one_shot is None
        forbid_host_syncs_in_steps(tp2)
        tap1, tap2 = LogitsTap(tp1), LogitsTap(tp2)
        assert run_workload(tp2) == run_workload(tp1)
        assert tp2.runner.count("prefill", "prefill_whole") > 0
        assert tp2.runner.count("decode", "decode_long", "decode_penalized") > 0
        assert_close_steps(tap1, tap2)
    finally:
        tp2.shutdown()


def test_tp2_graphs_equal_eager_and_keyed_replays(small_dir):
    graph = engine(small_dir, graphs=True, tp_size=2)
    try:
        tap_g = LogitsTap(graph)
        tokens = run_workload(graph)
        eager_steps = []
        runner = graph.runner
        forward = graph.scheduler.forward

        def eager(batch):  # the same engine, every step eager on both ranks
            logits = runner.forward_eager(batch)
            eager_steps.append(logits.float().clone())
            return logits

        graph.scheduler.forward = eager
        assert graph.flush_cache()
        assert run_workload(graph) == tokens
        for a, b in zip(tap_g.steps, eager_steps, strict=True):
            torch.testing.assert_close(b, a, atol=ATOL, rtol=ATOL)
        graph.scheduler.forward = forward
        # a key rank 0 names (the breakable bank on a step serving would replay whole)
        # replays on both ranks
        from breakgraph.engine.graphs.key import StepKey
        from breakgraph.forward_batch import ForwardBatch, ForwardMode

        rows = graph.req_pool.alloc()
        slots = graph.allocator.alloc(64)
        graph.req_pool.write(rows, 0, slots)
        batch = ForwardBatch.build(
            ForwardMode.EXTEND, list(range(5, 69)), slots.tolist(), [rows], [0], [64], graph.device
        )
        keyed = runner.forward(batch, StepKey("prefill", 64)).clone()
        torch.testing.assert_close(keyed, runner.forward_eager(batch), atol=ATOL, rtol=ATOL)
    finally:
        graph.shutdown()


def test_tp2_nextn_drafts_as_tp1_in_graphs():
    """NEXTN under TP2 with graphs: the MTP layer's draft steps replay its own decode bank on
    both ranks (all-reduces inside), its rows and the V4 state rewinds run as rank ops: the
    same greedy tokens and spec stats as TP1's NEXTN, which are plain decoding's (float32,
    dummy weights); no host sync inside a step on rank 0."""
    from breakgraph.engine.graphs.key import MTP_DECODE
    from breakgraph.engine.request import SamplingParams

    kw = {"context_length": 1024, "chunked_prefill_size": 256}
    spec = {"speculative_algorithm": "NEXTN", "speculative_num_draft_tokens": 3}
    g = torch.Generator().manual_seed(5)
    base = torch.randint(5, 1000, (9,), generator=g).tolist()
    ps = [(base * 5)[:40], *(torch.randint(5, 1000, (n,), generator=g).tolist() for n in (7, 33))]
    sp = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    plain = engine("deepseek-v4-tiny", graphs=True, **kw).generate(ps, sp)
    tp1 = engine("deepseek-v4-tiny", graphs=True, **kw, **spec)
    want = tp1.generate(ps, sp)
    tp2 = engine("deepseek-v4-tiny", graphs=True, tp_size=2, **kw, **spec)
    try:
        forbid_host_syncs_in_steps(tp2)
        graphs, replays = tp2.scheduler.spec.drafter.graphs, []
        replay = graphs.replay_streams
        graphs.replay_streams = lambda *a: replays.append(1) or replay(*a)
        got = tp2.generate(ps, sp)
        assert [r.output_ids for r in got] == [r.output_ids for r in want]
        assert [r.output_ids for r in want] == [r.output_ids for r in plain]
        assert tp2.scheduler.spec_stats == tp1.scheduler.spec_stats
        assert tp2.scheduler.spec_stats.steps > 0
        assert replays, f"the MTP's draft steps replay {MTP_DECODE} on rank 0"
    finally:
        tp2.shutdown()


DEATH_SCRIPT = r"""
import faulthandler, json, os, signal, sys, threading, time
faulthandler.dump_traceback_later(100, exit=True)  # a hang names where it waits
sys.path.insert(0, sys.argv[2])
from tests.support.gpu import engine
from breakgraph.engine.request import SamplingParams
eng = engine(sys.argv[1], graphs=True, tp_size=2, disable_custom_all_reduce=sys.argv[3] == "nccl")
(worker,) = eng.tp_driver.procs
sp = SamplingParams(max_new_tokens=2000, temperature=0.0, ignore_eos=True)
eng.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2, temperature=0.0))
killed_at = []
def kill():
    killed_at.append(time.monotonic())
    os.kill(worker.pid, signal.SIGKILL)
threading.Timer(0.5, kill).start()
error, deadline = None, time.monotonic() + 120
try:
    while time.monotonic() < deadline:  # decoding (graphs, all-reduce inside) when it lands
        eng.generate([[5, 6, 7]] * 4, sp)
except RuntimeError as e:
    error = str(e)
waited = time.monotonic() - killed_at[0] if killed_at else None
eng.shutdown()
print(json.dumps({"error": error, "waited_s": waited}))
"""


@pytest.mark.parametrize("all_reduce", ["one_shot", "nccl"])
def test_worker_death_mid_decode_fails_at_once_not_at_the_nccl_timeout(small_dir, all_reduce):
    """A worker killed during decode: rank 0's watchdog aborts the NCCL group, so the engine
    raises naming the rank within seconds instead of waiting out the collective timeout (then
    being killed by NCCL's watchdog); or, if NCCL's abort does not return (its reclaim waits
    for the killed peer) or a one-shot all-reduce holds the step on the GPU, the process exits
    with code 1 saying so. Never a hang (the script dumps its threads and exits at 100 s). In
    a subprocess: an abort that went wrong must not take the test session with it."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    here = str(Path(__file__).resolve().parents[2])  # the repository: tests.support imports
    out = subprocess.run(
        [sys.executable, "-c", DEATH_SCRIPT, str(small_dir), here, all_reduce],
        capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert "Timeout (" not in out.stderr, out.stderr[-6000:]  # the faulthandler: a hang
    assert "TP worker rank 1 exited" in out.stderr, out.stderr[-6000:]
    if out.returncode != 0:  # the abort hung, or the one-shot all-reduce: the watchdog's exit
        assert "exiting the engine process" in out.stderr, out.stderr[-6000:]
        return
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["error"] and "TP worker rank 1" in result["error"], out.stderr[-3000:]
    assert result["waited_s"] < 30, result


def test_one_shot_all_reduce_paths_equal_nccl_bitwise_in_graphs():
    """``bench allreduce`` on two GPUs: the one-shot all-reduce, with torch's fused staging copy
    and with a copy kernel in front, equals NCCL bitwise at decode's and prefill's sizes,
    each captured 4 times in one CUDA graph and replayed; the fused all-reduce + residual add
    + RMSNorm matches a float32 reference with the same bits on both ranks, before and after
    its replays, at 1, 7 and 64 rows."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "breakgraph.cli", "bench", "allreduce", "--kib", "8", "64", "1024",
         "--ops", "4", "--norm-rows", "1", "7", "64"],
        capture_output=True, text=True, timeout=170,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split() for line in out.stdout.splitlines()]
    sizes = [r for r in rows if r[:1] in (["8"], ["64"], ["1024"]) and len(r) == 6]
    norms = [r for r in rows if r[:1] in (["1"], ["7"], ["64"]) and len(r) == 5]
    assert len(sizes) == 3 and all(r[-1] == "True" for r in sizes), out.stdout
    assert len(norms) == 3 and all(r[-1] == "True" for r in norms), out.stdout
