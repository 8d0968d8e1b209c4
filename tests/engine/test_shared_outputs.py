"""A graph bank's buckets share one output buffer per output, the largest bucket's
(graph/bank.py): every bucket of every bank (decode, penalized decode, prefill, Gemma 4's head and
tail) replays into the same storage, and what the engine computes through them is
still what the eager engine computes, step by step, with and without overlap scheduling
(where step k+1 is launched, into the same buffer, before step k is read back).

The banks run on the CPU the way a CUDA graph replays them (tests/support/cpu_graphs.py): a
smaller bucket's replay copies into the leading rows of the largest one's outputs, as its
captured copy does on the GPU."""

from __future__ import annotations

import pytest
import torch

from breakgraph.engine.graphs.key import DECODE, DECODE_PENALIZED, PREFILL, TAIL
from breakgraph.engine.penalties import PenaltyPool
from breakgraph.engine.request import SamplingParams
from tests.support.cpu_graphs import GraphPair, install_cpu_graphs
from tests.support.engines import make_engine
from tests.support.gemma4 import make_hf_gemma4
from tests.support.hf import LogitsTap, make_hf_model, prompts

BUCKETS = [16, 32, 64]
DECODE_MAX_BS = 8  # decode buckets 1, 2, 4, 8; a larger batch replays 8 in pieces


def _checkpoint(tmp_path_factory, name: str, model) -> str:
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def dense_path(request, tmp_path_factory):
    return _checkpoint(tmp_path_factory, request.param, make_hf_model(request.param))


@pytest.fixture(scope="module")
def gemma_path(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "gemma4-text", make_hf_gemma4("text"))


