"""Speculative decoding with n-gram drafts (engine/speculative.py): greedy tokens equal plain
decoding's token for token (float32, a tiny HF Llama and the embedded SmolLM2 on text that
repeats), drafts accepted, the KV slots of rejected rows returned (no leak after many
steps), finish checks (stop ids, lengths) inside an accepted run, requests with penalties,
logit_bias or min_new_tokens riding the verify steps as plain rows, and logprobs of kept
tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from breakgraph.engine.acceptance import kept, pool_rows, verify_sample
from breakgraph.engine.ngram import NgramProposer
from breakgraph.engine.penalties import PenaltyPool, apply_penalties
from breakgraph.engine.request import Req, SamplingParams
from breakgraph.engine.verify_step import Verify
from tests.support.engines import assert_no_leak, make_engine
from tests.support.hf import prompts


def test_ngram_drafts_continue_the_latest_earlier_occurrence():
    p = NgramProposer(num_draft=3, min_match=1, max_match=3)
    toks = np.array([5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6, 7], dtype=np.int32)
    # "5 6 7" occurred at 0 and 5: the latest (5) continues with 1 2 5
    assert p.propose(toks, 10).tolist() == [1, 2, 5]
    assert p.propose(toks, 2).tolist() == [1, 2]
    assert p.propose(np.array([1, 2, 3, 4], dtype=np.int32), 4).tolist() == []
    # a loop: past the end, the continuation repeats ("7 8" followed "7 8 9": 9 7 8 9 ...)
    loop = np.array([7, 8, 9, 7, 8, 9, 7, 8], dtype=np.int32)
    assert p.propose(loop, 3).tolist() == [9, 7, 8]
    assert p.propose(np.array([4, 4, 4], dtype=np.int32), 3).tolist() == [4, 4, 4]
    # the step after one still on the device, which verifies "9" after ``loop``: the
    # continuation past the token it predicts there ("7"): 8 9 7
    assert p.propose_after(loop, np.array([9], dtype=np.int32), 3).tolist() == [8, 9, 7]
    assert p.propose(toks, 0).tolist() == []


def test_the_index_finds_what_a_scan_finds():
    """A request's n-gram index (grown with its tokens, rebuilt when they shrink) gives the
    scan's drafts, with and without drafts still on the device ahead; small alphabets, so
    that matches of every length abound."""
    p = NgramProposer(num_draft=3)
    rng = np.random.default_rng(0)
    for _ in range(200):
        alphabet, n = int(rng.integers(2, 6)), int(rng.integers(2, 60))
        seq = rng.integers(0, alphabet, n).astype(np.int32)
        index = p.new_index()
        for cut in range(1, n + 1, int(rng.integers(1, 4))):
            toks = seq[:cut]
            assert p.propose(toks, 3, index).tolist() == p.propose(toks, 3).tolist()
            ahead = rng.integers(0, alphabet, int(rng.integers(0, 4))).astype(np.int32)
            want = p.propose_after(toks, ahead, 3).tolist()
            assert p.propose_after(toks, ahead, 3, index).tolist() == want
        shorter = seq[: max(1, n // 2)]
        assert p.propose(shorter, 3, index).tolist() == p.propose(shorter, 3).tolist()


def test_a_requests_lookup_reads_its_tokens_in_place():
    """The n-gram draft of a request through its ``FillTokens`` (no ``fill_ids`` built) is
    the scan's of ``fill_ids``, as its output grows past its prompt; ``FillTokens`` reads
    like ``fill_ids``: length, tokens, slices within, across and past the prompt."""
    p = NgramProposer(num_draft=3)
    rng = np.random.default_rng(1)
    for _ in range(40):
        prompt = rng.integers(0, 4, int(rng.integers(1, 12))).astype(np.int32)
        req = Req("r", prompt, SamplingParams(max_new_tokens=64))  # an engine's: int32
        index = p.new_index()
        for _ in range(int(rng.integers(1, 30))):
            req.output_ids.extend(int(t) for t in rng.integers(0, 4, int(rng.integers(1, 4))))
            toks, ids = req.fill_tokens(), req.fill_ids
            assert len(toks) == len(ids)
            assert [toks[i] for i in range(-len(ids), len(ids))] == [*ids.tolist()] * 2
            for a, b in ((0, None), (len(prompt) - 1, None), (len(ids) - 2, len(ids)), (3, 3)):
                assert toks[a:b].tolist() == ids[a:b].tolist()
            assert p.propose(toks, 3, index).tolist() == p.propose(ids, 3).tolist()
            ahead = rng.integers(0, 4, int(rng.integers(0, 4))).astype(np.int32)
            want = p.propose_after(ids, ahead, 3).tolist()
            assert p.propose_after(toks, ahead, 3, index).tolist() == want


def test_kept_takes_the_accepted_prefix_and_the_stopping_rows_choice():
    draft = np.array([4, 5, 6])
    assert kept(draft, [True, True, True], [4, 5, 6, 7]) == [4, 5, 6, 7]
    assert kept(draft, [True, False, True], [4, 9, 6, 7]) == [4, 9]
    assert kept(draft, [False, True, True], [3, 5, 6, 7]) == [3]


@pytest.mark.parametrize("draft", [0, 2, 4])
def test_verify_sampling_keeps_the_target_distribution(draft):
    """One verify row, a draft token of high, middle or zero (filtered by top-k) probability:
    the token the row emits (the draft if kept, else its residual choice) is distributed as
    plain sampling's, within 0.012 per token over 40,000 draws."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -3.0])
    sp = SamplingParams(max_new_tokens=8, temperature=0.7, top_k=4)
    n = 40_000
    rows = logits.expand(n, -1).clone()
    accept, choice = verify_sample(rows, [sp] * n, [None] * n, torch.full((n,), draft))
    emitted = torch.where(accept, torch.tensor(draft), choice)
    got = torch.bincount(emitted, minlength=5).float() / n
    want = torch.softmax(logits / 0.7, dim=0)
    want[4] = 0.0  # top-k 4 drops the least likely
    want /= want.sum()
    assert (got - want).abs().max() < 0.012, (got, want)


