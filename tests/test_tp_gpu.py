"""Tensor parallelism on two GPUs (NCCL): TP2 equals TP1 (float32 logits within the
all-reduce's rounding, greedy tokens), graph replay equals eager under TP2, no host sync
inside a step on rank 0, the floor graph replays on both ranks. Needs ``nvidia-h200-x2``."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA devices", allow_module_level=True)

from tests.conftest import LogitsTap  # noqa: E402
from tests.test_engine_gpu import (  # noqa: E402
    engine,
    forbid_host_syncs_in_steps,
    run_workload,
    small_dir,  # noqa: F401 (fixture)
)

ATOL = 1e-4  # float32: the all-reduce sums partial products in another order


def assert_close_steps(a: LogitsTap, b: LogitsTap) -> None:
    assert len(a.steps) == len(b.steps) > 0
    for x, y in zip(a.steps, b.steps, strict=True):
        torch.testing.assert_close(y, x, atol=ATOL, rtol=ATOL)


def test_tp2_equals_tp1_with_graphs(small_dir):  # noqa: F811
    tp1 = engine(small_dir, graphs=True)
    tp2 = engine(small_dir, graphs=True, tp_size=2)
    try:
        forbid_host_syncs_in_steps(tp2)
        tap1, tap2 = LogitsTap(tp1), LogitsTap(tp2)
        assert run_workload(tp2) == run_workload(tp1)
        assert tp2.runner.step_counts["extend_graph"] > 0
        assert tp2.runner.step_counts["decode_graph"] > 0
        assert_close_steps(tap1, tap2)
    finally:
        tp2.shutdown()


def test_tp2_graphs_equal_eager_and_floor_replays(small_dir):  # noqa: F811
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
        # the floor (one whole graph per step shape) replays on both ranks
        from breakgraph.forward_batch import ForwardBatch, ForwardMode

        rows = graph.req_pool.alloc()
        slots = graph.allocator.alloc(64)
        graph.req_pool.write(rows, 0, slots)
        batch = ForwardBatch.build(
            ForwardMode.EXTEND, list(range(5, 69)), slots.tolist(), [rows], [0], [64], graph.device
        )
        replay = runner.capture_whole(batch)
        torch.testing.assert_close(replay(), runner.forward_eager(batch), atol=ATOL, rtol=ATOL)
    finally:
        graph.shutdown()
