"""Scheduler: queueing under a small KV pool, abort, retraction, no slot leaks; chunking,
prefix hits and --max-prefill-tokens over a fake model."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from breakgraph.cache import RadixCache, ReqToTokenPool, SlotAllocator
from breakgraph.common.messages import TokenDelta
from breakgraph.engine.request import Req, SamplingParams
from breakgraph.engine.scheduler import Scheduler, SchedulerConfig
from breakgraph.forward_batch import ForwardBatch, ForwardMode, upload_groups
from tests.support.engines import assert_no_leak, make_engine


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
    # over-admit: no room reserved for future decode tokens
    engine.scheduler.decode.new_token_ratio = engine.scheduler.cfg.min_new_token_ratio = 0.0
    rng = random.Random(1)
    ps = [[rng.randrange(3, 256) for _ in range(30)] for _ in range(4)]
    sp = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    results = engine.generate(ps, sp)
    assert engine.stats()["num_retractions"] > 0, "the pool was meant to run short in decode"
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
    assert engine.scheduler.prefill.chunked is not None
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
        engine.tree.check_invariants()  # sizes, locks and the eviction heap, after every step
        if rng.random() < 0.05 and not engine.has_work:
            assert engine.flush_cache()
    while engine.has_work:
        done.update(o.rid for o in engine.step() if o.finished)
        engine.tree.check_invariants()
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
        decoding = len(engine.scheduler.decode.running)
        prefilling = engine.scheduler.prefill.has_work
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


# ---- the scheduler alone, over a fake model ----

VOCAB = 64


class FakeModel:
    """Next token = (sum of the context's ids) % VOCAB, the context read back through
    req_to_token from a fake KV store that each forward writes at ``out_cache_loc``: a
    wrong table entry, a lost cached prefix or a slot reused too early changes the output."""

    def __init__(self, num_slots: int, req_pool: ReqToTokenPool):
        self.kv = torch.zeros(num_slots, dtype=torch.int64)
        self.req_pool = req_pool
        self.batches: list[ForwardBatch] = []

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        self.batches.append(batch)
        self.kv[batch.out_cache_loc] = batch.input_ids
        table = self.req_pool.table
        rows = batch.req_pool_indices.tolist()
        nxt = [
            int(self.kv[table[r, :n].long()].sum()) % VOCAB
            for r, n in zip(rows, batch.seq_lens_cpu, strict=True)
        ]
        return torch.nn.functional.one_hot(torch.tensor(nxt), VOCAB).float() * 10.0

    def prefills(self) -> list[tuple[list[int], list[int]]]:
        """(prefix_lens, extend_lens) of each extend batch, in order."""
        return [
            (b.prefix_lens_cpu, b.extend_lens_cpu)
            for b in self.batches
            if b.mode is ForwardMode.EXTEND
        ]


def model_output(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(sum(seq) % VOCAB)
    return seq[len(prompt) :]


def make_scheduler(
    num_slots: int = 1024, chunk: int = 64, max_running: int = 8, radix: bool = True, **cfg
) -> tuple[Scheduler, FakeModel]:
    allocator = SlotAllocator(num_slots + 1, debug=True)
    req_pool = ReqToTokenPool(max_running, 256, "cpu")
    model = FakeModel(num_slots + 1, req_pool)
    config = SchedulerConfig(
        chunked_prefill_size=chunk,
        max_running_requests=max_running,
        max_context_len=256,
        eos_token_ids=set(),
        **cfg,
    )
    tree = RadixCache(allocator, disable=not radix)
    return Scheduler(model, allocator, req_pool, tree, config, torch.device("cpu")), model


def submit(sched: Scheduler, prompt: list[int], max_new_tokens: int = 8) -> str:
    rid = f"r{len(sched.reqs)}-{random.getrandbits(32):x}"
    sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    sched.add(Req(rid=rid, input_ids=list(prompt), sampling=sp))
    return rid


def drain(sched: Scheduler, outputs: dict | None = None) -> dict[str, list[TokenDelta]]:
    """Step until idle; every TokenDelta, by request."""
    outputs = {} if outputs is None else outputs
    for _ in range(10_000):
        if not sched.has_work:
            return outputs
        for o in sched.step():
            outputs.setdefault(o.rid, []).append(o)
    raise AssertionError("the scheduler did not finish its requests")


def tokens(outs: list[TokenDelta]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def assert_all_free(sched: Scheduler) -> None:
    """Nothing in flight holds a slot or a row: after a flush the pool is full again."""
    cache = sched.cache
    assert not sched.has_work
    assert sched.stats().kv_tokens_used == 0
    assert cache.tree.protected_size == 0
    assert cache.req_pool.available == cache.req_pool.max_reqs
    assert cache.tree.flush()
    assert cache.allocator.available == cache.allocator.capacity
    cache.allocator.check_no_leak(0)


def rand_prompts(seed: int, n: int, lo: int, hi: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def test_outputs_are_what_the_model_dictates():
    # shared prefixes: requests prefilled in one batch hand their duplicate slots back
    # and switch to the tree's; a small pool reuses freed slots soon after
    sched, _ = make_scheduler(num_slots=200, chunk=64)
    shared = rand_prompts(10, 1, 24, 25)[0]
    prompts = [shared[: 4 * i] + p for i, p in enumerate(rand_prompts(0, 10, 1, 40))]
    rids = [submit(sched, p, max_new_tokens=1 + i) for i, p in enumerate(prompts)]
    outs = drain(sched)
    for i, (rid, p) in enumerate(zip(rids, prompts, strict=True)):
        assert tokens(outs[rid]) == model_output(p, 1 + i)
        last = outs[rid][-1]
        assert last.finished and last.finish_reason == {"type": "length", "length": 1 + i}
        assert (last.prompt_tokens, last.completion_tokens) == (len(p), 1 + i)
    assert_all_free(sched)


@pytest.mark.parametrize("overlap", [False, True])
def test_deferred_release_holds_kv_until_released_and_changes_no_output(overlap):
    """With ``defer_release`` (the server's loop) a finished request keeps its KV until
    ``release_finished`` (after its outputs are sent) or the next step; outputs and slot
    accounting are those of the immediate release, nothing leaks, retraction included."""
    results, held = [], []
    for defer in (False, True):
        sched, _ = make_scheduler(num_slots=120, chunk=32, overlap=overlap)
        sched.defer_release = defer
        prompts = rand_prompts(3, 8, 5, 30)
        rids = [submit(sched, p, max_new_tokens=6) for p in prompts]
        outs = {}
        held_after_finish = []
        for _ in range(10_000):
            if not sched.has_work:
                break
            step = sched.step()
            for o in step:
                outs.setdefault(o.rid, []).append(o)
            if any(o.finished for o in step):
                held_after_finish.append(sched.stats().kv_tokens_used)
                sched.release_finished()
        results.append([tokens(outs[r]) for r in rids])
        held.append(held_after_finish)
        assert_all_free(sched)
    assert results[0] == results[1]
    # the same steps finish requests; deferred, their slots were still held at that point
    assert len(held[0]) == len(held[1]) and sum(held[1]) > sum(held[0])
    assert all(d >= i for d, i in zip(held[1], held[0], strict=True))


def test_chunked_prefill_splits_a_long_prompt():
    sched, model = make_scheduler(chunk=16)
    prompt = rand_prompts(1, 1, 50, 51)[0]
    rid = submit(sched, prompt, max_new_tokens=3)
    for _ in range(3):  # no token before the last chunk
        assert sched.step() == []
    outs = drain(sched)
    assert model.prefills() == [([0], [16]), ([16], [16]), ([32], [16]), ([48], [2])]
    assert tokens(outs[rid]) == model_output(prompt, 3)
    assert_all_free(sched)


@pytest.mark.parametrize("radix", [True, False])
def test_prefix_hit_skips_the_cached_tokens(radix):
    sched, model = make_scheduler(chunk=256, radix=radix)
    shared = rand_prompts(2, 1, 40, 41)[0]
    a = shared + [1]
    b = shared + [2, 3, 4, 5, 6]
    drain(sched, {submit(sched, a, max_new_tokens=4): []})
    sched.cache.req_pool.table.zero_()  # b must not read what a's row left behind
    model.batches.clear()
    rid = submit(sched, b, max_new_tokens=4)
    outs = drain(sched)
    hit = 40 if radix else 0
    assert model.prefills()[0] == ([hit], [len(b) - hit])
    assert outs[rid][-1].cached_tokens == hit
    assert tokens(outs[rid]) == model_output(b, 4)  # the reused KV is the right one
    assert_all_free(sched)


def test_aborts_and_finishes_free_every_slot():
    sched, _ = make_scheduler(chunk=16, max_running=2)
    long, short = rand_prompts(3, 1, 60, 61)[0], rand_prompts(4, 1, 5, 6)[0]
    chunked = submit(sched, long)
    waiting = submit(sched, short)
    decoding = submit(sched, short, max_new_tokens=50)
    nothing = submit(sched, short, max_new_tokens=0)
    done = submit(sched, short, max_new_tokens=3)
    sched.step()
    assert sched.prefill.chunked is not None
    aborted = {rid: sched.abort(rid) for rid in (chunked, waiting)}
    outs: dict[str, list[TokenDelta]] = {}
    for _ in range(4):
        for o in sched.step():
            outs.setdefault(o.rid, []).append(o)
    assert sched.reqs[decoding].decoding
    aborted[decoding] = sched.abort(decoding)
    drain(sched, outs)
    for out in aborted.values():
        assert out.finished and out.finish_reason["type"] == "abort"
    assert outs[nothing] == [outs[nothing][0]] and outs[nothing][0].finish_reason["length"] == 0
    assert tokens(outs[done]) == model_output(short, 3)
    assert sched.abort(done) is None and sched.abort("no-such-request") is None
    assert_all_free(sched)


def test_retraction_under_a_tiny_pool_keeps_the_outputs():
    # 4 requests of 20 prompt + 30 output tokens need 200 slots; the pool has 100
    sched, _ = make_scheduler(num_slots=100, chunk=32)
    sched.decode.new_token_ratio = sched.cfg.min_new_token_ratio = 0.0  # over-admit
    prompts = rand_prompts(5, 4, 20, 21)
    rids = [submit(sched, p, max_new_tokens=30) for p in prompts]
    outs = drain(sched)
    assert sched.stats().num_retractions > 0, "the pool was meant to run short in decode"
    for rid, p in zip(rids, prompts, strict=True):
        assert tokens(outs[rid]) == model_output(p, 30)
    assert_all_free(sched)


def test_max_prefill_tokens_bounds_a_prefill_batch():
    prompts = rand_prompts(6, 5, 8, 9)
    runs = {}
    for bound in (None, 20):
        sched, model = make_scheduler(chunk=64, max_prefill_tokens=bound)
        rids = [submit(sched, p) for p in prompts]
        outs = drain(sched)
        runs[bound] = [tokens(outs[r]) for r in rids]
        runs[bound, "prefills"] = [ext for _, ext in model.prefills()]
        assert_all_free(sched)
    assert runs[None, "prefills"] == [[8] * 5]
    assert runs[20, "prefills"] == [[8, 8], [8, 8], [8]]
    assert runs[None] == runs[20] == [model_output(p, 8) for p in prompts]


def test_max_prefill_tokens_admits_a_longer_request_as_a_chunk():
    sched, model = make_scheduler(chunk=32, max_prefill_tokens=10)
    long, short = rand_prompts(7, 1, 50, 51)[0], rand_prompts(8, 1, 5, 6)[0]
    rids = [submit(sched, long, max_new_tokens=2), submit(sched, short, max_new_tokens=2)]
    outs = drain(sched)
    # the chunk size alone cuts the long prompt; the short one waits to lead a batch
    assert [ext for _, ext in model.prefills()] == [[32], [18], [5]]
    assert [tokens(outs[r]) for r in rids] == [model_output(long, 2), model_output(short, 2)]
    assert_all_free(sched)


def test_engine_passes_max_prefill_tokens(tiny_llama_dir):
    # prefill rows only: no running request decodes inside the second batch
    engine = make_engine(tiny_llama_dir, max_prefill_tokens=16, enable_mixed_chunk=False)
    extends: list[int] = []
    inner = engine.scheduler.forward

    def forward(batch):
        if batch.mode is ForwardMode.EXTEND:
            extends.append(sum(batch.extend_lens_cpu))
        return inner(batch)

    engine.scheduler.forward = forward
    ps = rand_prompts(9, 4, 6, 7)
    sp = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
    engine.generate(ps, sp)
    assert extends == [12, 12]
    assert_no_leak(engine)


@pytest.mark.parametrize("overlap", [False, True])
def test_n_samples_share_one_prompt_prefill(tiny_llama_dir, overlap):
    """Four seeded samples of one prompt: the prompt is computed once (each other sample
    computes only its last token, a cache hit), the samples differ and are reproducible."""
    # prefill rows only: the first sample does not decode inside the others' batch
    engine = make_engine(tiny_llama_dir, overlap_schedule=overlap, enable_mixed_chunk=False)
    computed = []
    launch = engine.scheduler.launch

    def counting(reqs, batch):
        if batch.mode is ForwardMode.EXTEND:
            computed.append(batch.num_tokens)
        return launch(reqs, batch)

    engine.scheduler.launch = counting
    prompt = list(range(3, 103))
    sps = [SamplingParams(max_new_tokens=8, temperature=1.0, seed=7 + j) for j in range(4)]
    first = [r.output_ids for r in engine.generate([prompt] * 4, sps)]
    assert sum(computed) == len(prompt) + 3, computed
    assert len({tuple(o) for o in first}) == 4
    assert [r.output_ids for r in engine.generate([prompt] * 4, sps)] == first
    assert_no_leak(engine)


def test_a_prompt_the_batch_computes_waits_a_step_and_hits_the_cache():
    """In one burst, distinct prompts of one length all go in the first batch; a prompt
    that one of them computes waits a step and takes its KV from the tree, not computed
    twice (the batch finds it by content, not by comparing every pair)."""
    sched, _ = make_scheduler(num_slots=1024, chunk=256, max_running=16)
    distinct = rand_prompts(6, 6, 20, 21)
    (same,) = rand_prompts(5, 1, 20, 21)
    prompts = [*distinct, same, list(same)]
    rids = [submit(sched, p, max_new_tokens=2) for p in prompts]
    outs: dict[str, list[TokenDelta]] = {}
    for o in sched.step():
        outs.setdefault(o.rid, []).append(o)
    assert sched.last_step_tokens == 7 * 20  # the six and the first copy; the second waits
    drain(sched, outs)
    for rid, p in zip(rids, prompts, strict=True):
        assert tokens(outs[rid]) == model_output(p, 2)
    cached = [outs[rid][-1].cached_tokens for rid in rids]
    assert cached == [0] * 7 + [19]  # all but its last token from the tree
    assert_all_free(sched)


def test_upload_groups_keeps_empty_rows_and_groups_and_every_row_aligned():
    """Rows of any length (empty too) from lists, arrays and tensors; an empty group; each
    group's rows in their dtype, equal to their input, each starting on a 16-byte boundary
    of the one buffer they share."""
    rows64 = [[5, 6, 7], [], np.arange(4, dtype=np.int32), torch.arange(3)]
    rows32 = [np.array([9], dtype=np.int64), [], torch.tensor([1, 2, 3, 4, 5], dtype=torch.int32)]
    empty, i64, i32 = upload_groups(
        [([], torch.int64), (rows64, torch.int64), (rows32, torch.int32)], torch.device("cpu")
    )
    assert empty == []
    assert [t.tolist() for t in i64] == [[5, 6, 7], [], [0, 1, 2, 3], [0, 1, 2]]
    assert [t.tolist() for t in i32] == [[9], [], [1, 2, 3, 4, 5]]
    assert {t.dtype for t in i64} == {torch.int64} and {t.dtype for t in i32} == {torch.int32}
    live = [t for t in i64 + i32 if t.numel()]
    assert len({t.untyped_storage().data_ptr() for t in live}) == 1
    base = min(t.data_ptr() for t in live)
    assert all((t.data_ptr() - base) % 16 == 0 for t in live)


@pytest.mark.parametrize("batch", [1, 2, 3, 5, 6])
@pytest.mark.parametrize("extra", [0, 1])
def test_step_metadata_rows_start_16_byte_aligned(batch, extra):
    """Triton specializes pointers on 16-byte alignment: rows packed end to end would give
    each batch residue (and token-count parity) its own kernel variant, compiled in traffic
    when the warm-up missed the class. Every row the kernels read is aligned, and equal to
    its input."""
    ext = [3 + extra + 2 * i for i in range(batch)]
    pre = [i % 3 for i in range(batch)]
    total = sum(ext)
    ids = list(range(100, 100 + total))
    slots = list(range(40, 40 + total))
    rows = [(i * 5) % 7 for i in range(batch)]
    fb = ForwardBatch.build(ForwardMode.EXTEND, ids, slots, rows, pre, ext, "cpu", table_width=64)
    tensors = {
        name: getattr(fb, name)
        for name in (
            "input_ids", "positions", "out_cache_loc", "req_pool_indices", "logits_rows",
            "seq_lens", "prefix_lens", "extend_lens", "extend_start_loc", "table_cells",
            "table_slots",
        )
    }  # fmt: skip
    # one upload: the int64 and the int32 rows share one buffer (one pinned copy on CUDA)
    assert len({t.untyped_storage().data_ptr() for t in tensors.values()}) == 1
    assert fb.input_ids.dtype == torch.int64 and fb.seq_lens.dtype == torch.int32
    base = min(t.data_ptr() for t in tensors.values())
    for name, t in tensors.items():
        assert (t.data_ptr() - base) % 16 == 0, name
    assert fb.input_ids.tolist() == ids and fb.out_cache_loc.tolist() == slots
    assert fb.req_pool_indices.tolist() == rows and fb.extend_lens.tolist() == ext
    assert fb.seq_lens.tolist() == [p + e for p, e in zip(pre, ext, strict=True)]
    assert fb.extend_start_loc.tolist() == [sum(ext[:i]) for i in range(batch)]
    assert fb.table_slots.tolist() == slots
