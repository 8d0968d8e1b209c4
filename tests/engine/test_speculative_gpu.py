"""Speculative decoding on the GPU: verify steps replay the decode graphs (each row a decode
row of its request), a draft model's steps replay its own decode graphs (no eager step on
either), and with NEXTN (DeepSeek V4's MTP layer: its state keeps verify steps on the small
prefill buckets, graph_plan.SPEC_BUCKETS) the target's steps replay graphs whose streams it
reads; greedy tokens equal plain
decoding's with graphs (float32), no host sync inside a step, nothing leaked."""

from __future__ import annotations

import pytest
import torch

from breakgraph.engine.graphs.key import DECODE, EAGER, PREFILL_WHOLE
from breakgraph.engine.request import SamplingParams
from tests.support.engines import assert_no_leak
from tests.support.gpu import engine, forbid_host_syncs_in_steps

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    base = torch.randint(5, 1000, (9,), generator=g).tolist()
    return [(base * 5)[:40], *(torch.randint(5, 1000, (n,), generator=g).tolist() for n in (7, 33))]


@pytest.mark.parametrize("algorithm", ["NGRAM", "STANDALONE"])
def test_verify_and_draft_steps_replay_graphs(small_dir, algorithm):
    """The draft is the target itself (the same dummy weights): every draft token kept; with
    a draft model the verify steps run back to back (chained on the device, no host sync);
    a penalized request and logprobs inside verify steps (float32) as plain decoding's."""
    ps = prompts()
    plain = engine(small_dir, graphs=True).generate(ps, greedy(24))
    spec = engine(
        small_dir, graphs=True, speculative_algorithm=algorithm, speculative_num_draft_tokens=3,
        speculative_draft_model_path=str(small_dir), load_format="dummy",
    )  # fmt: skip
    forbid_host_syncs_in_steps(spec)
    runner = spec.runner
    chained = []  # verify steps chained to the one in flight (overlap on: spec_chain.py)
    schedule = spec.scheduler.spec.schedule_chained

    def chain(*a):
        out = schedule(*a)
        chained.append(out is not None)
        return out

    spec.scheduler.spec.schedule_chained = chain
    keys = []  # the verify steps' (every row a decode row: the decode bank)
    dispatch = runner.dispatch

    def spy(batch, penalized=False):
        key = dispatch(batch, penalized)
        keys.append((batch.decode_rows, key))
        return key

    runner.dispatch = spy
    for lone in ps:
        (r,) = spec.generate([lone], greedy(24))
        assert r.output_ids == plain[ps.index(lone)].output_ids
    assert runner.count(PREFILL_WHOLE) > 0  # the lone prompts
    outs = spec.generate(ps, greedy(24))
    assert [r.output_ids for r in outs] == [r.output_ids for r in plain]
    assert {k.bank for rows, k in keys if rows} == {DECODE}, keys
    assert spec.scheduler.spec_stats.steps > 0
    assert runner.count(EAGER) == 0, runner.step_counts  # every step a graph's
    if algorithm == "STANDALONE":
        drafter = spec.scheduler.spec.drafter.runner
        assert drafter.count(DECODE) > 0 and drafter.count(EAGER) == 0, drafter.step_counts
        stats = spec.scheduler.spec_stats
        assert stats.accepted >= 0.9 * stats.drafted, stats
        assert any(chained), "verify steps back to back"
    # penalties and logprobs inside (chained) verify steps: plain decoding's tokens, logprobs
    params = [SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True,
                             repetition_penalty=1.2, frequency_penalty=0.3), greedy(16)]  # fmt: skip
    kw = dict(return_logprob=True, top_logprobs_num=2)
    want = engine(small_dir, graphs=True).generate(ps[:2], params, **kw)
    got = spec.generate(ps[:2], params, **kw)
    for g, w in zip(got, want, strict=True):
        assert g.output_ids == w.output_ids
        torch.testing.assert_close(
            torch.tensor(g.output_logprobs), torch.tensor(w.output_logprobs), atol=1e-3, rtol=0
        )
    assert_no_leak(spec)


@pytest.mark.parametrize("overlap", [False, True])
def test_nextn_target_steps_replay_graphs(overlap):
    """DeepSeek V4's MTP layer drafts (dummy weights: few drafts kept); the target's verify
    and plain steps replay graphs with its streams an output the MTP reads; greedy tokens
    equal plain decoding's with graphs; no host sync inside a step."""
    kw = {"context_length": 1024, "chunked_prefill_size": 256, "overlap_schedule": overlap}
    ps = prompts()
    plain = engine("deepseek-v4-tiny", graphs=True, **kw).generate(ps, greedy(24))
    spec = engine(
        "deepseek-v4-tiny", graphs=True, speculative_algorithm="NEXTN",
        speculative_num_draft_tokens=3, **kw,
    )  # fmt: skip
    forbid_host_syncs_in_steps(spec)
    for lone in ps:
        (r,) = spec.generate([lone], greedy(24))
        assert r.output_ids == plain[ps.index(lone)].output_ids
    outs = spec.generate(ps, greedy(24))
    assert [r.output_ids for r in outs] == [r.output_ids for r in plain]
    stats = spec.scheduler.spec_stats
    assert stats.steps > 0 and stats.drafted > 0, stats
    assert spec.runner.count(EAGER) == 0, spec.runner.step_counts
    assert_no_leak(spec)
