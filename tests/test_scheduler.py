"""Scheduler: queueing under a small KV pool, abort, retraction, no slot leaks."""

from __future__ import annotations

import random

import pytest

from breakgraph.engine.args import EngineArgs
from breakgraph.engine.engine import Engine
from breakgraph.engine.request import SamplingParams


def make_engine(path, **kw) -> Engine:
    args = EngineArgs(model_path=str(path), device="cpu", dtype="float32", max_total_tokens=2048)
    for k, v in kw.items():
        setattr(args, k, v)
    return Engine(args)


def assert_no_leak(engine: Engine) -> None:
    assert not engine.has_work
    tree, alloc = engine.tree, engine.allocator
    assert tree.protected_size == 0, "a finished request still locks tree nodes"
    assert alloc.available + tree.total_size() == alloc.capacity
    assert engine.req_pool.available == engine.max_running_requests + 1
    assert engine.flush_cache()
    assert alloc.available == alloc.capacity


def test_small_pool_finishes_all_by_queueing(tiny_llama_dir):
    # 12 requests of 40 prompt + 30 output tokens need 840 slots; the pool has 200
    engine = make_engine(tiny_llama_dir, max_total_tokens=200, chunked_prefill_size=64)
    rng = random.Random(0)
    ps = [[rng.randrange(3, 256) for _ in range(40)] for _ in range(12)]
    sp = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
    results = engine.generate(ps, sp)
    assert all(len(r.output_ids) == 30 for r in results)
    assert all(r.finish_reason["type"] == "length" for r in results)
    # the same prompts alone give the same greedy tokens: queueing/retraction changed nothing
    solo = make_engine(tiny_llama_dir)
    for p, r in zip(ps[:3], results[:3], strict=True):
        assert solo.generate([p], sp)[0].output_ids == r.output_ids
    assert_no_leak(engine)


def test_retraction_resumes_to_same_output(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, max_total_tokens=160, chunked_prefill_size=64)
    engine.scheduler.new_token_ratio = engine.scheduler.cfg.min_new_token_ratio = 0.0  # over-admit
    rng = random.Random(1)
    ps = [[rng.randrange(3, 256) for _ in range(30)] for _ in range(4)]
    sp = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    results = engine.generate(ps, sp)
    assert engine.scheduler.num_retractions > 0, "the pool was meant to run short in decode"
    solo = make_engine(tiny_llama_dir)
    for p, r in zip(ps, results, strict=True):
        assert solo.generate([p], sp)[0].output_ids == r.output_ids
    assert_no_leak(engine)


def test_abort_frees_slots_at_once(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, disable_radix_cache=True)
    base = engine.allocator.available
    rid = engine.add_request(
        list(range(3, 60)), SamplingParams(max_new_tokens=100, ignore_eos=True)
    )
    for _ in range(5):
        engine.step()
    assert engine.allocator.available < base
    out = engine.abort(rid)
    assert out.finished and out.finish_reason["type"] == "abort"
    assert engine.allocator.available == base
    assert not engine.has_work
    assert engine.abort("no-such-request") is None


def test_abort_waiting_and_chunked(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, chunked_prefill_size=16, max_running_requests=1)
    a = engine.add_request(list(range(3, 100)), SamplingParams(max_new_tokens=5))
    b = engine.add_request(list(range(3, 20)), SamplingParams(max_new_tokens=5))
    engine.step()  # a is mid-prefill (chunked), b waits behind max_running_requests
    assert engine.scheduler.chunked is not None
    assert engine.abort(b).finished
    assert engine.abort(a).finished
    assert_no_leak(engine)


def test_200_mixed_requests_leave_no_slot(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, max_total_tokens=600, chunked_prefill_size=48)
    rng = random.Random(2)
    shared = [rng.randrange(3, 256) for _ in range(24)]
    live: list[str] = []
    done: set[str] = set()
    for i in range(200):
        n = rng.randrange(1, 60)
        prompt = (shared[: rng.randrange(0, 24)] + [rng.randrange(3, 256) for _ in range(n)])[:80]
        sp = SamplingParams(
            max_new_tokens=rng.randrange(0, 12),
            temperature=rng.choice([0.0, 0.8]),
            top_p=rng.choice([1.0, 0.9]),
            top_k=rng.choice([-1, 20]),
            seed=rng.choice([None, i]),
            ignore_eos=rng.random() < 0.5,
        )
        live.append(engine.add_request(prompt, sp, rid=f"r{i}"))
        if rng.random() < 0.1:
            out = engine.abort(live[rng.randrange(len(live))])
            if out is not None:
                done.add(out.rid)
        done.update(o.rid for o in engine.step() if o.finished)
        if rng.random() < 0.05 and not engine.has_work:
            assert engine.flush_cache()
    while engine.has_work:
        done.update(o.rid for o in engine.step() if o.finished)
    assert done == set(live)
    assert_no_leak(engine)


def test_rejects_bad_requests(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, max_total_tokens=100)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([])
    with pytest.raises(ValueError, match="out of range"):
        engine.add_request([1, 256])
    with pytest.raises(ValueError, match="context length"):
        engine.add_request([1] * 10, SamplingParams(max_new_tokens=600))
    with pytest.raises(ValueError, match="KV pool"):
        engine.add_request([1] * 150, SamplingParams(max_new_tokens=1))
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request([1], SamplingParams(temperature=-1))
    with pytest.raises(ValueError, match="no tokenizer"):
        engine.encode_prompt("text")


def test_mixed_chunk_decodes_during_a_long_prefill(tiny_llama_dir):
    """With --enable-mixed-chunk, running requests keep decoding while a long prompt is
    prefilled in chunks, and every output equals the one computed alone."""
    engine = make_engine(tiny_llama_dir, chunked_prefill_size=32, enable_mixed_chunk=True)
    rng = random.Random(3)
    short = [[rng.randrange(3, 256) for _ in range(10)] for _ in range(3)]
    long = [rng.randrange(3, 256) for _ in range(200)]
    sp = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(p, sp) for p in short]
    first = engine.step()  # the short prompts prefill together, then decode
    rids.append(engine.add_request(long, sp))
    outputs: dict[str, list[int]] = {r: [] for r in rids}
    for o in first:
        outputs[o.rid].extend(o.token_ids)
    mixed_steps = 0
    while engine.has_work:
        decoding = len(engine.scheduler.running)
        prefilling = engine.scheduler.chunked is not None or bool(engine.scheduler.waiting)
        outs = engine.step()
        if decoding and prefilling and engine.scheduler.last_step_tokens > decoding:
            mixed_steps += any(o.rid != rids[-1] and o.token_ids for o in outs)
        for o in outs:
            outputs[o.rid].extend(o.token_ids)
    assert mixed_steps >= 3, "short requests should decode while the long prompt prefills"
    solo = make_engine(tiny_llama_dir)
    for rid, p in zip(rids, short + [long], strict=True):
        assert outputs[rid] == solo.generate([p], sp)[0].output_ids
    assert_no_leak(engine)


def test_mixed_chunk_no_leak_under_pressure(tiny_llama_dir):
    engine = make_engine(
        tiny_llama_dir, max_total_tokens=300, chunked_prefill_size=48, enable_mixed_chunk=True
    )
    rng = random.Random(4)
    ps = [[rng.randrange(3, 256) for _ in range(rng.randrange(5, 70))] for _ in range(30)]
    sp = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    results = engine.generate(ps, sp)
    assert all(len(r.output_ids) == 12 for r in results)
    assert_no_leak(engine)
