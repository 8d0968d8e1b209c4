"""DeepSeek V4 through the engine's graph banks on the CPU, each bucket replayed the way a CUDA
graph replays it (tests/support/cpu_graphs.py: the live rows copied into the bank's static
buffers, the rest padding at slot 0; the captured parts run on the capture's context, the
eager breaks on the live step): the live rows' logits equal the eager engine's, step by step,
and HF's, for ragged prefill buckets, a cached prefix past several HCA windows, chunked
prompts, mixed chunks, and decode batches padded to a graph batch size or over the largest.

A tiny random HF V4 in float32 (tests/support/deepseek_v4.py: CSA windows of 4 tokens, HCA
of 16, a sliding window of 8), with ``index_topk`` at least every entry a prompt here has."""

from __future__ import annotations

import pytest
import torch

from breakgraph.engine.graphs.key import DECODE, EAGER, PREFILL
from breakgraph.engine.request import SamplingParams
from tests.support.cpu_graphs import GraphPair
from tests.support.deepseek_v4 import make_hf_deepseek_v4
from tests.support.hf import ATOL, assert_last_logits_hf, hf_last_logits, prompts

BUCKETS = [16, 32, 64, 128]
DECODE_MAX_BS = 4  # decode buckets 1, 2, 4; a larger batch replays 4 in pieces


@pytest.fixture(scope="module")
def v4_checkpoint(tmp_path_factory):
    model = make_hf_deepseek_v4()
    path = tmp_path_factory.mktemp("tiny-deepseek-v4-graphs")
    model.save_pretrained(path)
    return model, path


def pair_of(path, **kw) -> GraphPair:
    """An eager engine and a CPU-graph one over ``path`` (this file's buckets)."""
    return GraphPair(path, BUCKETS, DECODE_MAX_BS, **kw)


def test_every_prefill_bucket_with_ragged_requests_equals_eager_and_hf(v4_checkpoint):
    hf, path = v4_checkpoint
    pair = pair_of(path)
    # one step per bucket: 9 -> 16, 20 -> 32, 5+33+1+10 = 49 -> 64, 5+33+1+70 = 109 -> 128
    steps = [prompts(1, [9], seed=1), prompts(1, [20], seed=2), prompts(4, [5, 33, 1, 10]),
             prompts(4, [5, 33, 1, 70], seed=3)]  # fmt: skip
    for ps in steps:
        pair.generate(ps, max_new_tokens=2)  # and one decode step, padded to its bucket
        for row, p in enumerate(ps):
            assert_last_logits_hf(pair.graph_tap.steps[-2][row], hf, p)
    assert pair.buckets(PREFILL) == BUCKETS
    assert pair.buckets(DECODE) == [1, 4]  # one request; four
    assert pair.buckets(EAGER) == []
    pair.assert_same_logits()
    # the graph breaks where the step's requests are read: each compressed layer's pooling
    # and attention, a sliding layer's attention (TINY_V4: sliding, CSA, HCA, CSA)
    assert {g.num_breaks for g in pair.prefill.bank.graphs.values()} == {1 + 2 + 2 + 2}


def test_cached_prefix_past_several_hca_windows_equals_eager_and_hf(v4_checkpoint):
    """A hit resumes at a multiple of 16 (the HCA window) past four windows and recomputes
    the 4 tokens before it; its step replays a bucket with the prefix's compressed entries
    read by the breaks from the live step."""
    hf, path = v4_checkpoint
    pair = pair_of(path)
    (base,) = prompts(1, [70], seed=5)
    pair.generate([base])
    for extra in ([7, 8, 9], list(range(20, 41)), list(range(50, 110))):
        extended = base + extra
        (res,) = pair.generate([extended], max_new_tokens=3)
        assert res.cached_tokens == 64
        assert_last_logits_hf(pair.graph_tap.steps[-3][0], hf, extended)
    assert pair.buckets(PREFILL) == [16, 32, 128]  # the first 70 tokens' step too
    pair.assert_same_logits()


