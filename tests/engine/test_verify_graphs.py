"""Verify steps and a draft model's first step replay the decode graphs: each of their rows a
decode row of its request (``ForwardBatch.as_decode_rows``), decode attention over the paged
KV up to the row's own position. On the CPU: the rows' logits equal the extend step's
(float32, ragged, over a cached prefix, Llama and Gemma 4's sliding and KV-shared layers),
and through the CPU graph harness (tests/support/cpu_graphs.py) the dispatcher keys those
steps to the decode bank, greedy tokens equal plain decoding's, chained steps too."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from breakgraph.engine.graphs.base import GraphTarget
from breakgraph.engine.graphs.decode import DecodeGraphs
from breakgraph.engine.graphs.key import DECODE, EAGER, PREFILL
from breakgraph.engine.prefill import extend_batch
from breakgraph.engine.request import SamplingParams
from tests.support.cpu_graphs import capture_on_cpu, install_cpu_graphs
from tests.support.engines import assert_no_leak, make_engine
from tests.support.hf import prompts


@pytest.fixture
def llama_dir(tiny_llama_dir):
    return tiny_llama_dir


@pytest.fixture(scope="module")
def gemma4_dir(tmp_path_factory):
    pytest.importorskip("transformers.models.gemma4")
    from tests.support.gemma4 import make_hf_gemma4

    path = tmp_path_factory.mktemp("verify-gemma4")
    make_hf_gemma4("text").save_pretrained(path)
    return path


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def _step(engine, ids: list[list[int]], rows: list[int], prefixes: list[int]):
    """An extend step of ``ids[i]`` new tokens for table row ``rows[i]`` over its first
    ``prefixes[i]`` positions, fresh slots written into the table, every row's logits."""
    ext = [len(t) for t in ids]
    slots = engine.allocator.alloc(sum(ext))
    flat = np.concatenate([np.asarray(t, dtype=np.int32) for t in ids])
    batch = extend_batch(flat, slots, rows, prefixes, ext, engine.req_pool, engine.device)
    batch.logits_rows = torch.arange(sum(ext), dtype=torch.int64)
    return batch


@pytest.mark.parametrize("family", ["llama", "gemma4"])
def test_decode_rows_give_the_extend_steps_logits(llama_dir, gemma4_dir, family):
    """Two requests over cached prefixes of 37 and 12 tokens (past Gemma 4's sliding window
    of the tiny config), 4 and 1 new rows: the decode rows' logits equal the extend step's."""
    engine = make_engine(llama_dir if family == "llama" else gemma4_dir)
    runner = engine.runner
    rows = [engine.req_pool.alloc(), engine.req_pool.alloc()]
    prefix = prompts(2, [37, 12], seed=4)
    runner.forward_eager(_step(engine, prefix, rows, [0, 0]))  # the prefixes' KV
    new = prompts(2, [4, 1], seed=5)
    batch = _step(engine, new, rows, [37, 12])
    want = runner.forward_eager(batch)
    got = runner._eager(batch.as_decode_rows())  # the same rows, stored again, as decode rows
    assert got.shape == want.shape == (5, runner.vocab_size)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    rows_batch = batch.as_decode_rows()
    assert rows_batch.seq_lens_cpu == [38, 39, 40, 41, 13]
    assert rows_batch.req_pool_indices_cpu == [rows[0]] * 4 + [rows[1]]


def _draft_graphs(engine) -> DecodeGraphs:
    """The draft model's decode bank on the CPU (as ``rank.capture_graphs`` captures it)."""
    drafter = engine.scheduler.spec.drafter.runner
    pad = engine.runner.decode_graphs.pad_req_idx
    target = GraphTarget(drafter.model, drafter.kv_pool, drafter.req_to_token, pad, "cpu",
                         check_addresses=True)  # fmt: skip
    graphs = DecodeGraphs(target, 16)
    for bank in graphs.banks.values():
        capture_on_cpu(bank)
    drafter.decode_graphs = graphs
    drafter.dispatcher.decode = graphs
    return graphs


def _keys(runner) -> list[tuple[bool, str]]:
    """Every step's (``decode_rows``, bank) from now on."""
    seen = []
    dispatch = runner.dispatch

    def spy(batch, penalized=False):
        key = dispatch(batch, penalized)
        seen.append((batch.decode_rows, key.bank))
        return key

    runner.dispatch = spy
    return seen


@pytest.mark.parametrize(("algorithm", "overlap"), [("NGRAM", False), ("STANDALONE", True)])
def test_verify_steps_replay_the_decode_bank(llama_dir, algorithm, overlap):
    """Verify steps (chained ones too: a draft model, overlap on) and the draft's first step
    go through the decode bank; greedy tokens equal plain decoding's; nothing leaks."""
    ps = [(prompts(1, [7], seed=1)[0] * 6)[:40], *prompts(2, [9, 30], seed=3)]
    plain = make_engine(llama_dir).generate(ps, greedy(20))
    engine = make_engine(
        llama_dir, speculative_algorithm=algorithm, speculative_num_draft_tokens=3,
        speculative_draft_model_path=str(llama_dir), overlap_schedule=overlap,
    )  # fmt: skip
    install_cpu_graphs(engine, [16, 32, 64, 128], 16)
    seen = _keys(engine.runner)
    draft_seen = None
    if algorithm == "STANDALONE":
        _draft_graphs(engine)
        draft_seen = _keys(engine.scheduler.spec.drafter.runner)
    out = engine.generate(ps, greedy(20))
    assert [r.output_ids for r in out] == [r.output_ids for r in plain]
    assert engine.scheduler.spec_stats.steps > 0
    verify = [bank for rows, bank in seen if rows]
    assert verify and set(verify) == {DECODE}, seen
    assert EAGER not in {bank for _, bank in seen}, seen
    if draft_seen is not None:
        first = [bank for rows, bank in draft_seen if rows]
        assert first and set(first) == {DECODE}, draft_seen
    assert_no_leak(engine)


def test_a_model_with_request_state_keeps_the_prefill_bank(tmp_path, llama_dir):
    """DeepSeek V4's decode step advances each request's compressors one token: several rows
    of one request are not decode rows there; its verify steps replay the prefill bank."""
    from tests.support.deepseek_v4 import make_hf_deepseek_v4

    make_hf_deepseek_v4().save_pretrained(tmp_path)
    ps = [(prompts(1, [6], seed=7)[0] * 5)[:30]]
    plain = make_engine(tmp_path).generate(ps, greedy(12))
    engine = make_engine(
        tmp_path, speculative_algorithm="STANDALONE", speculative_num_draft_tokens=3,
        speculative_draft_model_path=str(llama_dir),
    )  # fmt: skip
    install_cpu_graphs(engine, [16, 32, 64, 128], 4)
    assert not engine.runner.decode_graphs.rows_per_request_ok
    seen = _keys(engine.runner)
    out = engine.generate(ps, greedy(12))
    assert [r.output_ids for r in out] == [r.output_ids for r in plain]
    assert engine.scheduler.spec_stats.steps > 0
    assert {bank for rows, bank in seen if rows} == {PREFILL}, seen
