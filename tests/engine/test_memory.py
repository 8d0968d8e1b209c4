"""The KV pool's size from the memory budget, the one-line refusal when it cannot hold one
request of the full context, and the split the startup log reports (engine/memory.py), on a
device with given totals."""

from __future__ import annotations

import pytest
import torch

from breakgraph.common.messages import MemoryReport
from breakgraph.engine.args import EngineArgs
from breakgraph.engine.memory import (
    GIB,
    DeviceMemory,
    MemoryPlanError,
    kv_budget_slots,
    memory_log_line,
)
from breakgraph.engine.rank import CPU_DEFAULT_MAX_TOTAL_TOKENS, num_kv_slots

SLOT = 28 * 2 * 8 * 128 * 2  # Qwen3-0.6B's bf16 KV per token: 28 layers, k and v, 8 x 128


def test_slots_are_the_budget_left_beside_what_is_in_use():
    mem = DeviceMemory(free=130 * GIB, total=140 * GIB)  # 10 GiB in use: weights, context
    slots = kv_budget_slots(mem, 0.85, SLOT, 40960, weights_bytes=2 * GIB)
    assert slots == int((140 * 0.85 - 10) * GIB // SLOT)
    # a smaller fraction: fewer slots, same arithmetic
    assert kv_budget_slots(mem, 0.5, SLOT, 40960, 2 * GIB) == int((70 - 10) * GIB // SLOT)


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


def test_explicit_tokens_and_the_cpu_default_need_no_budget():
    model = torch.nn.Linear(2, 2)
    model.kv_cache_shapes = lambda: [(8, 128)] * 28
    cpu = torch.device("cpu")
    args = EngineArgs(max_total_tokens=1000)
    assert num_kv_slots(args, model, torch.bfloat16, cpu, 40960, 0) == 1000
    assert num_kv_slots(EngineArgs(), model, torch.bfloat16, cpu, 40960, 0) == (
        CPU_DEFAULT_MAX_TOTAL_TOKENS
    )


def test_the_split_reports_every_part_and_the_graph_pools_by_bank():
    report = MemoryReport(
        weights_bytes=int(1.5 * GIB), kv_bytes=int(60 * GIB), kv_tokens=549_000,
        penalty_pool_bytes=GIB // 10,
        graph_pool_bytes={"prefill": GIB // 2, "decode": GIB // 4, "prefill_whole": 0},
        free_bytes=int(20.5 * GIB), total_bytes=140 * GIB,
    )  # fmt: skip
    assert memory_log_line(report) == (
        "memory: weights 1.50 GiB, KV 60.00 GiB (549000 tokens), graph pools 0.75 GiB "
        "(prefill 0.50, decode 0.25), penalty pool 0.10 GiB, free 20.50 of 140.0 GiB"
    )
