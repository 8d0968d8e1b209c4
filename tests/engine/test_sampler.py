"""Sampler: greedy, seeds, and that top-k / top-p / min-p restrict the support correctly."""

from __future__ import annotations

import torch

from breakgraph.engine.request import SamplingParams
from breakgraph.engine.sampler import filtered_probs, sample

LOGITS = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.07, 0.03]]))


def draw(params: SamplingParams, n: int = 2000, seed: int = 0) -> torch.Tensor:
    gens = [torch.Generator().manual_seed(seed + i) for i in range(n)]
    ids, _ = sample(LOGITS.expand(n, -1).contiguous(), [params] * n, gens)
    return torch.bincount(ids, minlength=5).float() / n


def test_greedy_and_top_k_1_are_argmax():
    logits = torch.randn(8, 100)
    for p in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=1)):
        ids, lp = sample(logits, [p] * 8, [None] * 8, return_logprob=True)
        assert torch.equal(ids, logits.argmax(-1))
        torch.testing.assert_close(lp, torch.log_softmax(logits, -1).max(-1).values)


def test_seed_reproducible_and_mixed_batch():
    logits = torch.randn(4, 50)
    params = [SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=0.0)] * 2
    a, _ = sample(logits, params, [torch.Generator().manual_seed(7), None] * 2)
    b, _ = sample(logits, params, [torch.Generator().manual_seed(7), None] * 2)
    assert torch.equal(a, b)
    assert a[1] == logits[1].argmax() and a[3] == logits[3].argmax()


def test_temperature_one_follows_the_distribution():
    freq = draw(SamplingParams(temperature=1.0))
    torch.testing.assert_close(freq, LOGITS.exp()[0], atol=0.04, rtol=0)


def test_top_k_top_p_min_p_support():
    assert draw(SamplingParams(temperature=1.0, top_k=2))[2:].sum() == 0
    # top_p=0.7: 0.5 then 0.25 reaches it; nothing after the second token
    freq = draw(SamplingParams(temperature=1.0, top_p=0.7))
    assert freq[2:].sum() == 0 and freq[1] > 0.2
    # min_p=0.2: keep p >= 0.1 (tokens 0, 1, 2)
    freq = draw(SamplingParams(temperature=1.0, min_p=0.2))
    assert freq[3:].sum() == 0 and freq[2] > 0.1


def test_float32_edge_values_stay_in_the_support():
    """A top_p that rounds to 0 in float32 keeps the most likely token; a temperature past
    float32's range samples uniformly, never a banned (-inf) token, never NaN."""
    freq = draw(SamplingParams(temperature=1.0, top_p=1e-46), n=200)
    assert freq[0] == 1.0
    logits = LOGITS.clone()
    logits[0, 0] = float("-inf")  # banned, as min_new_tokens bans EOS
    n = 400
    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    ids, _ = sample(logits.expand(n, -1).contiguous(), [SamplingParams(temperature=1e39)] * n, gens)
    counts = torch.bincount(ids, minlength=5)
    assert counts[0] == 0 and (counts[1:] > 50).all()  # uniform over the allowed four


def test_a_large_batch_is_sampled_a_chunk_of_rows_at_a_time(monkeypatch):
    """Past ``MAX_SAMPLE_FLOATS`` logits the rows go through the filters in chunks (the
    temporaries bounded): seeded, greedy and filtered rows draw exactly what one pass draws,
    logprobs too; ``token_logprobs`` chunks the same way, with the same values."""
    from breakgraph.engine import logprobs, sampler

    logits = torch.randn(23, 300) * 3
    params = [
        SamplingParams(temperature=0.9, top_p=0.8, top_k=40, min_p=0.02, seed=i)
        if i % 3 else SamplingParams(temperature=0.0)
        for i in range(23)
    ]  # fmt: skip

    def run():
        gens = [torch.Generator().manual_seed(p.seed) if p.seed else None for p in params]
        return sample(logits, params, gens, return_logprob=True)

    (ids, lp), targets = run(), torch.randint(0, 300, (23,))
    whole = logprobs.token_logprobs(logits, targets, 5)
    monkeypatch.setattr(sampler, "MAX_SAMPLE_FLOATS", 5 * 300)  # 5 rows a chunk
    monkeypatch.setattr(logprobs, "MAX_LOGIT_FLOATS", 4 * 300)
    chunked_ids, chunked_lp = run()
    assert torch.equal(chunked_ids, ids) and torch.equal(chunked_lp, lp)
    for a, b in zip(logprobs.token_logprobs(logits, targets, 5), whole, strict=True):
        assert torch.equal(a, b)


def test_a_top_k_row_draws_among_its_top_k_as_the_full_filter_would():
    """Rows bounded by a top_k (up to ``TOP_K_FAST``) draw among their top-k, not after a
    sort of the vocabulary: the support and the distribution of ``filtered_probs`` (top-k,
    then top-p and min-p on the sorted values), over 6,000 draws; a top_k past the
    vocabulary too."""
    from breakgraph.engine.sampler import filtered_probs

    logits = torch.randn(1, 60, generator=torch.Generator().manual_seed(3)) * 2
    n = 6000
    for p in (
        SamplingParams(temperature=0.8, top_k=10, top_p=0.9, min_p=0.05),
        SamplingParams(temperature=1.3, top_k=500),
    ):
        probs, _ = filtered_probs(logits, [p])
        want = probs[0] / probs[0].sum()
        ids, _ = sample(logits.expand(n, -1).contiguous(), [p] * n, [None] * n)
        freq = torch.bincount(ids, minlength=60).float() / n
        assert freq[want == 0].sum() == 0
        torch.testing.assert_close(freq, want, atol=0.025, rtol=0)


def test_a_seeded_request_draws_the_same_whatever_shares_its_batch():
    """A seeded top-k request's tokens over several steps do not depend on its batch: alone,
    beside rows that take the sorted path (top_p only), a greedy row and a larger top_k."""
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(5)) * 2
    mine = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=7)
    others = [
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=600),
    ]

    def steps(batch: bool) -> list[int]:
        gen, out = torch.Generator().manual_seed(7), []
        for _ in range(6):
            if batch:
                ids, _ = sample(logits, [*others, mine], [None, None, None, gen])
            else:
                ids, _ = sample(logits[3:], [mine], [gen])
            out.append(int(ids[-1]))
        return out

    assert steps(batch=False) == steps(batch=True)


def test_top_p_one_keeps_the_tail_whatever_shares_the_batch():
    """``top_p`` 1.0 filters nothing, even where float32's cumulative sum reaches 1.0 before
    the tail (it did drop it), and a row's filter does not depend on its batch: the top-p
    mask, run only when some row asks for it, leaves a 1.0 row as it was."""
    logits = torch.tensor([[20.0, 0.0, 0.0, 0.0]])
    alone = SamplingParams(temperature=1.0, top_k=4)  # the sorting path, no top-p
    probs, _ = filtered_probs(logits, [alone])
    assert torch.softmax(logits, -1)[0, 0] == 1.0 and bool((probs[0, 1:] > 0).all())
    other = SamplingParams(temperature=1.0, top_p=0.5)
    both, _ = filtered_probs(logits.expand(2, -1), [alone, other])
    assert torch.equal(both[0], probs[0])
    assert bool((both[1, 1:] == 0).all())  # the other row's top-p still applies
