"""Prompt and top logprobs equal HF transformers' log_softmax (whole, from logprob_start_len,
over a cached prefix, chunked); penalties and logit_bias follow their formulas."""

from __future__ import annotations

import pytest
import torch

from breakgraph.engine.penalties import apply_penalties
from breakgraph.engine.request import SamplingParams
from tests.support.engines import make_engine
from tests.support.hf import hf_logits, make_hf_model, prompts
from tests.support.logprobs import ATOL, check_prompt, greedy, hf_logprobs


def test_prompt_logprobs_match_hf(hf_checkpoint):
    _, hf, path = hf_checkpoint
    engine = make_engine(path)
    (p,) = prompts(1, [29])
    ref = hf_logprobs(hf, p)
    (res,) = engine.generate([p], greedy(2), return_logprob=True, logprob_start_len=0,
                             top_logprobs_num=5)  # fmt: skip
    check_prompt(res, ref, p, 0, 5)
    # the output's logprob and top logprobs: the last prompt row
    values, ids = ref[-1].topk(5)
    assert res.output_ids[0] == ids[0].item()
    assert res.output_logprobs[0] == pytest.approx(values[0].item(), abs=ATOL)
    assert [t[1] for t in res.output_top_logprobs[0]] == ids.tolist()
    assert engine.stats()["kv_tokens_used"] == 0


def test_prompt_logprobs_over_cached_prefix_and_chunked(tiny_llama_dir):
    hf = make_hf_model("llama")
    engine = make_engine(tiny_llama_dir, chunked_prefill_size=8)
    (p,) = prompts(1, [37], seed=3)
    ref = hf_logprobs(hf, p)
    engine.generate([p], greedy())  # caches the prompt
    for start in (0, 1, 12, 36):
        (res,) = engine.generate([p], greedy(), return_logprob=True, logprob_start_len=start,
                                 top_logprobs_num=3)  # fmt: skip
        assert res.cached_tokens <= max(start - 1, 0)
        check_prompt(res, ref, p, start, 3)
    # without logprobs the cache is used fully
    (res,) = engine.generate([p], greedy())
    assert res.cached_tokens == len(p) - 1


def test_max_new_tokens_zero_returns_prompt_logprobs_only(tiny_llama_dir):
    hf = make_hf_model("llama")
    engine = make_engine(tiny_llama_dir)
    ps = prompts(2, [9, 14], seed=5)
    results = engine.generate(ps, greedy(0), return_logprob=True, logprob_start_len=0)
    for p, res in zip(ps, results, strict=True):
        assert res.output_ids == []
        assert res.finish_reason == {"type": "length", "length": 0}
        check_prompt(res, hf_logprobs(hf, p), p, 0, 0)
    assert engine.stats()["kv_tokens_used"] == 0


