"""Speculative decoding with a draft model (``STANDALONE``, engine/draft.py) and the
benchmark's synthetic acceptance: greedy tokens equal plain decoding's token for token
(float32, tiny HF Llamas), a draft equal to the target has every draft token kept (so the
draft's KV is right at every position: prefill mirrored, its own steps, the last kept token
written a round later), no slot leaked, and the refusals in one line."""

from __future__ import annotations

import pytest
import torch

from breakgraph.common import envs
from breakgraph.engine.request import SamplingParams
from tests.support.engines import assert_no_leak, make_engine
from tests.support.hf import make_hf_model, prompts


@pytest.fixture
def target_dir(tiny_llama_dir):
    return tiny_llama_dir


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


@pytest.mark.parametrize("algorithm", ["NGRAM", "STANDALONE"])
def test_mixed_chunks_keep_the_greedy_tokens(target_dir, draft_dir, algorithm):
    """With --enable-mixed-chunk, requests between verify steps decode one plain row each
    inside a long prompt's prefill chunks (the drafter's KV mirrored for those rows): the
    greedy tokens equal plain decoding's, mixed steps and verify steps both ran, and
    nothing leaks."""
    ps = [*PROMPTS, *prompts(1, [150], seed=5)]
    kw = dict(chunked_prefill_size=32, enable_mixed_chunk=True)
    plain = make_engine(target_dir, **kw).generate(ps, greedy(24))
    if algorithm == "NGRAM":
        engine = make_engine(target_dir, speculative_algorithm="NGRAM",
                             speculative_num_draft_tokens=3, **kw)  # fmt: skip
    else:
        engine = standalone(target_dir, draft_dir, k=3, **kw)
    mixed = []  # per prefill batch: whether running requests decode inside it
    schedule = engine.scheduler.prefill.schedule_batch

    def watched(*a):
        out = schedule(*a)
        mixed.append(out is not None and any(r.decoding for r in out[0]))
        return out

    engine.scheduler.prefill.schedule_batch = watched
    spec = engine.generate(ps, greedy(24))
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    assert any(mixed) and engine.scheduler.spec_stats.steps > 0
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


@pytest.mark.parametrize("overlap", [False, True])
def test_slots_exact_after_thousands_of_verify_steps(target_dir, draft_dir, overlap):
    """Sampled requests, so that drafts are often rejected: verify steps free rows over and
    over; after hundreds of them (and thousands of draft steps), with requests finishing and
    starting in between, every slot is accounted for. With overlap the verify steps are
    chained, each request's table filled to the worst case and trimmed at every read-back."""
    engine = standalone(target_dir, draft_dir, k=3, max_total_tokens=4096,
                        overlap_schedule=overlap)  # fmt: skip
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


def _count_chained(engine) -> list[int]:
    """The requests of each verify step chained to the one in flight (spec_chain.py)."""
    spec, seen = engine.scheduler.spec, []
    schedule = spec.schedule_chained

    def record(prev, stepping):
        out = schedule(prev, stepping)
        if out is not None:
            seen.append(len(stepping))
        return out

    spec.schedule_chained = record
    return seen


@pytest.mark.parametrize("same_draft", [True, False])
def test_chained_verify_steps_keep_the_greedy_tokens(target_dir, draft_dir, same_draft):
    """Under overlap scheduling verify steps run back to back, the next built on the device
    from what the one in flight keeps: the greedy tokens of plain decoding (a draft that
    agrees always, so every position's draft KV is written by the chained first steps, and
    one that rarely does, so the slots past the kept rows are freed at every read-back);
    requests ending inside a chain (stop ids, lengths, a stop string's length at any step),
    penalized and logprob requests beside them; nothing leaked."""
    draft = target_dir if same_draft else draft_dir
    plain_engine = make_engine(target_dir)
    engine = standalone(target_dir, draft, k=3, overlap_schedule=True)
    chained = _count_chained(engine)
    plain = plain_engine.generate(PROMPTS, greedy(24))
    stop = plain[1].output_ids[13]
    params = [greedy(24), greedy(24, stop_token_ids=[stop]), greedy(7), greedy(19)]
    want = plain_engine.generate(PROMPTS, params)
    got = engine.generate(PROMPTS, params)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert len(chained) >= 3, chained
    stats = engine.scheduler.spec_stats
    if same_draft:  # every draft kept: the draft's KV is right at every position
        assert stats.accepted >= 0.95 * stats.drafted, stats
    params = [greedy(20, repetition_penalty=1.3, frequency_penalty=0.3), greedy(20)]
    kw = dict(return_logprob=True, top_logprobs_num=2)
    want = plain_engine.generate(PROMPTS[:2], params, **kw)
    got = engine.generate(PROMPTS[:2], params, **kw)
    for g, w in zip(got, want, strict=True):
        assert g.output_ids == w.output_ids
        assert g.output_logprobs == pytest.approx(w.output_logprobs, abs=1e-5)
        assert [[i for _, i in t] for t in g.output_top_logprobs] == [
            [i for _, i in t] for t in w.output_top_logprobs
        ]
    assert_no_leak(engine)


