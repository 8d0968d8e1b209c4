"""Logits equal HF transformers' on the same weights: whole, ragged, prefix-cached, chunked."""

from __future__ import annotations

import pytest
import torch

from tests.support.engines import make_engine
from tests.support.hf import ATOL, LogitsTap, assert_greedy_equals_hf, hf_logits, one_token, prompts


def test_whole_request_matches_hf(hf_checkpoint):
    _, hf, path = hf_checkpoint
    engine = make_engine(path)
    tap = LogitsTap(engine)
    (p,) = prompts(1, [37])
    engine.generate([p], one_token())
    ref = hf_logits(hf, p)[-1]
    torch.testing.assert_close(tap.steps[0][0], ref, atol=ATOL, rtol=1e-4)


def test_ragged_batch_matches_hf(hf_checkpoint):
    _, hf, path = hf_checkpoint
    engine = make_engine(path)
    tap = LogitsTap(engine)
    ps = prompts(4, [5, 33, 1, 70])
    engine.generate(ps, one_token())
    assert len(tap.steps) == 1, "all four prompts fit one prefill step"
    for row, p in enumerate(ps):
        torch.testing.assert_close(tap.steps[0][row], hf_logits(hf, p)[-1], atol=ATOL, rtol=1e-4)


def test_cached_prefix_matches_hf(hf_checkpoint):
    _, hf, path = hf_checkpoint
    engine = make_engine(path)
    tap = LogitsTap(engine)
    (base,) = prompts(1, [48])
    engine.generate([base], one_token())
    extended = base + [7, 8, 9, 10, 11]
    (res,) = engine.generate([extended], one_token())
    assert res.cached_tokens == len(base)  # the whole first prompt is reused
    torch.testing.assert_close(tap.steps[-1][0], hf_logits(hf, extended)[-1], atol=ATOL, rtol=1e-4)


def test_chunked_prefill_matches_hf(hf_checkpoint):
    _, hf, path = hf_checkpoint
    engine = make_engine(path, chunked_prefill_size=16)
    tap = LogitsTap(engine)
    ps = prompts(2, [50, 9])
    engine.generate(ps, one_token())
    assert len(tap.steps) >= 4  # 59 tokens in 16-token steps
    got = {}
    # the chunked prompt's logits come from its last chunk; the short one's from its step
    for p in ps:
        ref = hf_logits(hf, p)[-1]
        assert any(torch.allclose(s, ref, atol=ATOL, rtol=1e-4) for st in tap.steps for s in st), (
            f"no step produced the logits of the {len(p)}-token prompt"
        )
        got[len(p)] = True
    assert len(got) == 2


@pytest.mark.parametrize("disable_radix,mixed", [(False, False), (True, False), (False, True)])
def test_greedy_decode_matches_hf_generate(tiny_llama_dir, disable_radix, mixed):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    engine = make_engine(
        tiny_llama_dir,
        chunked_prefill_size=32,
        disable_radix_cache=disable_radix,
        enable_mixed_chunk=mixed,
    )
    ps = prompts(3, [20, 45, 20], seed=5)
    ps[2] = ps[0][:12] + ps[2][:8]  # shares a prefix with the first
    assert_greedy_equals_hf(engine, hf, ps, 12)
