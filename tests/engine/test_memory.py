"""The memory plan (engine/memory.py): the KV pool's size from the budget left beside what is in
use and the reserve (the largest step's measured peak, the graph pools' estimate, the request
table), on a device with given totals and given peaks; the one-line refusal; the split the
startup log reports. The profile (engine/memory_profile.py) on the embedded model: it leaves
the engine's pools, its runner and the random state as they were, and changes no output."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from breakgraph.common.messages import MemoryReport
from breakgraph.engine.args import EngineArgs
from breakgraph.engine.engine import Engine
from breakgraph.engine.graph_plan import GraphSizes, default_cuda_graph_max_bs, graph_sizes
from breakgraph.engine.graphs.key import (
    DECODE,
    DECODE_LONG,
    DECODE_PENALIZED,
    MTP_DECODE,
    PREFILL,
    PREFILL_WHOLE,
    TAIL,
)
from breakgraph.engine.memory import (
    GIB,
    GRAPH_OVERHEAD_BYTES,
    MAX_RUNNING_DEFAULT_CAP,
    DeviceMemory,
    MemoryPlanError,
    Reserve,
    StepPeaks,
    fit_context,
    graph_pool_estimate,
    graph_pool_estimates,
    kv_budget_slots,
    max_running_requests,
    memory_log_line,
    request_table_bytes,
)
from breakgraph.engine.memory_profile import CPU_ROWS, profile_steps
from breakgraph.engine.rank import CPU_DEFAULT_MAX_TOTAL_TOKENS, num_kv_slots
from breakgraph.engine.request import SamplingParams

SLOT = 28 * 2 * 8 * 128 * 2  # Qwen3-0.6B's bf16 KV per token: 28 layers, k and v, 8 x 128
MIB = 2**20
# a Gemma-4-E2B-like profile: 1 MiB of float32 logits per row (262,144-token vocabulary)
PEAKS = StepPeaks(
    prefill_forward=900 * MIB, prompt_step=1400 * MIB, decode_forward=2300 * MIB,
    decode_step=7 * GIB, decode_rows=1024, prefill_out_row_bytes=21 * 1024,
    logits_row_bytes=MIB, prefill_tokens=8192,
)  # fmt: skip


def test_slots_are_the_budget_left_beside_what_is_in_use():
    mem = DeviceMemory(free=130 * GIB, total=140 * GIB)  # 10 GiB in use: weights, context
    slots = kv_budget_slots(mem, 0.85, SLOT, 40960, weights_bytes=2 * GIB)
    assert slots == int((140 * 0.85 - 10) * GIB // SLOT)
    # a smaller fraction: fewer slots, same arithmetic
    assert kv_budget_slots(mem, 0.5, SLOT, 40960, 2 * GIB) == int((70 - 10) * GIB // SLOT)


def test_the_reserve_comes_out_of_the_kv_budget():
    mem = DeviceMemory(free=130 * GIB, total=140 * GIB)
    reserve = Reserve(activations=7 * GIB, graph_pools=5 * GIB, tables=GIB // 2)
    slots = kv_budget_slots(mem, 0.85, SLOT, 40960, 2 * GIB, reserve)
    assert slots == int((140 * 0.85 - 10 - 12.5) * GIB // SLOT)


def test_the_graph_pool_estimate_is_each_banks_capture_outputs_and_overhead():
    banks = {
        PREFILL: [256, 512],
        DECODE: [1, 2, 4, 8],
        DECODE_LONG: [1],
        DECODE_PENALIZED: [1, 2, 4, 8],
    }

    # PEAKS' profile ran an 8192-token chunk (900 MiB) and 1024 decode rows (2300 MiB): each
    # bank's largest capture is that forward scaled to its tokens or rows; its outputs (its
    # buckets share the largest one's): 512 prefill rows of hidden states, 8 rows of logits,
    # 1, twice 8 (logits and penalized logits)
    def decode(rows):
        return -(-2300 * MIB * rows // 1024)

    expected = {
        PREFILL: -(-900 * MIB * 512 // 8192) + 512 * 21 * 1024 + 2 * GRAPH_OVERHEAD_BYTES,
        DECODE: decode(8) + 8 * MIB + 4 * GRAPH_OVERHEAD_BYTES,
        DECODE_LONG: decode(1) + MIB + GRAPH_OVERHEAD_BYTES,
        DECODE_PENALIZED: decode(8) + 2 * 8 * MIB + 4 * GRAPH_OVERHEAD_BYTES,
    }
    assert graph_pool_estimates(PEAKS, banks) == expected
    assert graph_pool_estimate(PEAKS, banks) == sum(expected.values())
    # a profile that did not say its chunk: the prefill forward as measured (an upper bound)
    unscaled = dataclasses.replace(PEAKS, prefill_tokens=0)
    assert graph_pool_estimates(unscaled, {PREFILL: [256, 512]})[PREFILL] == (
        900 * MIB + 512 * 21 * 1024 + 2 * GRAPH_OVERHEAD_BYTES
    )
    assert graph_pool_estimate(PEAKS, {}) == 0  # the CPU, or a model that runs eagerly
    # NEXTN: decode banks output their hidden rows too, and the MTP's draft-step bank its
    # logits and streams
    decode_only = {DECODE: [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]}
    plain = decode(64) + 64 * MIB + 11 * GRAPH_OVERHEAD_BYTES
    assert graph_pool_estimate(PEAKS, decode_only) == plain
    nextn = {**decode_only, MTP_DECODE: [1, 2, 4, 8]}
    got = graph_pool_estimates(PEAKS, nextn, hidden=True)
    assert got[DECODE] == plain + 64 * 21 * 1024
    assert got[MTP_DECODE] == decode(8) + 8 * MIB + 8 * 21 * 1024 + 4 * GRAPH_OVERHEAD_BYTES


def test_the_plan_on_a_fake_device_sizes_the_pool_from_the_measured_peaks():
    """The whole plan on a 140 GiB device with 12 GiB in use after the profile: KV is what
    the fraction leaves beside it, the largest step, the graph pools and the table."""
    mem = DeviceMemory(free=128 * GIB, total=140 * GIB)
    banks = GraphSizes(256, [256 * i for i in range(1, 33)], 256, 2048).banks(
        model=object(), penalized=True
    )
    tables = request_table_bytes(MAX_RUNNING_DEFAULT_CAP + 1, 131072, object())
    assert tables == 1025 * 131072 * 4
    reserve = Reserve(PEAKS.activations, graph_pool_estimate(PEAKS, banks), tables)
    assert reserve.activations == 7 * GIB  # the decode step's sampling is the largest
    # with speculation, a verify step of every row's logits may be larger still
    assert dataclasses.replace(PEAKS, verify_step=9 * GIB).activations == 9 * GIB
    slots = kv_budget_slots(mem, 0.85, SLOT, 131072, 9 * GIB, reserve)
    budget = 140 * GIB * 0.85 - 12 * GIB - reserve.total
    assert slots == int(budget // SLOT) > 131072
    # a bank's buckets share its largest one's outputs: 256 rows of logits (decode), 1 (long
    # context), twice 256 (penalized), 8192 and 2048 prefill rows (the chunk, whole graphs),
    # not a set per graph (the decode banks alone would keep 3 x 4231 MiB of logits); and
    # each bank its own largest capture
    graphs = sum(len(b) for b in banks.values())
    outputs = (256 + 1 + 2 * 256) * MIB + (8192 + 2048) * 21 * 1024
    captures = 900 * MIB + 900 * MIB // 4 + sum(-(-2300 * MIB * r // 1024) for r in (256, 1, 256))
    assert reserve.graph_pools == captures + outputs + graphs * GRAPH_OVERHEAD_BYTES


def test_a_budget_short_of_one_full_context_request_fails_in_one_line_with_the_numbers():
    mem = DeviceMemory(free=20 * GIB, total=80 * GIB)  # 60 GiB in use
    need_tokens = 131072
    with pytest.raises(MemoryPlanError) as err:
        kv_budget_slots(mem, 0.8, SLOT, need_tokens, weights_bytes=55 * GIB)
    msg = str(err.value)
    assert "\n" not in msg
    for part in ("131072-token request needs 14.00 GiB", "--mem-fraction-static 0.8",
                 "80.0 GiB", "leaves 4.00 GiB", "60.00 GiB in use", "weights 55.00 GiB",
                 "20.00 GiB free", "--context-length", "--max-total-tokens"):  # fmt: skip
        assert part in msg, (part, msg)
    # exactly one request's worth passes
    fits = kv_budget_slots(mem, 0.8, SLOT, 4 * GIB // SLOT, 55 * GIB)
    assert fits == 4 * GIB // SLOT


def test_auto_fraction_takes_090_only_where_085_cannot_hold_one_request(caplog):
    """``--mem-fraction-static`` unset: 0.85, or 0.90 (said in the log) where 0.85 leaves
    less than one request of the context; short even at 0.90, the refusal says auto."""
    mem = DeviceMemory(free=20 * GIB, total=80 * GIB)  # 60 GiB in use
    at = lambda share: int((80 * share - 60) * GIB // SLOT)  # noqa: E731
    assert kv_budget_slots(mem, None, SLOT, 4096, 55 * GIB) == at(0.85)  # 8 GiB: 0.85 holds it
    with caplog.at_level("INFO", logger="breakgraph.engine.memory"):
        slots = kv_budget_slots(mem, None, SLOT, (9 * GIB) // SLOT, 55 * GIB)  # 0.85: 8 GiB
    assert slots == at(0.90) and "--mem-fraction-static auto: 0.90" in caplog.text
    # the model's context (no --context-length): 0.90 where 0.85 cannot hold all of it
    assert kv_budget_slots(mem, None, SLOT, 1 << 20, 55 * GIB, least=8192) == at(0.90)
    # an explicit fraction stays as it is
    with pytest.raises(MemoryPlanError, match="--mem-fraction-static 0.85 of"):
        kv_budget_slots(mem, 0.85, SLOT, (9 * GIB) // SLOT, 55 * GIB)
    with pytest.raises(MemoryPlanError) as err:
        kv_budget_slots(mem, None, SLOT, (13 * GIB) // SLOT, 55 * GIB)
    assert "--mem-fraction-static auto (0.9) of 80.0 GiB leaves 12.00 GiB" in str(err.value)


def test_a_default_context_longer_than_the_pool_is_fitted_to_it():
    """Started without --context-length (a 1M-token model beside 78 GiB of weights): the
    budget need only hold one prefill chunk, and the context becomes the pool's, rounded
    down to a multiple of 1024; a budget short of a chunk still fails in one line."""
    mem = DeviceMemory(free=60 * GIB, total=140 * GIB)  # 80 GiB in use
    context = 1 << 20
    slots = kv_budget_slots(mem, 0.85, SLOT, context, 78 * GIB, least=8192)
    assert slots == int((140 * 0.85 - 80) * GIB // SLOT) and slots < context
    fitted = fit_context(context, slots)
    assert fitted == slots - slots % 1024 and fitted % 1024 == 0
    assert fit_context(40960, 10**6) == 40960 and fit_context(40960, 1000) == 1000
    with pytest.raises(MemoryPlanError, match="one 8192-token request needs"):
        kv_budget_slots(DeviceMemory(1 * GIB, 140 * GIB), 0.85, SLOT, context, 78 * GIB,
                        least=8192)  # fmt: skip


def test_the_refusal_names_the_reserve_it_kept():
    """Gemma 4 E2B on a device where the reserve leaves too little: the line names the peak
    activations, the graph pools' estimate, the table and the flags to change."""
    mem = DeviceMemory(free=120 * GIB, total=140 * GIB)
    reserve = Reserve(activations=7 * GIB, graph_pools=13 * GIB, tables=GIB // 2)
    with pytest.raises(MemoryPlanError) as err:
        kv_budget_slots(mem, 0.3, SLOT, 131072, 10 * GIB, reserve)
    msg = str(err.value)
    assert "\n" not in msg
    for part in ("peak activations 7.00 GiB", "graph pools (estimate) 13.00 GiB",
                 "request table 0.50 GiB", "weights 10.00 GiB", "120.00 GiB free",
                 "leaves 1.50 GiB", "raise --mem-fraction-static", "--max-running-requests",
                 "--cuda-graph-max-bs"):  # fmt: skip
        assert part in msg, (part, msg)


def test_explicit_tokens_and_the_cpu_default_need_no_budget():
    model = torch.nn.Linear(2, 2)
    model.kv_cache_shapes = lambda: [(8, 128)] * 28
    cpu = torch.device("cpu")
    args = EngineArgs(max_total_tokens=1000)
    assert num_kv_slots(args, model, torch.bfloat16, cpu, 40960, 0) == 1000
    assert num_kv_slots(EngineArgs(), model, torch.bfloat16, cpu, 40960, 0) == (
        CPU_DEFAULT_MAX_TOTAL_TOKENS
    )


def test_max_running_requests_default_and_its_cap():
    assert max_running_requests(None, 100) == 8
    assert max_running_requests(None, 64 * 300) == 300
    assert max_running_requests(None, 10**8) == MAX_RUNNING_DEFAULT_CAP
    assert max_running_requests(5, 10**8) == 5


class _Bounded:
    bounded_prefill = True  # Gemma 4's KV-shared tail: a tail bank, no whole prefill graphs


def test_the_planned_banks_are_the_ones_the_runner_captures():
    sizes = GraphSizes(16, [256, 512, 768], 16, 512)
    assert sizes.banks(object(), penalized=False) == {
        PREFILL: [256, 512, 768],
        PREFILL_WHOLE: [256, 512],
        DECODE: [1, 2, 4, 8, 16],
        DECODE_LONG: [1],
    }
    banks = sizes.banks(_Bounded(), penalized=True)
    assert banks[TAIL] == [1, 2, 4, 8, 16] and PREFILL_WHOLE not in banks
    assert banks[DECODE_PENALIZED] == banks[DECODE]
    assert GraphSizes(None, None, 16, 512).banks(object(), penalized=True) == {}
    # the flags' sizes: the decode graphs up to the running requests, buckets to the context
    args = EngineArgs(cuda_graph_max_bs=256, chunked_prefill_size=1024)
    got = graph_sizes(args, max_running=100, context_len=600, device=torch.device("cpu"))
    assert got == GraphSizes(100, [256, 512, 600], 100, 2048)
    no_graphs = EngineArgs(
        cuda_graph_max_bs=16, disable_cuda_graph=True, cuda_graph_backend_prefill="disabled"
    )
    assert graph_sizes(no_graphs, 8, 600, torch.device("cpu")) == GraphSizes(None, None, 8, 2048)
    assert default_cuda_graph_max_bs(141 * GIB, 1) == 256
    assert default_cuda_graph_max_bs(40 * GIB, 1) == 160
    assert default_cuda_graph_max_bs(141 * GIB, 4) == 512


def test_the_split_reports_every_part_and_the_graph_pools_by_bank():
    report = MemoryReport(
        weights_bytes=int(1.5 * GIB), kv_bytes=int(60 * GIB), kv_tokens=549_000,
        penalty_pool_bytes=GIB // 10,
        graph_pool_bytes={"prefill": GIB // 2, "decode": GIB // 4, "prefill_whole": 0},
        free_bytes=int(20.5 * GIB), total_bytes=140 * GIB,
        activation_reserve_bytes=3 * GIB, graph_pool_estimate_bytes=GIB,
        graph_pool_estimates={"prefill": GIB // 2, "prefill_whole": GIB // 4, "decode": GIB // 4},
        request_table_bytes=GIB // 4,
    )  # fmt: skip
    assert memory_log_line(report) == (
        "memory: weights 1.50 GiB, KV 60.00 GiB (549000 tokens), graph pools 0.75 GiB "
        "(estimated 1.00; per bank, measured/estimated: prefill 0.50/0.50, decode 0.25/0.25), "
        "activation reserve 3.00 GiB, "
        "request table 0.25 GiB, penalty pool 0.10 GiB, free 20.50 of 140.0 GiB"
    )


@pytest.fixture(scope="module")
def engine():
    eng = Engine(EngineArgs(device="cpu", max_total_tokens=4096, max_running_requests=16))
    yield eng
    eng.shutdown()


def _state(eng: Engine):
    pen = eng.penalties
    return (
        eng.allocator.available,
        eng.req_pool.available,
        list(pen.free),
        float(pen.counts.abs().sum()),
        eng.kv_pool.num_slots,
        [b.data_ptr() for b in eng.kv_pool.k_buffers],
        dict(eng.runner.step_counts),
        eng.scheduler.stats(),
    )


def test_the_profile_leaves_the_engine_and_its_outputs_as_they_were(engine):
    """The profile of the rank (run at startup) once more, on the embedded model: every pool,
    table row, penalty row, runner count and the random state are as before, and a seeded
    sampled output (the logits and the sampler both) is the same."""
    prompts = [engine.encode_prompt("The capital of France is", True), [5, 6, 7, 8, 9]]
    seeded = SamplingParams(max_new_tokens=4, temperature=0.8, top_p=0.9, seed=3)
    before = [r.output_ids for r in engine.generate(prompts, seeded)]
    assert engine.flush_cache()
    state = _state(engine)
    torch.manual_seed(11)
    rng = torch.get_rng_state()

    # with a speculative verify step of 4 drafts per request too
    peaks = profile_steps(
        engine.model, engine.penalties, engine.dtype, engine.device, 8192, 1024, drafts=4
    )
    # as a draft model's profile runs: no penalty pool
    profile_steps(engine.model, None, engine.dtype, engine.device, 8192, 1024)
    # nothing is measured on the CPU; the path ran at its CPU sizes
    assert peaks.activations == 0 and peaks.decode_rows == CPU_ROWS
    assert peaks.logits_row_bytes == engine.vocab_size * 4
    assert peaks.prefill_out_row_bytes == engine.model_config.hidden_size * 4  # float32
    assert torch.equal(torch.get_rng_state(), rng)
    assert _state(engine) == state
    assert [r.output_ids for r in engine.generate(prompts, seeded)] == before


def test_the_rank_reports_its_reserve_and_table(engine):
    """On the CPU the plan measures nothing (no reserve, no graph pools) and the table is the
    rank's: its running requests plus the padding row, a context's int32 slots each."""
    mem = engine.rank.memory
    assert mem.activation_reserve_bytes == 0 and mem.graph_pool_estimate_bytes == 0
    assert mem.request_table_bytes == (16 + 1) * engine.context_len * 4
    assert "activation reserve 0.00 GiB" in memory_log_line(mem)
