"""DeepSeek V4's compressed-attention ops (kernels/compressed_attention.py) against direct
computations: window pooling equal whatever the steps a request's rows are split into (the
open window carried as state), the indexer's top-k selection with distinct and with tied
scores, and attention over a window plus picked entries with sinks."""

from __future__ import annotations

import itertools

import pytest
import torch

from breakgraph.kernels.compressed_attention import (
    CompressedStep,
    indexer_scores_torch,
    pool_windows_torch,
    sparse_attention_torch,
)


def one_request_step(start: int, end: int, table: torch.Tensor) -> CompressedStep:
    n = end - start
    return CompressedStep(
        positions=torch.arange(start, end),
        row_req=torch.zeros(n, dtype=torch.int64),
        req_rows=torch.tensor([0]),
        start_pos=torch.tensor([start]),
        end_pos=torch.tensor([end]),
        fresh=torch.tensor([start == 0]),
        req_to_token=table,
        max_extend=n,
        max_seq=end,
    )


def pooled_reference(kv, score, ratio, overlap):
    """Entry of each closed window: per channel a softmax over its slots (with overlap: the
    previous window's first halves, then this window's second halves)."""
    d = kv.shape[1] // 2 if overlap else kv.shape[1]
    out = []
    for w in range(kv.shape[0] // ratio):
        rows = slice(w * ratio, (w + 1) * ratio)
        vals, logits = [kv[rows, -d:]], [score[rows, -d:]]
        if overlap and w > 0:
            prev = slice((w - 1) * ratio, w * ratio)
            vals.insert(0, kv[prev, :d])
            logits.insert(0, score[prev, :d])
        v, s = torch.cat(vals), torch.cat(logits)
        out.append((torch.softmax(s, dim=0) * v).sum(0))
    return torch.stack(out)


@pytest.mark.parametrize("overlap,ratio", [(True, 4), (False, 8)])
@pytest.mark.parametrize("cuts", [[], [10, 11, 23], [1, 2, 3, 4, 5, 30]])
def test_pooled_windows_equal_whatever_the_steps(overlap, ratio, cuts):
    torch.manual_seed(0)
    n, d = 37, 6
    kv = torch.randn(n, 2 * d if overlap else d)
    score = torch.randn(n, kv.shape[1]) * 3
    state = torch.full((1, 2 if overlap else 1, 3, d), 7.0)  # garbage: a fresh start ignores it
    table = torch.arange(1, 65, dtype=torch.int32)[None]
    got = torch.empty(n, d)
    bounds = [0, *cuts, n]
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        got[lo:hi] = pool_windows_torch(
            kv[lo:hi], score[lo:hi], state, ratio, overlap, one_request_step(lo, hi, table)
        )
    closing = torch.arange(ratio - 1, n, ratio)[: n // ratio]
    ref = pooled_reference(kv, score, ratio, overlap)
    torch.testing.assert_close(got[closing], ref, atol=1e-5, rtol=1e-5)


def test_two_requests_in_one_step_keep_their_own_state():
    torch.manual_seed(1)
    d, ratio = 4, 4
    a_kv, a_s = torch.randn(9, 2 * d), torch.randn(9, 2 * d)
    b_kv, b_s = torch.randn(6, 2 * d), torch.randn(6, 2 * d)
    table = torch.arange(1, 33, dtype=torch.int32).repeat(2, 1)
    state = torch.zeros(2, 2, 3, d)
    # request 0 alone for 5 rows, then both in one step (request 1 fresh)
    step = one_request_step(0, 5, table)
    pool_windows_torch(a_kv[:5], a_s[:5], state, ratio, True, step)
    both = CompressedStep(
        positions=torch.cat([torch.arange(5, 9), torch.arange(0, 6)]),
        row_req=torch.tensor([0] * 4 + [1] * 6),
        req_rows=torch.tensor([0, 1]),
        start_pos=torch.tensor([5, 0]),
        end_pos=torch.tensor([9, 6]),
        fresh=torch.tensor([False, True]),
        req_to_token=table,
        max_extend=6,
        max_seq=9,
    )
    got = pool_windows_torch(
        torch.cat([a_kv[5:], b_kv]), torch.cat([a_s[5:], b_s]), state, ratio, True, both
    )
    torch.testing.assert_close(got[2], pooled_reference(a_kv, a_s, ratio, True)[1])  # pos 7
    torch.testing.assert_close(got[4 + 3], pooled_reference(b_kv, b_s, ratio, True)[0])


def indexer_step(n_rows: int, ratio: int, seq: int) -> CompressedStep:
    table = torch.arange(1, seq + 1, dtype=torch.int32)[None]
    return one_request_step(seq - n_rows, seq, table)


def test_indexer_top_k_keeps_the_best_visible_entries():
    """Distinct scores: the picks are exactly the k best entries each row may see."""
    torch.manual_seed(2)
    ratio, seq, heads, di, k = 4, 64, 2, 8, 5
    step = indexer_step(seq, ratio, seq)
    keys = torch.rand(seq + 1, di)  # positive dot products: no ReLU ties
    q = torch.rand(seq, heads, di)
    w = torch.rand(seq, heads) + 0.5
    scores = indexer_scores_torch(q, w, keys, step, ratio, 0.5)
    e = torch.arange(seq // ratio)
    last_slots = (e * ratio + ratio - 1) + 1
    dense = torch.einsum("thd,ed->the", q, keys[last_slots]).relu() * 0.5
    dense = torch.einsum("the,th->te", dense, w)
    visible = e[None, :] < ((step.positions + 1) // ratio)[:, None]
    torch.testing.assert_close(scores[visible], dense[visible])
    assert torch.isneginf(scores[~visible]).all()
    picks = scores.topk(k, dim=-1).indices
    for t in range(seq):
        n_visible = int(visible[t].sum())
        expect = set(dense[t, :n_visible].topk(min(k, n_visible)).indices.tolist())
        assert set(picks[t].tolist()) & set(range(n_visible)) == expect


def test_indexer_top_k_over_tied_scores_keeps_the_top_scores():
    """ReLU ties many scores at 0: which tied entries are kept is arbitrary, but the kept
    scores are the k largest."""
    torch.manual_seed(3)
    ratio, seq, heads, di, k = 4, 96, 2, 8, 6
    step = indexer_step(seq, ratio, seq)
    keys = torch.randn(seq + 1, di)
    keys[::3] = 0.0  # a third of the entries score exactly 0 for every query
    q = torch.randn(seq, heads, di)
    w = torch.ones(seq, heads)
    scores = indexer_scores_torch(q, w, keys, step, ratio, 1.0)
    picks = scores.topk(k, dim=-1)
    finite = torch.isfinite(scores)
    for t in range(seq):
        best = scores[t][finite[t]].sort(descending=True).values[:k]
        torch.testing.assert_close(picks.values[t][: len(best)], best)


def test_sparse_attention_equals_dense_softmax_with_sinks():
    torch.manual_seed(4)
    ratio, seq, heads, d, window = 4, 40, 3, 8, 6
    table = torch.arange(1, seq + 1, dtype=torch.int32)[None]
    step = one_request_step(30, seq, table)  # 10 rows over a 30-token prefix
    kv = torch.randn(seq + 1, 1, d)
    comp = torch.randn(seq + 1, d)
    q = torch.randn(10, heads, d)
    sinks = torch.randn(heads)
    picks = torch.tensor([[0, 3, -1, 5, 9]] * 10)  # entry 9: seen from position 39 only
    out = sparse_attention_torch(q, kv, comp, step, window, ratio, picks, sinks, 0.3)
    for i, p in enumerate(range(30, seq)):
        keys = [kv[1 + j, 0] for j in range(p - window + 1, p + 1)]
        keys += [comp[1 + e * ratio + ratio - 1] for e in (0, 3, 5, 9) if e < (p + 1) // ratio]
        keys = torch.stack(keys)
        logits = q[i] @ keys.T * 0.3
        z = torch.cat([logits, sinks[:, None]], dim=1).softmax(dim=1)[:, :-1]
        torch.testing.assert_close(out[i], z @ keys, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("prefix,rows,requests", [(0, 300, 1), (600, 1, 1), (2000, 8, 8)])
@pytest.mark.parametrize("splits,config", [(None, None), (1, None), (4, None), (4, (64, 32, 8, 2))])
def test_sparse_attention_kernel_at_v4_flash_shapes_matches_twin(
    prefix, rows, requests, splits, config
):
    """bf16, 64 heads of 512 over a window of 128 (rows before its first key block's first
    key included), CSA picks sorted as the indexer's top-k and HCA's every entry; one
    program a row and the keys split with a merge (the decode rows' default); every head a
    program with its keys split too."""
    from breakgraph.bench.v4_attention import HEAD_DIM, WINDOW, top_k_picks, v4_step, v4_tensors
    from breakgraph.kernels.compressed_attention import sparse_attention_triton

    torch.manual_seed(5)
    step = v4_step(prefix, rows, requests)
    q, kv, comp, sinks = v4_tensors(step)
    picks, _ = top_k_picks(step, 4)
    # the model's call: q as projected, normed and roped in the kernel, the output's rope
    # undone there (or in the merge)
    rope = (*torch.randn(2, q.shape[0], 32, device=q.device).unbind(0), 1e-6)
    for (ratio, pk), fold in itertools.product(((4, picks), (128, None)), (None, rope)):
        args = (q, kv, comp, step, WINDOW, ratio, pk, sinks, HEAD_DIM**-0.5)
        got = sparse_attention_triton(*args, splits=splits, config=config, rope=fold)
        want = sparse_attention_torch(*args, rope=fold)
        assert not got.isnan().any()
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
