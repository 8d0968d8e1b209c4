"""Prompt and top logprobs against HF's log_softmax: the reference, greedy sampling params, and
the check of an engine result's prompt logprobs."""

from __future__ import annotations

import pytest
import torch

from breakgraph.engine.request import SamplingParams
from tests.support.hf import hf_logits

ATOL = 2e-4


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(hf_logits(hf, ids), dim=-1)


def greedy(n: int = 1, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def check_prompt(res, ref: torch.Tensor, p: list[int], start: int, k: int) -> None:
    lps = res.input_logprobs
    assert len(lps) == len(p) - start
    if start == 0:
        assert lps[0] is None
    for pos, lp in zip(range(start, len(p)), lps, strict=True):
        if pos == 0:
            continue
        assert lp == pytest.approx(ref[pos - 1, p[pos]].item(), abs=ATOL)
    if k:
        assert len(res.input_top_logprobs) == len(lps)
        for pos, top in zip(range(start, len(p)), res.input_top_logprobs, strict=True):
            if pos == 0:
                assert top is None
                continue
            values, ids = ref[pos - 1].topk(k)
            assert [t[1] for t in top] == ids.tolist()
            torch.testing.assert_close(torch.tensor([t[0] for t in top]), values, atol=ATOL, rtol=0)
