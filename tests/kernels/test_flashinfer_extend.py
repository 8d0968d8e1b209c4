"""Extend attention on FlashInfer (kernels/flashinfer_extend.py): on the CPU, the page
indices it plans with, when it is chosen, and the host lengths the step metadata carries
for it; on a Hopper GPU where FlashInfer imports (``benchmarks/flashinfer_bundle.py``), its
output against the torch twin."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from breakgraph.common import envs
from breakgraph.forward_batch import ForwardBatch, ForwardMode
from breakgraph.kernels import extend_attention as ext
from breakgraph.kernels import flashinfer_extend as fi
from breakgraph.kernels import ops
from tests.support.kernels import paged_batch

BATCH = [(0, 7), (33, 1), (300, 65), (5, 200)]  # (cached prefix, new tokens) per request


def test_flat_slots_are_each_request_table_row_in_order():
    _, _, meta, _ = paged_batch(BATCH, 2, 16, torch.float32, "cpu")
    seqs = meta.seq_lens.tolist()
    want = torch.cat([
        meta.req_to_token[r, :n] for r, n in zip(meta.req_pool_indices.tolist(), seqs, strict=True)
    ])  # fmt: skip
    got = fi.flat_slots(meta, sum(seqs))
    assert got.dtype == torch.int32 and torch.equal(got, want)


def test_chosen_only_when_asked_and_able():
    """Never on the CPU, by default (auto) or asked for (nor inside a capture, nor for a
    bucket whose padding rows must be zeroed, nor without the host's exact lengths)."""
    _, k_cache, meta, _ = paged_batch(BATCH, 2, 128, torch.bfloat16, "cpu")
    q = torch.zeros(10, 4, 128, dtype=torch.bfloat16)
    assert not fi.usable(q, k_cache, meta, zero_pad=False)
    with envs.EXTEND_ATTENTION.override("flashinfer"):
        assert not fi.usable(q, k_cache, meta, zero_pad=False)  # a CPU tensor
    plan = ops.plan_extend_attention(q, k_cache, meta, 0.1)
    assert not isinstance(plan, fi.FlashInferPlan)


def test_a_plan_that_fails_leaves_the_process_on_triton(monkeypatch, caplog):
    """FlashInfer's plan raising (its kernel did not build) gives the step the Triton plan,
    says why in one line, and FlashInfer serves no later step."""
    import types

    monkeypatch.setattr(fi, "_failed", [])
    monkeypatch.setattr(ops, "_use_triton", lambda x: True)
    triton_plan = types.SimpleNamespace(empty=False, splits=1)
    monkeypatch.setattr(ops._extend, "ExtendPlan", lambda *a, **kw: triton_plan)
    monkeypatch.setattr(fi, "usable", lambda *a: not fi._failed)

    def no_build(*a, **kw):
        raise RuntimeError("Ninja build failed: nvcc not found\n(the build log)")

    monkeypatch.setattr(fi, "FlashInferPlan", no_build)
    _, k_cache, meta, _ = paged_batch(BATCH, 2, 128, torch.bfloat16, "cpu")
    q = torch.zeros(10, 4, 128, dtype=torch.bfloat16)
    with caplog.at_level("WARNING"):
        assert ops.plan_extend_attention(q, k_cache, meta, 0.1) is triton_plan
        assert ops.plan_extend_attention(q, k_cache, meta, 0.1) is triton_plan
    said = [r.getMessage() for r in caplog.records if "flashinfer failed" in r.getMessage()]
    assert said == [
        "flashinfer failed (RuntimeError: Ninja build failed: nvcc not found): extend "
        "attention stays on Triton"
    ]


def test_step_metadata_carries_exact_host_lengths_only():
    """An extend step's metadata holds its host lengths (FlashInfer plans with them); a
    decode step's and a chained step's (whose host lengths are bounds) do not."""
    table = torch.zeros(4, 64, dtype=torch.int32)
    step = ForwardBatch.build(ForwardMode.EXTEND, [1] * 5, [1] * 5, [0, 1], [3, 0], [2, 3], "cpu")
    meta = step.attention_meta(table)
    assert list(meta.extend_lens_cpu) == [2, 3] and list(meta.seq_lens_cpu) == [5, 3]
    decode = ForwardBatch.build(ForwardMode.DECODE, [5, 6], [8, 9], [2, 0], [34, 3], [1, 1], "cpu")
    assert decode.attention_meta(table).seq_lens_cpu is None
    step.device_base, step._attention_meta = torch.zeros(2, dtype=torch.int64), None
    assert step.attention_meta(table).extend_lens_cpu is None


def _hopper_with_flashinfer() -> bool:
    return (
        torch.cuda.is_available()
        and torch.cuda.get_device_capability()[0] == 9
        and importlib.util.find_spec("flashinfer") is not None
    )


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper_with_flashinfer(), reason="needs a Hopper GPU and flashinfer")
@pytest.mark.parametrize(("head_dim", "group", "window"), [(128, 2, None), (64, 4, None),
                                                          (256, 2, None), (128, 4, 50)])  # fmt: skip
