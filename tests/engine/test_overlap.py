"""Overlap scheduling: step k+1 is launched before step k is read back, and every output is
exactly what the same requests give without overlap (greedy, seeded sampling, stop ids and
strings, lengths, penalties, logprobs, mixed chunks, retraction, aborts), with no KV leak."""

from __future__ import annotations

import random

import pytest

from breakgraph.engine.request import SamplingParams
from tests.support.engines import assert_no_leak, make_engine


def letters(ids: list[int]) -> str:
    """A stand-in detokenizer for stop strings (the tiny model has no tokenizer)."""
    return "".join(chr(97 + i % 26) for i in ids)


def run(path, overlap: bool, prompts, sps, steps_before_abort=None, **kw):
    engine = make_engine(path, overlap_schedule=overlap, **kw)
    assert engine.scheduler.cfg.overlap is overlap
    engine.scheduler.output.stop_text = letters
    rids = [
        engine.add_request(p, sp, rid=f"r{i}")
        for i, (p, sp) in enumerate(zip(prompts, sps, strict=True))
    ]
    got = {rid: [] for rid in rids}
    finish = {}

    def take(outs):
        for o in outs:
            got[o.rid].extend(o.token_ids)
            if o.finished:
                finish[o.rid] = o.finish_reason

    if steps_before_abort is not None:
        for _ in range(steps_before_abort):
            take(engine.step())
        take([engine.abort(rids[0])])
    while engine.has_work:
        take(engine.step())
    assert set(finish) == set(rids)
    assert_no_leak(engine)
    return [(got[r], finish[r]) for r in rids], engine


def prompts(n, seed=0, lo=5, hi=60):
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def greedy_stops(path, ps):
    """Stop ids and stop strings the greedy outputs really produce a few tokens in."""
    sp = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    outs, _ = run(path, False, ps[:3], [sp] * 3)
    return [toks[3] for toks, _ in outs], [letters(toks[2:4]) for toks, _ in outs]


def scenarios(path):
    ps = prompts(8)
    stops, strings = greedy_stops(path, ps)
    rng = random.Random(5)
    mixed = [
        SamplingParams(
            max_new_tokens=rng.randrange(1, 14),
            temperature=rng.choice([0.0, 0.9]),
            top_p=rng.choice([1.0, 0.8]),
            top_k=rng.choice([-1, 16]),
            seed=i,
            ignore_eos=True,
            stop_token_ids=[stops[i % 3]] if i % 2 else [],
            min_new_tokens=2 if i == 3 else 0,
            frequency_penalty=0.5 if i == 4 else 0.0,
            repetition_penalty=1.3 if i == 6 else 1.0,
            logit_bias={7: 5.0} if i == 7 else None,
        )
        for i in range(8)
    ]
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    return {
        "greedy": (ps, [greedy] * 8, {}),
        "stop ids": (ps, [SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=[s]) for s in stops * 3][:8], {}),
        "stop strings": (ps, [SamplingParams(max_new_tokens=12, temperature=0.0, stop=[s]) for s in strings * 3][:8], {}),
        "mixed sampling": (ps, mixed, {}),
        "mixed chunk": (ps, mixed, {"enable_mixed_chunk": True, "chunked_prefill_size": 32}),
        "small pool": (ps, [greedy] * 8, {"max_total_tokens": 240, "chunked_prefill_size": 32}),
    }  # fmt: skip


@pytest.mark.parametrize(
    "name", ["greedy", "stop ids", "stop strings", "mixed sampling", "mixed chunk", "small pool"]
)
def test_overlap_equals_no_overlap(tiny_llama_dir, name):
    ps, sps, kw = scenarios(tiny_llama_dir)[name]
    want, _ = run(tiny_llama_dir, False, ps, sps, **kw)
    got, engine = run(tiny_llama_dir, True, ps, sps, **kw)
    assert got == want
    if name.startswith("stop"):  # the first three prompts stop where their greedy run showed
        assert all(f["type"] == "stop" for _, f in got[:3]), got
    assert engine.scheduler.in_flight is None or not engine.has_work


def test_overlap_retraction_equals_no_overlap(tiny_llama_dir):
    ps = prompts(4, seed=1, lo=30, hi=31)
    sp = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    out = {}
    for overlap in (False, True):
        engine = make_engine(
            tiny_llama_dir, overlap_schedule=overlap, max_total_tokens=160, chunked_prefill_size=64
        )
        engine.scheduler.decode.new_token_ratio = engine.scheduler.cfg.min_new_token_ratio = 0.0
        out[overlap] = [r.output_ids for r in engine.generate(ps, sp)]
        assert engine.stats()["num_retractions"] > 0
        assert_no_leak(engine)
    assert out[True] == out[False]


def test_overlap_logprobs_equal(tiny_llama_dir):
    ps = prompts(4, seed=2)
    sp = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    res = {}
    for overlap in (False, True):
        engine = make_engine(tiny_llama_dir, overlap_schedule=overlap)
        res[overlap] = engine.generate(
            ps, sp, return_logprob=True, logprob_start_len=0, top_logprobs_num=3
        )
        assert_no_leak(engine)
    for a, b in zip(res[False], res[True], strict=True):
        assert a.output_ids == b.output_ids
        assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-5)
        assert a.input_logprobs[1:] == pytest.approx(b.input_logprobs[1:], abs=1e-5)
        assert [[t[1] for t in row] for row in a.output_top_logprobs] == [
            [t[1] for t in row] for row in b.output_top_logprobs
        ]


def test_abort_mid_stream_emits_nothing_after(tiny_llama_dir):
    ps = prompts(3, seed=3)
    sp = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    for steps in (1, 2, 5):
        got, engine = run(tiny_llama_dir, True, ps, [sp] * 3, steps_before_abort=steps)
        toks, reason = got[0]
        assert reason["type"] == "abort" and len(toks) < 20
        want, _ = run(tiny_llama_dir, False, ps, [sp] * 3)
        assert toks == want[0][0][: len(toks)]
        assert got[1:] == want[1:]


def test_launch_of_next_step_precedes_read_back(tiny_llama_dir):
    """The mechanism itself: with overlap, step k+1 is launched before step k is read."""
    engine = make_engine(tiny_llama_dir, overlap_schedule=True)
    sched, events = engine.scheduler, []
    launch, process = sched.launch, sched.process_outputs

    def traced_launch(reqs, batch):
        launched = launch(reqs, batch)
        events.append(("launch", launched))
        return launched

    def traced_process(launched):
        events.append(("read", launched))
        return process(launched)

    def at(kind, launched):
        return next(i for i, (k, x) in enumerate(events) if k == kind and x is launched)

    sched.launch, sched.process_outputs = traced_launch, traced_process
    engine.generate(
        [[5, 6, 7, 8]], SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
    )
    launches = [i for kind, i in events if kind == "launch"]
    assert len(launches) == 5  # one prefill, four decodes (the fifth token ends it by length)
    for k in range(1, len(launches)):  # step k launched before step k-1 was read back
        assert at("launch", launches[k]) < at("read", launches[k - 1])