def _parts(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def assert_one_output_storage(bank) -> None:
    """Every bucket's last output (its capture's, or its last replay's) lies in the bank's
    shared outputs: the same address, its own leading rows."""
    assert bank.outputs is not None and any(t is not None for t in bank.outputs), bank.name
    for size, graph in bank.graphs.items():
        for part, shared in zip(_parts(graph.output), bank.outputs, strict=True):
            if shared is None:
                continue
            assert part.data_ptr() == shared.data_ptr(), (bank.name, size)
            assert part.shape == (size, *shared.shape[1:]), (bank.name, size)


def _steps(pair: GraphPair) -> None:
    """A prefill step per bucket (one request, then ragged batches) and decode batches of
    1, 3, 5 and 11 rows (over the largest bucket: pieces of 8 and 4)."""
    pair.generate(prompts(1, [5], seed=1), max_new_tokens=3)  # bucket 16, decode 1
    pair.generate(prompts(3, [9, 12, 7], seed=2), max_new_tokens=3)  # 28 -> 32, decode 4
    pair.generate(prompts(5, [9, 12, 7, 10, 11], seed=3), max_new_tokens=[2, 4, 3, 5, 2])
    pair.generate(prompts(11, [3, 5] * 5 + [4], seed=4), max_new_tokens=2)


@pytest.mark.parametrize("overlap", [False, True])
def test_buckets_share_one_output_and_replay_equals_eager(dense_path, overlap):
    pair = GraphPair(dense_path, BUCKETS, DECODE_MAX_BS, overlap_schedule=overlap)
    banks = {**pair.prefill.banks, **pair.decode.banks}
    assert {PREFILL, DECODE} <= set(banks)
    for bank in banks.values():  # as captured
        assert_one_output_storage(bank)
    _steps(pair)
    pair.assert_same_logits()
    assert pair.buckets(DECODE) == [1, 2, 4, 8]  # 11 rows: 8, then 3 in bucket 4
    assert pair.buckets(PREFILL) == [16, 32, 64]
    for bank in banks.values():  # and after replays of every size
        assert_one_output_storage(bank)


def test_a_decode_steps_logits_are_the_shared_buffer(dense_path):
    """What the scheduler samples from is a view of the decode bank's one logits buffer,
    whichever bucket the step replayed: so the next replay overwrites it, and the scheduler
    samples a step before it launches the next (overlap included: the test above)."""
    eng = make_engine(dense_path, overlap_schedule=True)
    _, decode = install_cpu_graphs(eng, BUCKETS, DECODE_MAX_BS)
    seen = []
    inner = eng.scheduler.forward

    def forward(batch):
        logits = inner(batch)
        seen.append((batch.mode.name, batch.batch_size, logits.data_ptr()))
        return logits

    eng.scheduler.forward = forward
    sp = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
    for n in (1, 2, 6):
        eng.generate(prompts(n, [4] * n, seed=n), sp)
    shared = decode.bank.outputs[0].data_ptr()
    decode_steps = [(bs, ptr) for mode, bs, ptr in seen if mode == "DECODE"]
    assert {bs for bs, _ in decode_steps} == {1, 2, 6}
    assert all(ptr == shared for _, ptr in decode_steps)


def test_the_penalized_bank_shares_both_outputs_and_equals_eager(dense_path):
    """With a fixed penalty pool the penalized decode bank replays (logits, penalized logits)
    into two shared buffers; penalized greedy outputs equal the eager engine's, with and
    without overlap."""
    sp = [
        SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True,
                       repetition_penalty=1.3, frequency_penalty=0.5),
        SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True,
                       presence_penalty=0.8, logit_bias={"7": 5.0}),
        SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True, min_new_tokens=3),
    ]  # fmt: skip
    ps = prompts(3, [6, 9, 4], seed=7)
    want = [r.output_ids for r in make_engine(dense_path).generate(ps, sp)]
    for overlap in (False, True):
        eng = make_engine(dense_path, overlap_schedule=overlap)
        pool = PenaltyPool(eng.runner.vocab_size, eng.device, set(), capacity=4)
        eng.runner.penalties = eng.scheduler.penalties = pool
        _, decode = install_cpu_graphs(eng, BUCKETS, DECODE_MAX_BS)
        assert decode.penalized_bank is not None
        got = [r.output_ids for r in eng.generate(ps, sp)]
        assert got == want, overlap
        assert eng.runner.count(DECODE_PENALIZED) > 0
        assert len(decode.penalized_bank.outputs) == 2
        assert_one_output_storage(decode.penalized_bank)


def test_gemma4_tail_and_head_banks_share_their_outputs_and_equal_eager(gemma_path):
    """Gemma 4's bounded prefill: the head bank's (hidden, per-layer inputs) and the tail
    bank's final hidden states, each one buffer per bank; logits equal the eager engine's."""
    eager = make_engine(gemma_path)
    graphs = make_engine(gemma_path)
    prefill, decode = install_cpu_graphs(graphs, BUCKETS, DECODE_MAX_BS, tail_max_rows=8)
    assert prefill.tail is not None
    eager_tap, graph_tap = LogitsTap(eager), LogitsTap(graphs)
    sp = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
    for n, lengths in ((1, [5]), (3, [9, 12, 7]), (5, [9, 12, 7, 10, 11])):
        ps = prompts(n, lengths, seed=n)
        got = [r.output_ids for r in graphs.generate(ps, sp)]
        assert got == [r.output_ids for r in eager.generate(ps, sp)]
    assert sorted({k.size for k in graphs.runner.step_counts if k.bank == PREFILL}) == [16, 32, 64]
    assert {k.tail for k in graphs.runner.step_counts if k.bank == PREFILL} == {1, 4, 8}
    assert len(graph_tap.steps) == len(eager_tap.steps)
    for g, e in zip(graph_tap.steps, eager_tap.steps, strict=True):
        torch.testing.assert_close(g, e, atol=2e-5, rtol=1e-5)
    head = prefill.bank
    assert len(head.outputs) == 2 and all(t is not None for t in head.outputs)
    for bank in (head, prefill.banks[TAIL], decode.bank):
        assert_one_output_storage(bank)