def test_verify_sampling_in_row_chunks_draws_what_one_pass_does(monkeypatch):
    """A verify batch larger than a chunk of ``MAX_SAMPLE_FLOATS`` goes in row chunks: seeded
    rows (each its own generator) accept and choose as in one pass, greedy rows too."""
    import breakgraph.engine.acceptance as acceptance

    vocab, n = 64, 50
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(0))
    params = [
        SamplingParams(max_new_tokens=8, temperature=0.0 if i % 5 == 0 else 0.9, top_p=0.9)
        for i in range(n)
    ]
    draft_next = logits.argsort(dim=-1)[:, -2].clone()  # each row's second most likely
    draft_next[::7] = -1

    def run():
        gens = [torch.Generator().manual_seed(100 + i) for i in range(n)]
        return verify_sample(logits, params, gens, draft_next)

    whole = run()
    monkeypatch.setattr(acceptance, "MAX_SAMPLE_FLOATS", vocab * 8)
    chunked = run()
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])
    assert whole[0].any() and not whole[0].all()


@pytest.fixture
def llama_dir(tiny_llama_dir):
    return tiny_llama_dir


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def repeating(seed: int, period: int, n: int) -> list[int]:
    (base,) = prompts(1, [period], seed=seed)
    return (base * (n // period + 1))[:n]


@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_tokens_equal_plain_decoding(llama_dir, overlap):
    """With overlap scheduling verify steps run back to back (spec_chain.py): the next
    one's n-gram drafts assume the one in flight keeps its drafts and the lookup's token."""
    ps = [repeating(1, 7, 40), repeating(2, 5, 23), *prompts(2, [9, 30], seed=3)]
    plain = make_engine(llama_dir).generate(ps, greedy(24))
    engine = make_engine(
        llama_dir, speculative_algorithm="NGRAM", speculative_num_draft_tokens=4,
        overlap_schedule=overlap,
    )  # fmt: skip
    chained = []
    schedule = engine.scheduler.spec.schedule_chained
    engine.scheduler.spec.schedule_chained = lambda *a: chained.append(schedule(*a)) or chained[-1]
    spec = engine.generate(ps, greedy(24))
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    stats = engine.scheduler.spec_stats
    assert stats.steps > 0 and stats.drafted > 0
    assert any(c is not None for c in chained) == overlap, chained
    assert_no_leak(engine)


def test_finish_inside_an_accepted_run(llama_dir):
    """A stop id or max_new_tokens met inside the kept tokens ends the request there."""
    p = repeating(4, 6, 36)
    plain = make_engine(llama_dir).generate([p], greedy(20))[0].output_ids
    engine = make_engine(llama_dir, speculative_algorithm="NGRAM", speculative_num_draft_tokens=5)
    stop = plain[7]
    (r,) = engine.generate([p], greedy(20, stop_token_ids=[stop]))
    assert r.output_ids == plain[: plain.index(stop) + 1]
    for n in (1, 2, 6, 11):
        (r,) = engine.generate([p], greedy(n))
        assert r.output_ids == plain[:n]
    assert_no_leak(engine)


def test_sampled_requests_verify_and_nothing_leaks(llama_dir):
    """Sampled requests verify drafts too (seeded: the same tokens run to run); many steps
    later every slot is accounted for."""
    engine = make_engine(llama_dir, speculative_algorithm="NGRAM", speculative_num_draft_tokens=3)
    ps = [repeating(5, 4, 30), repeating(6, 9, 30)]
    sampled = SamplingParams(max_new_tokens=30, temperature=0.8, seed=1, ignore_eos=True)
    outs = engine.generate(ps, [greedy(30), sampled])
    assert [len(r.output_ids) for r in outs] == [30, 30]
    assert engine.scheduler.spec_stats.steps > 0
    again = engine.generate(ps, [greedy(30), sampled])
    assert [r.output_ids for r in again] == [r.output_ids for r in outs]
    for _ in range(5):
        engine.generate(ps, greedy(40))
    assert_no_leak(engine)


def _verify_batches(engine) -> list[list[tuple[bool, int]]]:
    """Each verify step's requests, recorded as it is scheduled: whether each holds a
    penalty-pool row, and its draft's length."""
    spec, seen = engine.scheduler.spec, []
    schedule = spec.schedule

    def record(stepping):
        out = schedule(stepping)
        if out is not None:
            drafts = spec.pending.drafts
            seen.append(
                [(r.penalty_row is not None, len(d)) for r, d in zip(stepping, drafts, strict=True)]
            )
        return out

    spec.schedule = record
    return seen


def test_each_verify_row_counts_the_draft_tokens_before_it():
    """The pool's logits of verify row j of a penalized request (penalties, logit_bias,
    min_new_tokens) equal a plain step's after its draft tokens 1..j were sampled (a pool
    that acquired the request with them in its output); a request without a row beside it
    reads the neutral row."""
    sp = SamplingParams(max_new_tokens=20, frequency_penalty=0.5, presence_penalty=0.3,
                        repetition_penalty=1.3, min_new_tokens=3, logit_bias={"2": 1.5},
                        stop_token_ids=[9])  # fmt: skip
    prompt = np.array([3, 4, 5], dtype=np.int32)
    pool = PenaltyPool(16, torch.device("cpu"), {1})
    req = Req(rid="p", input_ids=prompt, sampling=sp, output_ids=[5])
    pool.acquire(req)
    other = Req(rid="o", input_ids=prompt, sampling=SamplingParams(max_new_tokens=20))
    draft = np.array([9, 9, 2], dtype=np.int32)
    verify = Verify([other, req], [np.array([7], np.int32), draft], [0, 2], 6)
    input_ids = torch.tensor([8, 7, 5, 9, 9, 2])
    pen_rows, drafted, _ = pool_rows(verify, input_ids)
    logits = torch.randn(6, 16)
    got = pool.apply(logits, pen_rows, drafted)
    torch.testing.assert_close(got[:2], logits[:2], rtol=0, atol=0)
    for j in range(4):
        ref = PenaltyPool(16, torch.device("cpu"), {1})
        seen = Req(rid="r", input_ids=prompt, sampling=sp, output_ids=[5, *draft[:j].tolist()])
        ref.acquire(seen)
        want = ref.apply(logits[2 + j : 3 + j], torch.tensor([seen.penalty_row]))
        torch.testing.assert_close(got[2 + j : 3 + j], want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("overlap", [False, True])
def test_requests_with_a_pool_row_draft(llama_dir, overlap):
    """Penalties, logit_bias and min_new_tokens (a penalty-pool row) draft too: each verify
    row is sampled from the pool's logits as if the draft tokens before it had been sampled
    (counted, generated), and the kept tokens are counted in the pool: every request's
    tokens are plain decoding's."""
    ps = [repeating(1, 7, 40), repeating(2, 5, 23), repeating(3, 6, 30), repeating(4, 4, 20)]
    (base,) = make_engine(llama_dir).generate(ps[3:], greedy(1))
    params = [
        greedy(24),
        greedy(24, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2),
        greedy(24, logit_bias={str(base.output_ids[0]): -5.0, "17": 3.0}),
        SamplingParams(max_new_tokens=24, temperature=0.0, min_new_tokens=12,
                       stop_token_ids=[base.output_ids[0]]),
    ]  # fmt: skip
    plain = make_engine(llama_dir).generate(ps, params)
    engine = make_engine(
        llama_dir, speculative_algorithm="NGRAM", speculative_num_draft_tokens=4,
        overlap_schedule=overlap,
    )  # fmt: skip
    batches = _verify_batches(engine)
    spec = engine.generate(ps, params)
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    assert any(pooled and n for step in batches for pooled, n in step)
    assert engine.scheduler.spec_stats.accepted > 0
    assert_no_leak(engine)


@pytest.mark.parametrize("algorithm", ["NGRAM", "STANDALONE"])
def test_logprobs_of_kept_tokens_equal_plain_decodings(llama_dir, algorithm):
    """A request that wants logprobs drafts too: each kept token's logprob and the top-k of
    its row come from the verify step's logits, as plain decoding's from its own."""
    ps = [repeating(1, 7, 40), repeating(2, 5, 23), *prompts(1, [9], seed=3)]
    kw = dict(return_logprob=True, top_logprobs_num=3)
    plain = make_engine(llama_dir).generate(ps, greedy(20), **kw)
    engine = make_engine(
        llama_dir, speculative_algorithm=algorithm, speculative_num_draft_tokens=3,
        speculative_draft_model_path=str(llama_dir),
    )  # fmt: skip
    spec = engine.generate(ps, greedy(20), **kw)
    assert engine.scheduler.spec_stats.accepted > 0
    for got, want in zip(spec, plain, strict=True):
        assert got.output_ids == want.output_ids
        assert len(got.output_logprobs) == len(got.output_top_logprobs) == 20
        np.testing.assert_allclose(got.output_logprobs, want.output_logprobs, atol=1e-5)
        for g, w in zip(got.output_top_logprobs, want.output_top_logprobs, strict=True):
            assert [i for _, i in g] == [i for _, i in w]
            np.testing.assert_allclose([v for v, _ in g], [v for v, _ in w], atol=1e-5)
    assert_no_leak(engine)


def test_embedded_model_accepts_drafts_when_asked_to_repeat_a_text():
    """SmolLM2 (real weights) asked to repeat a list: the same answer as plain decoding, in
    far fewer steps (about 4 tokens a step measured)."""
    from breakgraph.engine.args import EngineArgs
    from breakgraph.engine.engine import Engine

    def engine(**kw):
        return Engine(EngineArgs(device="cpu", dtype="float32", max_total_tokens=2048, **kw))

    plain_engine = engine()
    tok = plain_engine.tokenizer
    text = "Here is a list: apples, pears, plums, figs, dates, limes, cherries, grapes, melons."
    ask = "Repeat the following text exactly, word for word, and nothing else.\n\n" + text
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": ask}]))
    plain = plain_engine.generate([ids], greedy(32))[0].output_ids
    spec_engine = engine(speculative_algorithm="NGRAM", speculative_num_draft_tokens=4)
    (r,) = spec_engine.generate([ids], greedy(32))
    assert r.output_ids == plain
    stats = spec_engine.scheduler.spec_stats
    assert stats.mean_accepted_length > 2.0, stats
    # a stop string met inside an accepted run ends the request where plain decoding does
    stop = greedy(32, stop=["figs"])
    (want,) = plain_engine.generate([ids], stop)
    (got,) = spec_engine.generate([ids], stop)
    assert got.output_ids == want.output_ids and len(got.output_ids) < 32
    assert got.finish_reason == want.finish_reason == {"type": "stop", "matched": "figs"}


def test_a_draft_model_it_cannot_run_is_refused_in_one_line(tmp_path, llama_dir):
    """A draft with per-request state (DeepSeek V4) would need its own rewind."""
    from tests.support.deepseek_v4 import make_hf_deepseek_v4

    make_hf_deepseek_v4().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="per-request state"):
        make_engine(
            llama_dir, speculative_algorithm="STANDALONE",
            speculative_draft_model_path=str(tmp_path),
        )  # fmt: skip


@pytest.mark.parametrize("fast_prefill", [True, False])
def test_gemma4_verify_steps_run_every_layer_on_every_row(tmp_path, fast_prefill):
    """Gemma 4's bounded prefill runs its KV-shared layers on each request's last row; a
    verify step wants every row's logits, so there it runs them on every row: greedy tokens
    equal plain decoding's with KV sharing's fast prefill on and off."""
    pytest.importorskip("transformers.models.gemma4")
    from tests.support.gemma4 import make_hf_gemma4

    make_hf_gemma4("text").save_pretrained(tmp_path)
    ps = [repeating(7, 6, 30), repeating(8, 11, 40), *prompts(1, [13], seed=9)]
    kw = {"kv_sharing_fast_prefill": fast_prefill}
    plain = make_engine(tmp_path, **kw).generate(ps, greedy(20))
    engine = make_engine(tmp_path, speculative_algorithm="NGRAM", **kw)
    spec = engine.generate(ps, greedy(20))
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    assert engine.scheduler.spec_stats.steps > 0
    assert_no_leak(engine)


@pytest.mark.parametrize("algorithm", ["NGRAM", "STANDALONE"])
def test_deepseek_v4_state_rewound_past_rejected_drafts(tmp_path, llama_dir, algorithm):
    """DeepSeek V4's compressors carry each request's open windows as state: a verify step
    advances it through every row, so where a draft token is rejected it is restored and
    advanced over the kept rows again. Greedy tokens equal plain decoding's (float32, CSA
    and HCA windows of 4 and 16 tokens closing inside verify steps), prompts over several windows."""
    from tests.support.deepseek_v4 import make_hf_deepseek_v4

    make_hf_deepseek_v4().save_pretrained(tmp_path)
    ps = [repeating(7, 6, 30), repeating(8, 13, 45), *prompts(1, [19], seed=9)]
    plain = make_engine(tmp_path).generate(ps, greedy(24))
    engine = make_engine(
        tmp_path, speculative_algorithm=algorithm, speculative_num_draft_tokens=3,
        speculative_draft_model_path=str(llama_dir),
    )  # fmt: skip
    spec = engine.generate(ps, greedy(24))
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    stats = engine.scheduler.spec_stats
    assert stats.steps > 0 and stats.accepted < stats.drafted, stats  # some rejected
    assert_no_leak(engine)


def test_sampled_tokens_keep_their_distribution_through_the_engine(llama_dir):
    """The statistical check on a tiny model: 3,000 seeded requests sample 3 tokens (top-k 8)
    with the model drafting for itself, greedily, so the second token is an accepted draft,
    a residual draw or a bonus draw. Its empirical distribution against the exact one
    (sum over the first token of p(t1) p(t2 | t1), from HF's logits): a chi-square test
    over the bins, at the 0.001 level."""
    _check_distribution(llama_dir, {}, position=1)


PENALTIES = dict(frequency_penalty=0.3, presence_penalty=0.2, repetition_penalty=1.2)


def test_penalized_sampled_tokens_keep_their_distribution(llama_dir):
    """As above with penalties, on the third token: two drafts a step, so the third token is
    drawn from the first verify step's second row (after the first draft token, which the
    pool counts there as if sampled) or from the next step's first row; the exact
    distribution sums p(t1) p(t2 | t1) p(t3 | t1, t2) under the pool's formula."""
    _check_distribution(llama_dir, PENALTIES, position=2)


def _check_distribution(llama_dir, penalties: dict, position: int) -> None:
    """Seeded requests sample ``position + 2`` tokens (top-k 8) with the model drafting for
    itself: the empirical distribution of the token at ``position`` against the exact one,
    a chi-square test at the 0.001 level."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama_dir).float().eval()
    prompt = repeating(3, 5, 15)
    names = ("frequency_penalty", "presence_penalty", "repetition_penalty")

    def probs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
        if penalties:  # the pool's formula: output counts, prompt and output seen
            out = torch.tensor(ids[len(prompt) :], dtype=torch.long)
            counts = torch.bincount(out, minlength=logits.numel()).float()
            seen = torch.zeros(logits.numel(), dtype=torch.bool)
            seen[torch.tensor(ids)] = True
            params = torch.tensor([[penalties[k] for k in names]])
            logits = apply_penalties(logits[None], counts[None], seen[None], params)[0]
        top = torch.topk(logits, 8)
        return torch.zeros_like(logits).scatter(0, top.indices, torch.softmax(top.values, 0))

    def exact(ids: list[int], depth: int) -> torch.Tensor:
        p = probs(ids)
        if depth == 0:
            return p
        return sum(p[t] * exact([*ids, t], depth - 1) for t in torch.nonzero(p).flatten().tolist())

    want = exact(prompt, position)
    n = 3000
    engine = make_engine(
        llama_dir, speculative_algorithm="STANDALONE", speculative_num_draft_tokens=2,
        speculative_draft_model_path=str(llama_dir), max_total_tokens=65536,
        max_running_requests=512,
    )  # fmt: skip
    sps = [
        SamplingParams(max_new_tokens=position + 2, temperature=1.0, top_k=8, seed=i,
                       ignore_eos=True, **penalties)
        for i in range(n)
    ]  # fmt: skip
    outs = engine.generate([prompt] * n, sps)
    stats = engine.scheduler.spec_stats
    assert 100 < stats.accepted < 0.9 * stats.drafted, stats  # kept at times, not always
    counts = np.bincount([r.output_ids[position] for r in outs], minlength=want.numel())
    expected = want.double().numpy() * n
    big = expected >= 5  # the rest pooled into one bin
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    chi2 = float((((obs - exp) ** 2)[keep] / exp[keep]).sum())
    df = int(keep.sum()) - 1
    z = 3.09  # the 0.001 level; Wilson-Hilferty's chi-square quantile
    critical = df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3
    assert chi2 < critical, (chi2, critical, df)
