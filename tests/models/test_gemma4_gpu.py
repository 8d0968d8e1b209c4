"""Gemma 4 on the GPU: bounded replay (head bank per token bucket, tail bank per tail-row
count) equals eager, logits and greedy tokens, over ragged, prefix-hit and chunked steps;
every tail bucket replays equal to the eager tail; fast prefill on equals off, with no host
sync inside a step; nothing compiles after the serving-shape warm-up."""

from __future__ import annotations

import pytest
import torch

from tests.support.gemma4 import gpu_engine, make_hf_gemma4, workload
from tests.support.gpu import WARMUP_SCRIPT, forbid_host_syncs_in_steps, run_script
from tests.support.hf import LogitsTap

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


@pytest.fixture(scope="module")
def gemma4_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-gemma4-gpu")
    make_hf_gemma4("text").save_pretrained(path)
    return path


def test_bounded_replay_equals_eager(gemma4_dir):
    eager, graph = gpu_engine(gemma4_dir, False), gpu_engine(gemma4_dir, True)
    tail = graph.runner.prefill_graphs.tail
    assert tail is not None and sorted(tail.bank.graphs) == [1, 2, 4, 8, 16]
    replays = []
    run = tail.bank.replay
    tail.bank.replay = lambda size, n, **live: replays.append(n) or run(size, n, **live)
    tap_e, tap_g = LogitsTap(eager), LogitsTap(graph)
    assert workload(graph) == workload(eager)
    assert replays and graph.runner.count("prefill", "prefill_whole") > 0
    assert len(tap_e.steps) == len(tap_g.steps)
    for a, b in zip(tap_e.steps, tap_g.steps, strict=True):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)


def test_every_tail_bucket_replays_the_eager_tail(gemma4_dir):
    from breakgraph.forward_batch import ForwardBatch, ForwardMode, forward_context
    from breakgraph.graph import smallest_bucket

    eng = gpu_engine(gemma4_dir, True)
    graphs = eng.runner.prefill_graphs
    model = eng.model
    inputs = model.tail_inputs()
    for n in (1, 3, 8, 13, 16):
        # n requests of one new token over slot 0 (the padding row's KV)
        batch = ForwardBatch.build(
            ForwardMode.EXTEND, [5] * n, [0] * n, [graphs.pad_req_idx] * n, [0] * n, [1] * n,
            "cuda",
        )  # fmt: skip
        live = {"positions": batch.positions}
        for name, (shape, dtype) in inputs.items():
            live[name] = torch.randn(n, *shape, device="cuda").to(dtype)
        with torch.inference_mode(), forward_context(graphs._context(batch)):
            ref = model.forward_tail(
                live["hidden"], live.get("per_layer_inputs"), live["positions"]
            )
            size = smallest_bucket(graphs.tail.bank.sizes, n)
            got = graphs.tail.bank.replay(size, n, **live)[:n]
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_fast_prefill_on_equals_off_with_graphs_and_no_host_sync(gemma4_dir):
    """Graphs on: the KV-shared layers on the tail rows only (bounded replay) or on every
    row give the same greedy tokens and logits (float32), and a bounded step never syncs
    the host before its sampled ids exist."""
    outs, taps = [], []
    for fast in (True, False):  # the flag decides which banks are captured: set it first
        eng = gpu_engine(gemma4_dir, True, kv_sharing_fast_prefill=fast)
        assert (eng.runner.prefill_graphs.tail is not None) == fast
        if fast:
            forbid_host_syncs_in_steps(eng)
        taps.append(LogitsTap(eng))
        outs.append(workload(eng))
    assert outs[0] == outs[1]
    assert len(taps[0].steps) == len(taps[1].steps)
    for a, b in zip(taps[0].steps, taps[1].steps, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_no_compilation_after_serving_shape_warmup(gemma4_dir):
    """The warm-up reaches every kernel variant of the head and tail banks, the eager tail
    (more tail rows than the largest bucket) and long-prefix hits on sliding layers."""
    result = run_script(WARMUP_SCRIPT, gemma4_dir, "serving-shapes")
    assert result["warmup_requests"] > 20
    assert result["after_ready"] == 0, result["names"]