def test_flashinfer_plan_equals_the_twin(head_dim, group, window):
    """Ragged requests with cached prefixes (bf16): every live row equals the torch twin's
    within bf16 tolerance, and the bucket's padding rows past them are left untouched (the
    attention break hands the plan bucket-sized q and o)."""
    kv_heads = 2
    k_cache, v_cache, meta, rows = paged_batch(BATCH, kv_heads, head_dim, torch.bfloat16, "cuda")
    live = sum(e for _, e in BATCH)
    meta_host = type(meta)(
        meta.req_to_token, meta.req_pool_indices, meta.seq_lens, meta.extend_start_loc,
        meta.extend_lens, meta.max_extend_len, None, [e for _, e in BATCH],
        [p + e for p, e in BATCH],
    )  # fmt: skip
    q = torch.randn(rows, kv_heads * group, head_dim, device="cuda").to(torch.bfloat16)
    ref = torch.zeros_like(q)
    ext.extend_attention_torch(q, ref, k_cache, v_cache, meta, head_dim**-0.5, window)
    with envs.EXTEND_ATTENTION.override("flashinfer"):
        plan = ops.plan_extend_attention(q, k_cache, meta_host, head_dim**-0.5, window)
    assert isinstance(plan, fi.FlashInferPlan)
    o = torch.full_like(q, 7.0)
    plan(q, o, k_cache, v_cache)
    torch.testing.assert_close(o[:live].float(), ref[:live].float(), atol=2e-2, rtol=2e-2)
    assert bool((o[live:] == 7.0).all())


def long_prompt_chunk(prefix: int, new: int) -> tuple:
    """(q, k cache, v cache, metadata with host lengths, the twin's output) of one request's
    ``new`` tokens over ``prefix`` cached ones (bf16, 2 / 1 heads of 128)."""
    k_cache, v_cache, meta, rows = paged_batch([(prefix, new)], 1, 128, torch.bfloat16, "cuda")
    meta_host = type(meta)(
        meta.req_to_token, meta.req_pool_indices, meta.seq_lens, meta.extend_start_loc,
        meta.extend_lens, meta.max_extend_len, None, [new], [prefix + new],
    )  # fmt: skip
    q = torch.randn(rows, 2, 128, device="cuda").to(torch.bfloat16)
    ref = torch.zeros_like(q)
    ext.extend_attention_torch(q, ref, k_cache, v_cache, meta, 128**-0.5, None)
    return q, k_cache, v_cache, meta_host, ref


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper_with_flashinfer(), reason="needs a Hopper GPU and flashinfer")
@pytest.mark.parametrize(("prefix", "new"), [(8192, 8192), (65536, 1024)])
def test_flashinfer_plan_over_a_long_prefix(prefix, new):
    """A chunk of a long prompt over its cached part (a 64K prompt's second chunk; the hit
    workload's step): every row equals the torch twin's."""
    q, k_cache, v_cache, meta_host, ref = long_prompt_chunk(prefix, new)
    with envs.EXTEND_ATTENTION.override("flashinfer"):
        plan = ops.plan_extend_attention(q, k_cache, meta_host, 128**-0.5, None)
    assert isinstance(plan, fi.FlashInferPlan)
    o = torch.zeros_like(q)
    plan(q, o, k_cache, v_cache)
    torch.cuda.synchronize()
    torch.testing.assert_close(o[:new].float(), ref[:new].float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper_with_flashinfer(), reason="needs a Hopper GPU and flashinfer")
def test_plans_made_ahead_of_the_gpu_keep_their_own_schedules():
    """The chunks of a long prompt planned back to back while the GPU is still busy (the
    host ahead of it, as under overlap scheduling): each step runs its own plan, none the
    next one's (a plan's host buffer is copied when the stream reaches it)."""
    chunks = [(0, 4096), (4096, 4096), (8192, 4096), (12288, 4096), (16384, 2048)]
    steps = [(*long_prompt_chunk(prefix, new), new) for prefix, new in chunks]
    torch.cuda.synchronize()
    torch.cuda._sleep(500_000_000)  # the GPU busy for a while: the plans below run ahead
    outs = []
    with envs.EXTEND_ATTENTION.override("flashinfer"):
        for q, k_cache, v_cache, meta_host, _, _ in steps:
            plan = ops.plan_extend_attention(q, k_cache, meta_host, 128**-0.5, None)
            outs.append(torch.zeros_like(q))
            plan(q, outs[-1], k_cache, v_cache)
    torch.cuda.synchronize()
    for o, (_, _, _, _, ref, new) in zip(outs, steps, strict=True):
        torch.testing.assert_close(o[:new].float(), ref[:new].float(), atol=2e-2, rtol=2e-2)