def test_logprob_args_are_checked(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    with pytest.raises(ValueError, match="logprob_start_len"):
        engine.add_request([1, 2, 3], greedy(), return_logprob=True, logprob_start_len=3)
    with pytest.raises(ValueError, match="top_logprobs_num"):
        engine.add_request([1, 2, 3], greedy(), return_logprob=True, top_logprobs_num=21)
    with pytest.raises(ValueError, match="out of range"):
        engine.add_request([1, 2, 3], greedy(logit_bias={"100000": 1.0}))


# ---- penalties ----
def test_penalty_formulas():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 10, generator=g) * 3
    counts = torch.zeros(3, 10)
    counts[0, 2], counts[1, 2], counts[1, 5], counts[2, 7] = 2, 1, 3, 1
    prompt = torch.zeros(3, 10, dtype=torch.bool)
    prompt[2, 4] = True
    params = torch.tensor([[0.5, 0.0, 1.0], [0.3, 0.7, 1.0], [0.0, 0.0, 1.3]])
    out = apply_penalties(logits, counts, prompt | (counts > 0), params)
    ref = logits.clone()
    # OpenAI: logit -= count * frequency + (count > 0) * presence
    ref[0, 2] -= 2 * 0.5
    ref[1, 2] -= 1 * 0.3 + 0.7
    ref[1, 5] -= 3 * 0.3 + 0.7
    # HF/SGLang repetition: seen tokens (prompt or output) divided if > 0, else multiplied
    for tok in (4, 7):
        x = logits[2, tok]
        ref[2, tok] = x / 1.3 if x > 0 else x * 1.3
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("freq,pres,rep", [(2.0, 0.0, 1.0), (0.0, 2.0, 1.0), (0.5, 0.5, 1.5)])
def test_penalties_in_the_engine_match_a_replay(tiny_llama_dir, freq, pres, rep):
    hf = make_hf_model("llama")
    engine = make_engine(tiny_llama_dir)
    ps = prompts(2, [11, 7], seed=7)
    sp = greedy(8, frequency_penalty=freq, presence_penalty=pres, repetition_penalty=rep)
    results = engine.generate(ps + [ps[0]], [sp, sp, greedy(8)])  # batched with a plain one
    (plain,) = engine.generate([ps[0]], greedy(8))
    assert results[2].output_ids == plain.output_ids
    for p, res in zip(ps, results, strict=False):
        ids = list(p)
        for tok in res.output_ids:  # the formula replayed on HF's logits, token by token
            logits = hf_logits(hf, ids)[-1]
            out = torch.tensor(ids[len(p) :], dtype=torch.long)
            counts = torch.bincount(out, minlength=logits.numel()).float()
            seen = counts > 0
            seen[torch.tensor(p)] = True
            params = torch.tensor([[freq, pres, rep]])
            ref = apply_penalties(logits[None], counts[None], seen[None], params)[0]
            assert tok == ref.argmax().item()
            ids.append(tok)
    assert engine.scheduler.penalties.rows_in_use == 0
    assert engine.stats()["kv_tokens_used"] == 0


def test_penalty_pool_apply_and_record():
    """Neutral rows come out bit-identical; a request's row applies its penalties, bias and
    min_new_tokens mask; record counts sampled ids on held rows only; rows are reused."""
    from breakgraph.engine.penalties import PenaltyPool
    from breakgraph.engine.request import Req

    pool = PenaltyPool(10, torch.device("cpu"), eos_token_ids={3}, capacity=2)
    sp = greedy(4, frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=1.5,
                logit_bias={"8": 2.0}, min_new_tokens=1, stop_token_ids=[9])  # fmt: skip
    req, plain = (
        Req(rid="a", input_ids=[1, 2], sampling=sp),
        Req(rid="b", input_ids=[4], sampling=greedy()),
    )
    for r in (req, plain):
        assert pool.has_room(r)
        pool.acquire(r)
    assert plain.penalty_row is None and req.penalty_row is not None and pool.rows_in_use == 1
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(1)) * 3
    rows = pool.rows([plain, req])
    out = pool.apply(logits, rows)
    assert torch.equal(out[0], logits[0])  # neutral
    # the in-place apply is the reference formula, bit for bit
    counts, seen = pool.counts[rows], pool.prompt_seen[rows] | (pool.counts[rows] > 0)
    ref = apply_penalties(logits, counts, seen, pool.params[rows]) + pool.bias[rows]
    masking = (pool.generated[rows] < pool.min_new[rows])[:, None]
    assert torch.equal(out, ref.masked_fill(pool.banned[rows] & masking, float("-inf")))
    counts = torch.zeros(1, 10)
    seen = torch.zeros(1, 10, dtype=torch.bool)
    seen[0, [1, 2]] = True
    ref = apply_penalties(logits[1:], counts, seen, torch.tensor([[0.5, 0.25, 1.5]]))[0]
    ref[8] += 2.0
    ref[9] = float("-inf")  # min_new_tokens: stop ids masked until 1 is out (EOS: ignored)
    torch.testing.assert_close(out[1], ref)
    pool.record(rows, torch.tensor([5, 7]))
    assert pool.counts[0].sum() == 0 and pool.counts[req.penalty_row, 7] == 1
    out = pool.apply(logits, rows)[1]  # one token out: the mask lifts, token 7 is penalized
    seen[0, 7], counts[0, 7] = True, 1
    ref = apply_penalties(logits[1:], counts, seen, torch.tensor([[0.5, 0.25, 1.5]]))[0]
    ref[8] += 2.0
    torch.testing.assert_close(out, ref)
    others = [Req(rid=f"c{i}", input_ids=[1], sampling=sp) for i in range(2)]
    pool.acquire(others[0])
    assert pool.rows_in_use == 2 and not pool.has_room(others[1])  # fixed: the queue waits
    pool.release(req)
    assert pool.has_room(others[1])
    pool.acquire(others[1])
    assert pool.counts[others[1].penalty_row].sum() == 0  # a reused row starts clean


