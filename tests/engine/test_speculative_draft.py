"""Speculative decoding with a draft model (``STANDALONE``, engine/draft.py) and the
benchmark's synthetic acceptance: greedy tokens equal plain decoding's token for token
(float32, tiny HF Llamas), a draft equal to the target has every draft token kept (so the
draft's KV is right at every position: prefill mirrored, its own steps, the last kept token
written a round later), no slot leaked, and the refusals in one line."""

from __future__ import annotations

import pytest

from breakgraph.common import envs
from breakgraph.engine.request import SamplingParams
from tests.support.engines import assert_no_leak, make_engine
from tests.support.hf import make_hf_model, prompts


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    make_hf_model("llama").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """Another Llama of the target's vocabulary, other weights: it drafts badly."""
    path = tmp_path_factory.mktemp("draft")
    make_hf_model("llama", seed=7).save_pretrained(path)
    return path


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def standalone(path, draft, k: int = 4, **kw):
    return make_engine(
        path, speculative_algorithm="STANDALONE", speculative_draft_model_path=str(draft),
        speculative_num_draft_tokens=k, **kw,
    )  # fmt: skip


PROMPTS = prompts(4, [5, 17, 30, 9], seed=11)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_draft_equal_to_the_target_has_every_token_kept(target_dir, overlap):
    """Its drafts are the target's own greedy tokens: every verify keeps all k, which needs
    the draft's KV at every position (its last kept token's written the next round)."""
    plain = make_engine(target_dir).generate(PROMPTS, greedy(24))
    engine = standalone(target_dir, target_dir, k=3, overlap_schedule=overlap)
    spec = engine.generate(PROMPTS, greedy(24))
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    stats = engine.scheduler.spec_stats
    assert stats.steps > 0
    assert stats.accepted >= 0.95 * stats.drafted, stats
    assert stats.mean_accepted_length > 3.5
    assert_no_leak(engine)


def test_another_draft_model_keeps_the_greedy_tokens(target_dir, draft_dir):
    """A draft of other weights: few drafts kept, the same tokens; a cached prefix, a
    penalized request (plain steps, mirrored) and a sampled seeded one beside it."""
    plain_engine = make_engine(target_dir)
    plain = plain_engine.generate(PROMPTS, greedy(20))
    engine = standalone(target_dir, draft_dir)
    spec = engine.generate(PROMPTS, greedy(20))
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    hit = [PROMPTS[2] + [7, 8, 9]]  # a radix hit on the third prompt
    assert engine.generate(hit, greedy(12))[0].output_ids == (
        plain_engine.generate(hit, greedy(12))[0].output_ids
    )
    sampled = SamplingParams(max_new_tokens=16, temperature=0.9, seed=3, ignore_eos=True)
    penalized = greedy(16, repetition_penalty=1.3)
    first = engine.generate(PROMPTS[:3], [sampled, penalized, greedy(16)])
    again = engine.generate(PROMPTS[:3], [sampled, penalized, greedy(16)])
    assert [r.output_ids for r in first] == [r.output_ids for r in again]
    assert first[2].output_ids == plain[2].output_ids[:16]
    assert_no_leak(engine)


def test_standalone_refusals_name_the_cause(target_dir, tmp_path):
    with pytest.raises(ValueError, match="without --speculative-draft-model-path"):
        make_engine(target_dir, speculative_algorithm="STANDALONE")
    with pytest.raises(ValueError, match="NEXTN is not supported for LlamaForCausalLM"):
        make_engine(target_dir, speculative_algorithm="NEXTN")
    other = make_hf_model("qwen3")  # another vocabulary size
    other.config.vocab_size = other.config.vocab_size + 64
    other.resize_token_embeddings(other.config.vocab_size)
    other.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="vocabulary"):
        standalone(target_dir, tmp_path)


def test_synthetic_acceptance_is_a_benchmark_aid(target_dir, draft_dir):
    """Refused outside a benchmark; inside, each verify keeps the asked mean (a draft model
    that agrees rarely, and n-gram drafts on prompts without repeats), and nothing leaks."""
    with pytest.raises(ValueError, match="BREAKGRAPH_BENCH=1"):
        standalone(target_dir, draft_dir, bench_synthetic_accept_length=3.5)
    with envs.BENCH.override(True):
        for engine in (
            standalone(target_dir, draft_dir, bench_synthetic_accept_length=3.5),
            make_engine(
                target_dir, speculative_algorithm="NGRAM", speculative_num_draft_tokens=4,
                bench_synthetic_accept_length=3.5,
            ),
        ):  # fmt: skip
            outs = engine.generate(PROMPTS, greedy(60))
            assert [len(r.output_ids) for r in outs] == [60] * 4
            stats = engine.scheduler.spec_stats
            assert 3.2 < stats.mean_accepted_length < 3.8, stats
            assert_no_leak(engine)


def test_slots_exact_after_thousands_of_verify_steps(target_dir, draft_dir):
    """Sampled requests, so that drafts are often rejected: verify steps free rows over and
    over; after hundreds of them (and thousands of draft steps), with requests finishing and starting in
    between, every slot is accounted for."""
    engine = standalone(target_dir, draft_dir, k=3, max_total_tokens=4096)
    ps = prompts(6, [3, 40, 11, 25, 8, 60], seed=21)
    lens = [150, 60, 250, 40, 200, 100]
    sps = [
        SamplingParams(max_new_tokens=n, temperature=1.0, seed=i, ignore_eos=True)
        for i, n in enumerate(lens)
    ]
    outs = engine.generate(ps, sps)
    assert [len(r.output_ids) for r in outs] == lens
    stats = engine.scheduler.spec_stats
    # hundreds of verify steps, each after k draft steps: thousands of forwards
    assert stats.verified > 500 and stats.accepted < stats.drafted / 2, stats
    assert_no_leak(engine)
