"""DeepSeek V4's compressed-attention kernels (kernels/compressed_attention.py) under
Triton's interpreter on CPU tensors, against the torch versions (float32), over a ragged
step of three requests with shuffled slots: attention over the sliding window alone, with
every visible entry (HCA) and with the indexer's picks (CSA), each written into the leading
rows of a larger output (as a graph's break writes its bucket's live rows); the indexer's
scores over the step's entries and over a decode graph's bound (the request table's width:
blocks no row sees yet); the pooling into a given output. Run as ``TRITON_INTERPRET=1
python -m tests.kernels.interpret_compressed`` (started so by ``test_triton_interpret.py``)."""

from __future__ import annotations

import dataclasses
import itertools
import os
import sys

import torch

from breakgraph.bench.v4_attention import CONFIGS, INDEXER_CONFIGS
from breakgraph.kernels import compressed_attention as ca

PREFIX = [0, 21, 40]
EXTEND = [9, 3, 17]


def ragged_step() -> ca.CompressedStep:
    """Three requests over a shuffled slot table: prefix + extend tokens each."""
    width = 64
    slots = torch.randperm(3 * width) + 1
    table = slots.view(3, width).to(torch.int32)
    positions = torch.cat([torch.arange(p, p + e) for p, e in zip(PREFIX, EXTEND, strict=True)])
    row_req = torch.repeat_interleave(torch.arange(3), torch.tensor(EXTEND))
    return ca.CompressedStep(
        positions=positions,
        row_req=row_req,
        req_rows=torch.tensor([2, 0, 1]),
        start_pos=torch.tensor(PREFIX),
        end_pos=torch.tensor(PREFIX) + torch.tensor(EXTEND),
        fresh=torch.tensor(PREFIX) == 0,
        req_to_token=table,
        max_extend=max(EXTEND),
        max_seq=max(p + e for p, e in zip(PREFIX, EXTEND, strict=True)),
    )


def check(name: str, got: torch.Tensor, want: torch.Tensor, tol: float = 1e-5) -> int:
    diff = (got - want).abs().max().item()
    ok = diff <= tol
    print(f"{'ok' if ok else 'FAIL'} {name}: max diff {diff:.1e}")
    return int(not ok)