def test_chunked_prompts_carry_open_windows_between_replays(v4_checkpoint):
    """Chunks of 13 tokens replay bucket 16: every chunk ends inside a window, so the
    compressors' open windows carry from one replay to the next (per-request state)."""
    hf, path = v4_checkpoint
    pair = pair_of(path, chunked_prefill_size=13)
    ps = prompts(2, [50, 9], seed=6)
    pair.generate(ps, max_new_tokens=4)
    assert pair.buckets(PREFILL) == [16] and pair.buckets(EAGER) == []
    pair.assert_same_logits()
    for p in ps:
        ref = hf_last_logits(hf, p)
        assert any(
            torch.allclose(row, ref, atol=ATOL, rtol=1e-4)
            for step in pair.graph_tap.steps
            for row in step
        ), f"no replay produced the logits of the {len(p)}-token prompt"


def test_prompt_over_the_largest_bucket_runs_eagerly_and_the_rest_replay(v4_checkpoint):
    hf, path = v4_checkpoint
    pair = pair_of(path, chunked_prefill_size=256)
    (long,) = prompts(1, [200], seed=7)
    pair.generate([long], max_new_tokens=3)
    assert_last_logits_hf(pair.graph_tap.steps[0][0], hf, long)
    assert [k.reason for k in pair.graphs.runner.step_counts if k.eager] == [
        "over the largest bucket"
    ]
    assert pair.buckets(DECODE) == [1]
    pair.assert_same_logits()


def test_mixed_chunks_replay_prefill_buckets(v4_checkpoint):
    """Running requests decode one row each inside a long prompt's chunks (mixed steps)."""
    _, path = v4_checkpoint
    pair = pair_of(path, chunked_prefill_size=32, enable_mixed_chunk=True)
    short = prompts(3, [10, 4, 7], seed=8)
    (long,) = prompts(1, [90], seed=9)
    sp = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = []
    for eng in (pair.eager, pair.graphs):
        rids = [eng.add_request(p, sp) for p in short]
        eng.step()
        rids.append(eng.add_request(long, sp))
        got: dict[str, list[int]] = {r: [] for r in rids}
        while eng.has_work:
            for o in eng.step():
                got[o.rid].extend(o.token_ids)
        outputs.append([got[r] for r in rids])
    assert outputs[0] == outputs[1]
    assert pair.buckets(PREFILL) == [16, 32]  # the short prompts' step; the mixed chunks
    pair.assert_same_logits()


def test_decode_batches_padded_and_in_pieces_equal_eager_and_hf(v4_checkpoint):
    """Seven requests finishing one after another: decode batches of 7 (pieces of 4 and a
    last one padded to 4), 6, 5 (4 + 1), 4, 3 (padded to 4), 2 and 1, each equal to eager;
    the greedy tokens equal HF ``generate``'s."""
    hf, path = v4_checkpoint
    pair = pair_of(path)
    ps = prompts(7, [30, 13, 3, 17, 8, 21, 5], seed=10)
    lengths = [4, 5, 6, 7, 8, 9, 10]
    got = pair.generate(ps, max_new_tokens=lengths)
    assert pair.buckets(DECODE) == [1, 2, 4]
    pair.assert_same_logits()
    for p, n, res in zip(ps, lengths, got, strict=True):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([p]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                eos_token_id=None,
            )  # fmt: skip
        assert res.output_ids == out[0, len(p) :].tolist()


def test_compressed_attention_kernels_under_graphs_equal_eager():
    """The breaks' and decode graphs' Triton kernels (under Triton's interpreter) on bucket
    rows sliced to the live ones, and the decode indexer over the table's whole width."""
    pytest.importorskip("triton")
    from tests.kernels.test_triton_interpret import interpret

    interpret("tests.kernels.interpret_deepseek_v4_graphs", 1)