def test_a_request_arriving_mid_chain_ends_it_and_is_served(target_dir, draft_dir):
    """A request waiting to prefill is not kept behind a chain: the verify step in flight is
    read back, the prompt prefilled, and the chain starts again; the tokens are plain
    decoding's."""
    plain = make_engine(target_dir).generate(PROMPTS, greedy(30))
    engine = standalone(target_dir, target_dir, k=3, overlap_schedule=True)
    chained = _count_chained(engine)
    rids = [engine.add_request(PROMPTS[0], greedy(30))]
    outs: dict[str, list[int]] = {rids[0]: []}
    steps = 0
    while engine.has_work or len(rids) < len(PROMPTS):
        if steps in (4, 5, 9) and len(rids) < len(PROMPTS):
            rids.append(engine.add_request(PROMPTS[len(rids)], greedy(30)))
            outs[rids[-1]] = []
        for out in engine.step():
            outs[out.rid] += out.token_ids
        steps += 1
    assert [outs[r] for r in rids] == [r.output_ids for r in plain]
    assert len(chained) > 3
    assert_no_leak(engine)


def test_a_queue_waiting_for_room_does_not_end_the_chain(target_dir):
    """With --max-running-requests reached, the requests waiting in the queue cannot be
    admitted before one ends: the verify steps stay chained meanwhile."""
    engine = standalone(target_dir, target_dir, k=3, overlap_schedule=True,
                        max_running_requests=2)  # fmt: skip
    waiting: list[int] = []
    spec = engine.scheduler.spec
    schedule = spec.schedule_chained

    def record(prev, stepping):
        out = schedule(prev, stepping)
        if out is not None:
            waiting.append(len(engine.scheduler.prefill.waiting))
        return out

    spec.schedule_chained = record
    plain = make_engine(target_dir).generate(PROMPTS, greedy(20))
    outs = engine.generate(PROMPTS, greedy(20))
    assert [r.output_ids for r in outs] == [r.output_ids for r in plain]
    assert any(n > 0 for n in waiting), waiting
    assert_no_leak(engine)


def test_chained_synthetic_acceptance_keeps_its_mean(target_dir, draft_dir):
    """The benchmark's fixed acceptance is drawn at launch, so a chained step's positions
    follow it on the device: the asked mean, every request its full length, nothing leaked."""
    with envs.BENCH.override(True):
        engine = standalone(
            target_dir, draft_dir, bench_synthetic_accept_length=3.5, overlap_schedule=True
        )
    chained = _count_chained(engine)
    outs = engine.generate(PROMPTS, greedy(60))
    assert [len(r.output_ids) for r in outs] == [60] * 4
    assert 3.2 < engine.scheduler.spec_stats.mean_accepted_length < 3.8
    assert chained
    assert_no_leak(engine)


def test_chained_draft_kv_is_the_targets_at_every_kept_position(target_dir):
    """A draft with the target's weights: after every step of a chain, its KV at each
    running request's kept positions equals the target's (the chained draft steps write
    the carried tokens at the carried positions, the row before included), but for the
    last kept draft token of an unchained round, which its next round writes."""
    engine = standalone(target_dir, target_dir, k=3, overlap_schedule=True)
    chained = _count_chained(engine)
    target = engine.kv_pool
    draft = engine.scheduler.spec.drafter.kv_pool
    for p in PROMPTS:
        engine.add_request(p, greedy(30))
    checked = 0
    while engine.has_work:
        engine.step()
        for req in engine.scheduler.decode.running:
            keep = [i for i in range(req.fill_len - 1) if i != req.draft_hole]
            slots = req.kv_slots[keep]  # (the hole: written by its next round)
            for layer in (0, target.num_layers - 1):
                torch.testing.assert_close(
                    draft.k_buffers[layer][slots], target.k_buffers[layer][slots],
                    atol=1e-4, rtol=1e-4,
                )  # fmt: skip
            checked += 1
    assert chained and checked > 20
    assert_no_leak(engine)


def test_an_abort_mid_chain_leaks_nothing(target_dir, draft_dir):
    """A request aborted while a verify step chained to another is in flight: its KV goes
    back at once, its rows of the steps in flight are dropped at their read-backs, the
    others keep plain decoding's tokens, and every slot is accounted for."""
    plain = make_engine(target_dir).generate(PROMPTS, greedy(30))
    engine = standalone(target_dir, draft_dir, k=3, overlap_schedule=True)
    chained = _count_chained(engine)
    rids = [engine.add_request(p, greedy(30)) for p in PROMPTS]
    outs: dict[str, list[int]] = {r: [] for r in rids}
    steps = 0
    while engine.has_work:
        if steps == 6:
            assert chained, "a chain in flight"
            engine.abort(rids[1])
        for out in engine.step():
            outs[out.rid] += out.token_ids
        steps += 1
    kept = [0, 2, 3]
    assert [outs[rids[i]] for i in kept] == [plain[i].output_ids for i in kept]
    assert len(outs[rids[1]]) < 30
    assert_no_leak(engine)