def main() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1"
    torch.manual_seed(0)
    step = ragged_step()
    t, heads, d, window, ratio = step.positions.shape[0], 3, 32, 8, 4
    n_slots = 3 * 64 + 1
    q = torch.randn(t, heads, d)
    kv = torch.randn(n_slots, 1, d)
    comp = torch.randn(n_slots, d)
    sinks = torch.randn(heads)
    picks = torch.randint(-1, 8, (t, 5))  # some not visible to early rows: skipped
    failed = 0
    # windows of one key block and of three (rows before a block's first key: V4-Flash's
    # 128 over blocks of 16), in one program a row and with its keys split over several
    cases = itertools.product(
        (("window", None, None), ("every entry", comp, None), ("picked entries", comp, picks)),
        (window, 40),
        (1, 4),
    )
    for (name, cache, pk), win, splits in cases:
        args = (q, kv, cache, step, win, ratio, pk, sinks, 0.2)
        bucket = torch.full((t + 5, heads, d), 7.0)  # rows past the step's stay as they are
        ca.sparse_attention_triton(*args, out=bucket[:t], splits=splits)
        want = torch.cat([ca.sparse_attention_torch(*args), torch.full((5, heads, d), 7.0)])
        failed += check(f"sparse attention, {name}, window {win}, {splits} splits", bucket, want)
    # every launch config `bench kernels --v4-attention` times, over sorted picks (the
    # indexer's top-k: the entries a row cannot see yet last, skipped as whole blocks)
    scores = torch.rand(t, 8).masked_fill(
        torch.arange(8)[None, :] >= ((step.positions + 1) // ratio)[:, None], float("-inf")
    )
    sorted_picks = scores.topk(8, dim=-1).indices
    args = (q, kv, comp, step, window, ratio, sorted_picks, sinks, 0.2)
    want = ca.sparse_attention_torch(*args)
    for config, splits in itertools.product(CONFIGS, (1, 2)):
        got = ca.sparse_attention_triton(*args, config=config, splits=splits)
        failed += check(f"sparse attention, sorted picks, {config}, {splits} splits", got, want)
    # V4's q as projected: normed and roped in the kernel, the output's rope undone there (or
    # in the merge), in each default config
    rope = (*torch.randn(2, t, 4).unbind(0), 1e-6)
    for config, splits in itertools.product(CONFIGS[:2], (1, 4)):
        got = ca.sparse_attention_triton(*args, rope=rope, config=config, splits=splits)
        want = ca.sparse_attention_torch(*args, rope=rope)
        failed += check(
            f"sparse attention, q normed and roped, {config}, {splits} splits", got, want
        )
    # every head a program: q normed and roped by its own kernel, the output's tail unroped
    # in place after
    q64 = torch.randn(t, 64, d)
    args64 = (q64, kv, comp, step, window, ratio, sorted_picks, torch.randn(64), 0.2)
    want = ca.sparse_attention_torch(*args64, rope=rope)
    for splits in (1, 4):
        got = ca.sparse_attention_triton(*args64, rope=rope, config=CONFIGS[1], splits=splits)
        failed += check(f"sparse attention, 64 heads, q roped beside, {splits} splits", got, want)
    # the model's call: q given up, normed and roped in its place
    scratch = q64.clone()
    got = ca.sparse_attention_triton(scratch, *args64[1:], rope=rope, q_scratch=True,
                                     config=CONFIGS[1])  # fmt: skip
    diff = (got - want).abs().max().item()
    ok = diff <= 1e-5 and not torch.equal(scratch, q64)  # the result, and q was the scratch
    failed += not ok
    print(f"{'ok' if ok else 'FAIL'} sparse attention, 64 heads, q roped in place: "
          f"max diff {diff:.1e}")  # fmt: skip
    iq, iw = torch.randn(t, 2, 16), torch.rand(t, 2)
    keys = torch.randn(n_slots, 16)
    got, want = [], []
    for bound in (step, dataclasses.replace(step, max_seq=4 * step.req_to_token.shape[1])):
        args = (iq, iw, keys, bound, ratio, 0.25)
        got.append(ca.indexer_scores_triton(*args))
        want.append(ca.indexer_scores_torch(*args))
        # half weights, scaled as they are read (the model's heads^-0.5)
        args = (iq, iw.half(), keys, bound, ratio, 0.25, 0.5)
        got.append(ca.indexer_scores_triton(*args))
        want.append(ca.indexer_scores_torch(*args))
        for config in INDEXER_CONFIGS[1:]:  # the others `bench kernels --v4-attention` times
            got.append(ca.indexer_scores_triton(*args, config=config))
            want.append(want[-1])
    got, want = torch.cat(got, dim=1), torch.cat(want, dim=1)
    same_mask = torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    failed += check("indexer scores", got[finite], want[finite]) + (not same_mask)
    gate, bias = torch.randn(t, 2 * d + 3), torch.randn(ratio, 2 * d + 3)  # ragged columns
    slot = step.positions % ratio
    failed += check(
        "window score", ca.window_score_triton(gate, bias, slot),
        ca.window_score_torch(gate, bias, slot), tol=0.0,
    )  # fmt: skip
    return failed + pooling(step)


def pooling(step: ca.CompressedStep) -> int:
    """Window pooling over the ragged step (one request fresh, two carrying state): the
    closing rows' entries and the new state equal the torch version's."""
    failed = 0
    t = step.positions.shape[0]
    closes_at = {4: (step.positions % 4 == 3), 8: (step.positions % 8 == 7)}
    for overlap, ratio, d in ((True, 4, 24), (False, 8, 40)):
        c = 2 * d if overlap else d
        kv, score = torch.randn(t, c), torch.randn(t, c) * 2
        state = torch.randn(3, 2 if overlap else 1, 3, d)
        state[:, :, 1:].abs_()  # sums of weights are positive
        s_torch, s_triton = state.clone(), state.clone()
        want = ca.pool_windows_torch(kv, score, s_torch, ratio, overlap, step)
        got = torch.zeros(t + 3, d)
        ca.pool_windows_triton(kv, score, s_triton, ratio, overlap, step, out=got[:t])
        assert not got[t:].any()
        got = got[:t]
        closes = closes_at[ratio]
        failed += check(f"pool windows overlap={overlap}", got[closes], want[closes])
        live = torch.isfinite(s_torch)
        same_inf = torch.equal(live, torch.isfinite(s_triton))
        failed += check(f"pool state overlap={overlap}", s_triton[live], s_torch[live]) + (
            not same_inf
        )
    return failed


if __name__ == "__main__":
    sys.exit(main())