def test_max_penalized_requests_is_checked(tiny_llama_dir):
    with pytest.raises(ValueError, match="--max-penalized-requests must be >= 0, got -1"):
        make_engine(tiny_llama_dir, max_penalized_requests=-1)
    engine = make_engine(tiny_llama_dir, max_penalized_requests=0)  # CPU: grows on demand
    assert not engine.scheduler.penalties.fixed


def watch_rows(pool) -> list[int]:
    """The pool's rows in use after each acquire, appended to the returned list."""
    seen: list[int] = []
    acquire = pool.acquire
    pool.acquire = lambda r: acquire(r) or seen.append(pool.rows_in_use)
    return seen


def test_fixed_penalty_pool_queues_requests_and_matches_a_growing_one(tiny_llama_dir):
    """With one row, penalized requests run one at a time (the others wait in the queue);
    outputs equal those of a pool that grows, and a plain request is never held back."""
    from breakgraph.engine.penalties import PenaltyPool

    ps = prompts(4, [11, 7, 9, 5], seed=3)
    sps = [greedy(6, frequency_penalty=0.7, logit_bias={"3": 1.5}), greedy(6, min_new_tokens=3),
           greedy(6, repetition_penalty=1.4), greedy(6)]  # fmt: skip
    outs = []
    for capacity in (None, 1):
        engine = make_engine(tiny_llama_dir)
        pool = PenaltyPool(engine.vocab_size, engine.device, engine.eos_token_ids, capacity)
        engine.scheduler.penalties = engine.runner.penalties = pool
        most = watch_rows(pool)
        outs.append([r.output_ids for r in engine.generate(ps, sps)])
        stats = engine.stats()
        assert pool.rows_in_use == stats["penalized_reqs"] == stats["kv_tokens_used"] == 0
        assert stats["penalized_reqs_max"] == (capacity or 0)
        assert max(most) == (3 if capacity is None else 1)
    assert outs[0] == outs[1]


def test_logit_bias_in_the_engine(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    (p,) = prompts(1, [11], seed=7)
    (plain,) = engine.generate([p], greedy(3))
    (biased,) = engine.generate([p], greedy(5, logit_bias={"42": 100.0}))
    assert biased.output_ids == [42] * 5
    banned = {str(t): -100.0 for t in plain.output_ids}
    (res,) = engine.generate([p], greedy(3, logit_bias=banned))
    assert not set(res.output_ids) & set(plain.output_ids)


def test_min_new_tokens_masks_eos(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    (p,) = prompts(1, [6], seed=2)
    (first,) = engine.generate([p], greedy(1))
    tok = first.output_ids[0]
    sp = SamplingParams(max_new_tokens=4, temperature=0.0, stop_token_ids=[tok], min_new_tokens=2)
    (res,) = engine.generate([p], sp)
    assert tok not in res.output_ids[:2] and len(res.output_ids) >= 2
