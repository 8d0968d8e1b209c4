"""Every Triton kernel against its torch twin (GPU), plus the CPU dispatch of ``ops``."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from breakgraph.common import envs
from breakgraph.forward_batch import ForwardBatch, ForwardMode
from breakgraph.kernels import decode_attention as dec
from breakgraph.kernels import extend_attention as ext
from breakgraph.kernels import fused, kv_store, launch, ops
from breakgraph.kernels import skinny_gemm as sg
from breakgraph.kernels.attention_meta import AttentionMeta
from tests.support.kernels import paged_batch

try:  # Triton is optional (the CPU-only install)
    import triton
    import triton.language as tl
except ImportError:
    triton = None

HAS_CUDA = torch.cuda.is_available()


def gpu(fn):
    """Mark a test ``gpu`` and skip it cleanly without CUDA or Triton."""
    fn = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")(fn)
    fn = pytest.mark.skipif(kv_store.triton is None, reason="needs triton")(fn)
    return pytest.mark.gpu(fn)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-2, torch.float32: 1e-4}


# ------------------------------------------------------------------------- paged batches


EXTEND_CASES = [  # (group, head_dim, dtype)
    (1, 64, torch.bfloat16),
    (2, 128, torch.bfloat16),
    (4, 128, torch.bfloat16),
    (8, 64, torch.bfloat16),
    (1, 128, torch.float32),
    (4, 64, torch.float32),
    (8, 128, torch.float32),
]

RAGGED = [  # (prefix, extend): prefix 0, extend 1, long prefix + short extend, odd lengths
    (0, 1),
    (0, 200),
    (37, 1),
    (3000, 5),
    (130, 127),
    (64, 64),
    (0, 129),
    (513, 300),
]


@gpu
@pytest.mark.parametrize(("group", "head_dim", "dtype"), EXTEND_CASES)
def test_extend_attention_matches_twin(group, head_dim, dtype):
    num_kv_heads = 2
    heads = group * num_kv_heads
    kc, vc, meta, rows = paged_batch(RAGGED, num_kv_heads, head_dim, dtype, "cuda")
    q = torch.randn(rows, heads, head_dim, device="cuda").to(dtype)
    sentinel = 7.0  # padding rows (no request) must be left untouched
    o_ref = torch.full_like(q, sentinel)
    o = torch.full_like(q, sentinel)
    scale = head_dim**-0.5
    ext.extend_attention_torch(q, o_ref, kc, vc, meta, scale)
    # an overestimated max_extend_len only adds blocks that exit early
    over = replace(meta, max_extend_len=meta.max_extend_len + 100)
    ext.extend_attention_triton(q, o, kc, vc, over, scale)
    torch.testing.assert_close(o.float(), o_ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


@gpu
@pytest.mark.parametrize("head_dim", [96, 256])
def test_extend_attention_other_head_dims(head_dim):
    kc, vc, meta, rows = paged_batch([(0, 70), (100, 33)], 1, head_dim, torch.bfloat16, "cuda")
    q = torch.randn(rows, 2, head_dim, device="cuda").to(torch.bfloat16)
    o_ref, o = torch.zeros_like(q), torch.zeros_like(q)
    ext.extend_attention_torch(q, o_ref, kc, vc, meta, head_dim**-0.5)
    ext.extend_attention_triton(q, o, kc, vc, meta, head_dim**-0.5)
    torch.testing.assert_close(o.float(), o_ref.float(), atol=2e-2, rtol=2e-2)


SPLIT_CASES = [  # (group, head_dim, dtype): GQA 1/2/8, d 64/128/512, bf16 and fp32
    (8, 512, torch.bfloat16),  # Gemma 4's full layers (one pass on Hopper: the value split)
    (1, 64, torch.bfloat16),
    (2, 128, torch.bfloat16),
    (8, 128, torch.bfloat16),
    (8, 64, torch.bfloat16),
    (1, 128, torch.float32),
    (2, 64, torch.float32),
    (8, 128, torch.float32),
]


def _split_count(q, batch, max_extend_len, max_seq_len):
    """The split count ``extend_attention_triton`` picks for this launch."""
    block_m = ext._extend_config(q.shape[-1], q.dtype, q.device)[0]
    return ext.num_kv_splits(
        q.shape[1], batch, max_extend_len, max_seq_len, block_m, launch.sm_count(q.device)
    )


@gpu
@pytest.mark.parametrize("extend", [1, 7, 256])
@pytest.mark.parametrize(("group", "head_dim", "dtype"), SPLIT_CASES)
def test_extend_attention_split_kv_long_prefix(group, head_dim, dtype, extend):
    """A few query rows over a 20K cached prefix take the split-KV path (two launches)."""
    prefix = 20000
    kc, vc, meta, rows = paged_batch([(prefix, extend)], 1, head_dim, dtype, "cuda")
    q = torch.randn(rows, group, head_dim, device="cuda").to(dtype)
    assert _split_count(q, 1, extend, prefix + extend) > 1
    o_ref = torch.full_like(q, 7.0)
    o = torch.full_like(q, 7.0)
    ext.extend_attention_torch(q, o_ref, kc, vc, meta, head_dim**-0.5)
    bounded = replace(meta, max_seq_len=prefix + extend)
    ext.extend_attention_triton(q, o, kc, vc, bounded, head_dim**-0.5)
    torch.testing.assert_close(o.float(), o_ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


RAGGED_LONG = [  # long and short prefixes in one batch, odd lengths, an empty extend
    (20000, 7),
    (0, 50),
    (3000, 256),
    (130, 1),
    (9001, 100),
    (0, 1),
    (5000, 0),
    (64, 64),
]


@gpu
@pytest.mark.parametrize(("group", "head_dim", "dtype"), SPLIT_CASES)
def test_extend_attention_split_kv_ragged_batch(group, head_dim, dtype):
    kc, vc, meta, rows = paged_batch(RAGGED_LONG, 1, head_dim, dtype, "cuda")
    q = torch.randn(rows, group, head_dim, device="cuda").to(dtype)
    max_extend = max(e for _, e in RAGGED_LONG)
    max_seq = max(p + e for p, e in RAGGED_LONG)
    scale = head_dim**-0.5
    o_ref = torch.full_like(q, 7.0)  # padding rows (no request) must be left untouched
    ext.extend_attention_torch(q, o_ref, kc, vc, meta, scale)
    # exact bounds, and overestimated ones (extra query blocks exit early); the bigger
    # grids here (8 query heads) may fill the GPU and stay one pass
    for bounds in ((max_extend, max_seq), (max_extend + 100, max_seq + 3000)):
        o = torch.full_like(q, 7.0)
        bounded = replace(meta, max_extend_len=bounds[0], max_seq_len=bounds[1])
        ext.extend_attention_triton(q, o, kc, vc, bounded, scale)
        torch.testing.assert_close(o.float(), o_ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    # the split path itself on this batch (at its tile), whatever the heuristic picks for it
    o = torch.full_like(q, 7.0)
    cfg = ext.split_config(ext._extend_config(head_dim, dtype, q.device), head_dim, 5)
    ext.ExtendPlan(q, kc, meta, scale, config=cfg, splits=5)(q, o, kc, vc)
    torch.testing.assert_close(o.float(), o_ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    if group == 1:  # 8 requests x 2 query blocks x 1 head: too small a grid, splits
        assert _split_count(q, len(RAGGED_LONG), max_extend, max_seq) > 1


MIXED = [(0, 300), (130, 127), (3000, 1), (37, 1), (513, 1), (0, 1)]  # prefill, then one-row


@gpu
@pytest.mark.parametrize(("group", "head_dim", "dtype", "window"), [
    (4, 128, torch.bfloat16, None), (2, 256, torch.bfloat16, 200), (8, 512, torch.bfloat16, None),
    (4, 64, torch.float32, None),
])  # fmt: skip
def test_mixed_step_plan_sends_one_row_requests_to_the_decode_kernel(
    group, head_dim, dtype, window
):
    """A mixed step (prefill requests, then running requests' decode rows) through the
    engine's plan: the trailing one-row requests on the decode kernel, the rest on the extend
    kernel; padding rows untouched. The same where every request has one row (Gemma 4's
    KV-shared tail)."""
    for batch in (MIXED, MIXED[2:]):
        kc, vc, meta, rows = paged_batch(batch, 2, head_dim, dtype, "cuda", host=True)
        assert ops._decode_tail(meta) == 4
        q = torch.randn(rows, 2 * group, head_dim, device="cuda").to(dtype)
        o_ref = torch.full_like(q, 7.0)
        ext.extend_attention_torch(q, o_ref, kc, vc, meta, 0.3, sliding_window=window)
        o = torch.full_like(q, 7.0)
        ops.plan_extend_attention(q, kc, meta, 0.3, sliding_window=window)(q, o, kc, vc)
        torch.testing.assert_close(o.float(), o_ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


@gpu
def test_d512_extend_takes_the_value_split_on_the_one_pass_kernel():
    """Gemma 4's full layers (8 heads over 1, d512): on Hopper, a grid that fills the GPU
    takes the one-pass kernel with half the value columns a program, and equals the twin;
    a small grid over a long prefix takes the split kernel, with the value split unsplit
    (one launch) and at its own tile, all columns, split."""
    hopper = torch.cuda.get_device_capability()[0] == 9
    scale = 512**-0.5
    for prefix, extend, one_pass in ((0, 4096, True), (16384, 20, False)):
        kc, vc, meta, rows = paged_batch([(prefix, extend)], 1, 512, torch.bfloat16, "cuda")
        meta = replace(meta, max_seq_len=prefix + extend)
        q = torch.randn(rows, 8, 512, device="cuda").to(torch.bfloat16)
        plan = ext.ExtendPlan(q, kc, meta, scale)
        assert (plan.splits == 0) == one_pass
        halves = hopper and (one_pass or plan.splits == 1)
        assert plan.consts["BLOCK_DV"] == (256 if halves else 512)
        o, ref = torch.zeros_like(q), torch.zeros_like(q)
        plan(q, o, kc, vc)
        ext.extend_attention_torch(q, ref, kc, vc, meta, scale)
        torch.testing.assert_close(o.float(), ref.float(), atol=2e-2, rtol=2e-2)


@gpu
@pytest.mark.parametrize("num_splits", [1, 3, 64])
def test_extend_attention_split_kv_any_split_count(num_splits):
    """One split, a count that divides nothing, more splits than short sequences fill."""
    dtype, head_dim = torch.bfloat16, 128
    kc, vc, meta, rows = paged_batch(RAGGED_LONG, 2, head_dim, dtype, "cuda")
    q = torch.randn(rows, 8, head_dim, device="cuda").to(dtype)
    o_ref = torch.full_like(q, 7.0)
    o = torch.full_like(q, 7.0)
    ext.extend_attention_torch(q, o_ref, kc, vc, meta, head_dim**-0.5)
    cfg = ext._extend_config(head_dim, dtype, q.device)
    ext.ExtendPlan(q, kc, meta, head_dim**-0.5, config=cfg, splits=num_splits)(q, o, kc, vc)
    torch.testing.assert_close(o.float(), o_ref.float(), atol=2e-2, rtol=2e-2)


@gpu
@pytest.mark.parametrize("splits", [0, 3])
def test_extend_zero_pad_writes_zeros_past_the_request(splits):
    """A whole prefill graph's attention (one request, ``zero_pad``): the request's rows are
    the twin's, every later row of o (NaN before) is zero: written by the one-pass kernel's
    blocks past the request, or filled before the split kernel."""
    dtype, head_dim, rows = torch.bfloat16, 128, 512
    scale = head_dim**-0.5
    for prefix, extend in ((0, 256), (0, 1), (300, 129)):
        kc, vc, meta, _ = paged_batch([(prefix, extend)], 2, head_dim, dtype, "cuda")
        meta = replace(meta, max_extend_len=rows, max_seq_len=prefix + extend)
        q = torch.randn(rows, 8, head_dim, device="cuda").to(dtype)
        ref = torch.zeros_like(q)
        ext.extend_attention_torch(q, ref, kc, vc, meta, scale)
        cfg = ext._extend_config(head_dim, dtype, q.device)
        o = torch.full_like(q, float("nan"))
        ext.ExtendPlan(q, kc, meta, scale, config=cfg, splits=splits, zero_pad=True)(q, o, kc, vc)
        torch.testing.assert_close(o[:extend].float(), ref[:extend].float(), atol=2e-2, rtol=2e-2)
        assert bool((o[extend:] == 0).all()), (prefix, extend)


@gpu
@pytest.mark.parametrize("splits", [0, 1, 5])
def test_extend_plan_layers_launch_the_compiled_kernel_directly(splits):
    """A plan serves every layer of a step: past the first, its kernels launch through the
    compiled kernels' own launchers, with each layer's tensors; the output is the twin's,
    and bitwise what a fresh plan (the JIT dispatch) gives for the same layer."""
    dtype, head_dim = torch.bfloat16, 128
    layers = [paged_batch(RAGGED_LONG, 2, head_dim, dtype, "cuda", seed=s) for s in range(3)]
    kc, vc, meta, rows = layers[0]
    cfg = ext._extend_config(head_dim, dtype, torch.device("cuda"))
    scale = head_dim**-0.5
    q0 = torch.randn(rows, 8, head_dim, device="cuda").to(dtype)
    plan = ext.ExtendPlan(q0, kc, meta, scale, config=cfg, splits=splits)
    launches = [plan.attend] if splits == 0 else [plan.split] + ([plan.merge] if splits > 1 else [])
    compiled = None
    for kc, vc, _, _ in layers:
        q = torch.randn(rows, 8, head_dim, device="cuda").to(dtype)
        o, o_jit, o_ref = (torch.full_like(q, 7.0) for _ in range(3))
        plan(q, o, kc, vc)
        if compiled is None:
            compiled = [launch._compiled for launch in launches]
            assert all(c is not None for c in compiled)
        else:  # the same compiled kernels, launched directly
            assert [launch._compiled for launch in launches] == compiled
        ext.ExtendPlan(q, kc, meta, scale, config=cfg, splits=splits)(q, o_jit, kc, vc)
        ext.extend_attention_torch(q, o_ref, kc, vc, meta, scale)
        assert torch.equal(o, o_jit)
        torch.testing.assert_close(o.float(), o_ref.float(), atol=2e-2, rtol=2e-2)


if triton is not None:

    @triton.jit
    def _copy_kernel(out, x, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out + offs, tl.load(x + offs, mask=offs < n), mask=offs < n)


@gpu
def test_launch_redispatches_when_arguments_specialize_differently():
    """A tensor at another alignment, or another integer, goes through the JIT again (it may
    need another compiled kernel); equal ones reuse the compiled kernel."""
    from breakgraph.kernels.launch import Launch

    x = torch.randn(4096, device="cuda")
    out = torch.zeros(4096, device="cuda")
    launch = Launch(_copy_kernel, (4,), BLOCK=1024)
    launch(out, x, 4096)
    first = launch._compiled
    launch(out[1:], x[1:], 4095)  # 4-byte aligned, another int: dispatched afresh
    assert torch.equal(out[1:], x[1:])
    assert launch._spec[0][1] == 4
    launch(out, x * 2, 4096)  # back to the first specialization: the JIT's cached kernel
    assert launch._compiled is first and torch.equal(out, x * 2)
    y = x * 3
    launch(out, y, 4096)  # same specialization: launched directly
    assert launch._compiled is first and torch.equal(out, y)


@gpu
def test_extend_attention_split_kernel_unsplit_writes_o_directly():
    """1024 new over 20K (Qwen3-0.6B heads): a full wave already, so the split kernel runs
    with one split and stores into ``o`` itself (no workspace, no merge)."""
    dtype, head_dim, prefix, extend = torch.bfloat16, 128, 20000, 1024
    kc, vc, meta, rows = paged_batch([(prefix, extend)], 8, head_dim, dtype, "cuda")
    q = torch.randn(rows, 16, head_dim, device="cuda").to(dtype)
    assert _split_count(q, 1, extend, prefix + extend) == 1
    o_ref = torch.full_like(q, 7.0)
    o = torch.full_like(q, 7.0)
    ext.extend_attention_torch(q, o_ref, kc, vc, meta, head_dim**-0.5)
    bounded = replace(meta, max_seq_len=prefix + extend)
    ext.extend_attention_triton(q, o, kc, vc, bounded, head_dim**-0.5)
    torch.testing.assert_close(o.float(), o_ref.float(), atol=2e-2, rtol=2e-2)


@gpu
def test_extend_attention_full_grid_keeps_one_pass():
    """A grid that fills the GPU (8K new tokens, no prefix) keeps the one-pass kernel, as
    does any launch without the ``max_seq_len`` bound."""
    q = torch.empty(8192, 16, 128, device="cuda", dtype=torch.bfloat16)
    assert _split_count(q, 1, 8192, 8192) == 0
    assert _split_count(q, 1, 256, None) == 0


@pytest.mark.skipif(ext.triton is None, reason="needs triton")
def test_num_kv_splits_host_heuristic():
    """Host sizes only: split small grids over long keys, never big grids or short keys."""
    sms = 132
    assert ext.num_kv_splits(16, 1, 256, None, 128, sms) == 0  # no bound: one pass
    assert ext.num_kv_splits(16, 1, 8192, 8192, 128, sms) == 0  # fills the GPU
    assert ext.num_kv_splits(16, 1, 1024, 1024, 128, sms) == 0  # P=0 prefills: one pass
    assert ext.num_kv_splits(16, 1, 2048, 2048, 128, sms) == 0
    assert ext.num_kv_splits(16, 1, 256, 256 + 32768, 128, sms) > 1
    assert ext.num_kv_splits(16, 1, 1, 1 + 20000, 128, sms) > 1
    assert ext.num_kv_splits(16, 1, 1024, 1024 + 32768, 128, sms) == 1  # a full wave
    assert ext.num_kv_splits(16, 1, 256, 600, 128, sms) == 0  # keys too few to split
    assert ext.num_kv_splits(16, 1, 0, 600, 128, sms) == 0
    for batch, ext_len in ((1, 1), (1, 256), (3, 100), (1, 1100), (2, 1)):
        heads = 16
        splits = ext.num_kv_splits(heads, batch, ext_len, 50000, 128, sms)
        programs = heads * batch * -(-ext_len // 128)
        assert 1 <= splits <= ext._SPLIT_MAX and programs * splits <= 8 * sms


DECODE_SEQ_LENS = [1, 2, 63, 64, 65, 777, 4097, 10000]


def test_decode_split_count_host_heuristic(monkeypatch):
    """About 16 programs per SM at every batch, between 2 and 64 splits (host sizes only)."""
    pytest.importorskip("triton")
    monkeypatch.setattr(launch, "_multiprocessors", lambda index: 132)  # an H200's
    cuda = torch.device("cuda", 0)  # only its index is read
    split = {bs: dec.default_num_kv_splits(bs, 8, cuda) for bs in (1, 16, 32, 64, 512)}
    assert split == {1: 64, 16: 32, 32: 16, 64: 8, 512: 2}


@gpu
@pytest.mark.parametrize(("group", "head_dim", "dtype"), EXTEND_CASES)
def test_decode_attention_matches_twin(group, head_dim, dtype):
    num_kv_heads = 2
    heads = group * num_kv_heads
    kc, vc, meta, _ = paged_batch(
        [(s - 1, 1) for s in DECODE_SEQ_LENS], num_kv_heads, head_dim, dtype, "cuda"
    )
    q = torch.randn(len(DECODE_SEQ_LENS), heads, head_dim, device="cuda").to(dtype)
    o_ref, o = torch.zeros_like(q), torch.zeros_like(q)
    dec.decode_attention_torch(q, o_ref, kc, vc, meta, head_dim**-0.5)
    dec.decode_attention_triton(q, o, kc, vc, meta, head_dim**-0.5)
    torch.testing.assert_close(o.float(), o_ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


@gpu
@pytest.mark.parametrize("num_kv_splits", [1, 3, 64])
def test_decode_attention_any_split_count(num_kv_splits):
    """One split, a count that divides nothing, and more splits than short sequences fill."""
    kc, vc, meta, _ = paged_batch(
        [(s - 1, 1) for s in DECODE_SEQ_LENS], 2, 128, torch.bfloat16, "cuda"
    )
    q = torch.randn(len(DECODE_SEQ_LENS), 4, 128, device="cuda").to(torch.bfloat16)
    o_ref, o = torch.zeros_like(q), torch.zeros_like(q)
    ws = dec.DecodeWorkspace()
    dec.decode_attention_torch(q, o_ref, kc, vc, meta, 128**-0.5)
    dec.decode_attention_triton(
        q, o, kc, vc, meta, 128**-0.5, num_kv_splits=num_kv_splits, workspace=ws
    )
    torch.testing.assert_close(o.float(), o_ref.float(), atol=2e-2, rtol=2e-2)


@gpu
@pytest.mark.parametrize("sliding_window", [None, 100])
@pytest.mark.parametrize("num_kv_splits", [1, 3, 64])
def test_decode_attention_under_pdl_equals_plain_launches(num_kv_splits, sliding_window):
    """Under PDL each split reads its length and request index before the wait: bitwise
    the plain launch's output, one or many key blocks per split, with a sliding window."""
    from breakgraph.kernels import pdl

    if not pdl._capable(torch.cuda.current_device()):
        pytest.skip("PDL needs compute capability 9+")
    kc, vc, meta, _ = paged_batch(
        [(s - 1, 1) for s in DECODE_SEQ_LENS], 2, 128, torch.bfloat16, "cuda"
    )
    q = torch.randn(len(DECODE_SEQ_LENS), 4, 128, device="cuda").to(torch.bfloat16)
    outs = []
    for mode in ("0", "1"):
        o = torch.zeros_like(q)
        with envs.PDL.override(mode):
            dec.decode_attention_triton(
                q, o, kc, vc, meta, 128**-0.5, num_kv_splits=num_kv_splits,
                sliding_window=sliding_window,
            )  # fmt: skip
        outs.append(o)
    assert torch.equal(outs[0], outs[1])
    o_ref = torch.zeros_like(q)
    dec.decode_attention_torch(q, o_ref, kc, vc, meta, 128**-0.5, sliding_window=sliding_window)
    torch.testing.assert_close(outs[1].float(), o_ref.float(), atol=2e-2, rtol=2e-2)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("group", "sliding_window", "num_kv_splits"), [
    (4, None, None), (2, None, 64), (8, 100, None), (16, None, 3), (4, 300, 64),
])  # fmt: skip
def test_decode_attention_over_verify_rows(dtype, group, sliding_window, num_kv_splits):
    """A verify step's decode rows (1 + k rows of a request at consecutive positions, one
    kernel program per run of rows): every row equals the twin's, which attends row by row;
    runs of 1 to 9 rows over short and 10K contexts, and padding rows after them."""
    runs = [(8000, 4), (1, 1), (63, 9), (10000, 2), (300, 4), (5, 3)]
    kc, vc, meta, _ = paged_batch(runs, 2, 128, dtype, "cuda")
    k = torch.tensor([n for _, n in runs], device="cuda")
    reqs = meta.req_pool_indices.repeat_interleave(k)
    ends = (meta.seq_lens.repeat_interleave(k) - k.repeat_interleave(k)).int()
    offs = torch.cat([torch.arange(n, device="cuda") for n in k.tolist()]).int()
    pad = torch.zeros(3, dtype=torch.int64, device="cuda")
    seq_lens = torch.cat([ends + offs + 1, torch.ones(3, dtype=torch.int32, device="cuda")])
    rows = AttentionMeta.decode(meta.req_to_token, torch.cat([reqs, pad]), seq_lens)
    q = torch.randn(len(seq_lens), 2 * group, 128, device="cuda").to(dtype)
    o_ref, o = torch.zeros_like(q), torch.zeros_like(q)
    dec.decode_attention_torch(q, o_ref, kc, vc, rows, 128**-0.5, sliding_window=sliding_window)
    dec.decode_attention_triton(
        q, o, kc, vc, rows, 128**-0.5, num_kv_splits=num_kv_splits,
        workspace=dec.DecodeWorkspace(), sliding_window=sliding_window,
    )  # fmt: skip
    torch.testing.assert_close(o.float(), o_ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


@gpu
def test_decode_attention_replays_in_a_cuda_graph_with_new_lengths():
    """Captured once; a replay reads the live seq_lens and req_to_token, not capture's."""
    dtype, head_dim = torch.bfloat16, 128
    kc, vc, meta, _ = paged_batch(
        [(s - 1, 1) for s in (5000, 5000, 5000, 5000)], 2, head_dim, dtype, "cuda"
    )
    q = torch.randn(4, 8, head_dim, device="cuda").to(dtype)
    o = torch.zeros_like(q)
    workspace = dec.DecodeWorkspace()
    args = (kc, vc, meta, head_dim**-0.5)
    dec.decode_attention_triton(q, o, *args, workspace=workspace)  # compile and grow outside
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dec.decode_attention_triton(q, o, *args, workspace=workspace)
    for lens in ([1, 4999, 300, 64], [5000, 2, 1025, 4096]):
        meta.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(torch.randn_like(q, dtype=torch.float32))
        graph.replay()
        o_ref = torch.zeros_like(q)
        dec.decode_attention_torch(q, o_ref, *args)
        torch.testing.assert_close(o.float(), o_ref.float(), atol=2e-2, rtol=2e-2)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 7, 16, 64])
def test_skinny_gemm_matches_linear(m, dtype):
    """Decode's few rows (a strided x, as a slice of a wider tensor), one split and several,
    with and without bias, against F.linear; the split counters back at zero."""
    n, k = 1000, 1536  # ragged N tiles, K not a multiple of every split's chunk
    x = torch.randn(m, k + 64, device="cuda").to(dtype)[:, :k]
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(dtype)
    b = torch.randn(n, device="cuda").to(dtype)
    ws = sg.SkinnyWorkspace()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for cfg in (
        sg.SkinnyConfig(64, 128, 1),
        sg.SkinnyConfig(32, 64, 4),
        sg.SkinnyConfig(16, 256, 8),
    ):
        for bias in (None, b):
            out = sg.skinny_gemm_triton(x, w, bias, cfg, ws)
            ref = torch.nn.functional.linear(
                x.float(), w.float(), None if bias is None else b.float()
            )
            torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    assert not any(b.any() for b in ws.buffers() if b.dtype == torch.int32)  # counters


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_gemv_matches_linear(m, dtype):
    """The GEMV kernel (``SkinnyConfig(gemv=True)``) for decode's rows: a strided x, ragged N
    tiles, K in one chunk and in several, with and without bias; gate/up with SiLU; and in a
    CUDA graph (PDL on, as small decode graphs launch it)."""
    from breakgraph.kernels import pdl

    n, k = 1000, 1536
    x = torch.randn(m, k + 64, device="cuda").to(dtype)[:, :k]
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(dtype)
    b = torch.randn(n, device="cuda").to(dtype)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for cfg in (sg.SkinnyConfig(8, 2048, 1, gemv=True), sg.SkinnyConfig(16, 512, 1, gemv=True)):
        for bias in (None, b):
            out = sg.skinny_gemm_triton(x, w, bias, cfg)
            ref = torch.nn.functional.linear(
                x.float(), w.float(), None if bias is None else b.float()
            )
            torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    gate_up = (torch.randn(2 * 700, k, device="cuda") / k**0.5).to(dtype)
    cfg = sg.SkinnyConfig(8, 512, 1, gemv=True)
    ref = sg.skinny_act_and_mul_torch(x.float(), gate_up.float(), "silu")
    out = sg.skinny_gemm_triton(x, gate_up, None, cfg, activation="silu")
    torch.testing.assert_close(out.float(), ref, atol=3 * tol, rtol=3 * tol)
    with pdl.scope(1):
        sg.skinny_gemm_triton(x, w, b, cfg)  # compiled outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = sg.skinny_gemm_triton(x, w, b, cfg)
    x.copy_(torch.randn_like(x))
    graph.replay()
    ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
    torch.testing.assert_close(y.float(), ref, atol=tol, rtol=tol)


@gpu
def test_every_skinny_table_entry_matches_linear():
    """What ships: each (shape, M class) of ``SKINNY_TABLE`` through ``ops.linear`` (the
    dispatch the models use) at the class's largest M and its smallest, bf16, against
    F.linear in float32."""
    from breakgraph.kernels import ops

    for (n, k), entries in sg.SKINNY_TABLE.items():
        w = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
        lo = 1
        for max_m, cfg in entries:
            for m in {lo, max_m}:
                assert sg.table_config(m, n, k) == cfg
                x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
                ref = torch.nn.functional.linear(x.float(), w.float())
                torch.testing.assert_close(ops.linear(x, w).float(), ref, atol=2e-2, rtol=2e-2)
            lo = max_m + 1


@gpu
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("m", [1, 16, 64])
def test_skinny_gate_up_with_its_activation_matches_the_two_ops(m, activation):
    """gate/up and SiLU (or GELU) in one launch against F.linear then the activation kernel's
    twin (bf16: within one rounding of the activation's input), one split and several."""
    inter, k = 1400, 1024  # ragged N tiles
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    gate_up = (torch.randn(2 * inter, k, device="cuda") / k**0.5).to(torch.bfloat16)
    ref = sg.skinny_act_and_mul_torch(x.float(), gate_up.float(), activation)
    for cfg in (sg.SkinnyConfig(32, 128, 1), sg.SkinnyConfig(16, 128, 4)):
        out = sg.skinny_gemm_triton(x, gate_up, None, cfg, sg.SkinnyWorkspace(), activation)
        assert out.shape == (m, inter)
        torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)
    # dispatch: the table's entry for gate_up's shape sends ops there too
    cfg = sg.SkinnyConfig(16, 128, 4)
    sg.SKINNY_TABLE[(2 * inter, k)] = [(64, cfg)]
    try:
        got = ops.linear_act_and_mul(x, gate_up, activation)
    finally:
        del sg.SKINNY_TABLE[(2 * inter, k)]
    want = sg.skinny_gemm_triton(x, gate_up, None, cfg, None, activation)
    assert torch.equal(got, want)


@gpu
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("m", [1, 16, 64])
def test_skinny_gemm_with_the_norm_in_front_matches_norm_then_linear(m, with_residual):
    """The residual add and Llama's RMSNorm as the GEMM's prologue (bf16) against the norm
    kernel's twin then F.linear; the new residual bit-equal to torch's add."""
    k, n = 1024, 1000
    x, res = (torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    norm_w = (1 + 0.1 * torch.randn(k, device="cuda")).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
    residual = res if with_residual else None
    ref, ref_res = sg.skinny_norm_gemm_torch(x, residual, norm_w, 1e-6, w)
    for cfg in (sg.SkinnyConfig(32, 128, 1), sg.SkinnyConfig(16, 128, 4)):
        out, new_res = sg.skinny_norm_gemm_triton(x, residual, norm_w, 1e-6, w, cfg)
        torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)
        assert (new_res is None) if residual is None else torch.equal(new_res, ref_res)


@gpu
def test_skinny_gemm_replays_in_a_cuda_graph():
    """Captured with split K; replays read the new x and leave the counters at zero."""
    x = torch.randn(4, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16) / 2048**0.5
    ws, cfg = sg.SkinnyWorkspace(), sg.SkinnyConfig(32, 128, 4)
    sg.skinny_gemm_triton(x, w, None, cfg, ws)  # compile and grow outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sg.skinny_gemm_triton(x, w, None, cfg, ws)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        ref = torch.nn.functional.linear(x.float(), w.float())
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    assert not any(b.any() for b in ws.buffers() if b.dtype == torch.int32)  # counters


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_store_kv_matches_twin(dtype):
    t, kv_heads, head_dim = 300, 4, 128
    # k and v are strided views of a fused qkv output, as the model produces them
    qkv = torch.randn(t, (8 + 2 * kv_heads) * head_dim, device="cuda").to(dtype)
    k = qkv[:, 8 * head_dim : (8 + kv_heads) * head_dim].view(t, kv_heads, head_dim)
    v = qkv[:, (8 + kv_heads) * head_dim :].view(t, kv_heads, head_dim)
    slots = torch.randperm(1000, device="cuda")[:t] + 1
    slots[-20:] = 0  # padding rows all write the reserved slot 0
    for cache_dtype in (dtype, torch.bfloat16):  # the second one casts on store for fp32
        ref = [
            torch.zeros(1100, kv_heads, head_dim, device="cuda", dtype=cache_dtype) for _ in "kv"
        ]
        out = [c.clone() for c in ref]
        kv_store.store_kv_torch(*ref, slots, k, v)
        kv_store.store_kv_triton(*out, slots, k, v)
        assert torch.equal(out[0][1:], ref[0][1:]) and torch.equal(out[1][1:], ref[1][1:])


# ------------------------------------------------------------------------------- fused


def assert_exactish(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Within one rounding step of the dtype; 16-bit outputs bit-identical almost everywhere
    (the kernels round where the twins do; only fp32 reduction order and exp/rsqrt differ)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    eps = torch.finfo(ref.dtype).eps
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=2 * eps)
    if ref.element_size() == 2:
        assert (out == ref).float().mean().item() > 0.99


FUSED_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@gpu
@pytest.mark.parametrize("dtype", FUSED_DTYPES)
@pytest.mark.parametrize("hidden", [1024, 896])
def test_rms_norms_match_twins(dtype, hidden):
    x = torch.randn(37, hidden, device="cuda").to(dtype)
    residual = torch.randn_like(x)
    weight = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(dtype)
    assert_exactish(fused.rms_norm_triton(x, weight, 1e-6), fused.rms_norm_torch(x, weight, 1e-6))
    before = residual.clone()
    normed, new_res = fused.fused_add_rms_norm_triton(x, residual, weight, 1e-6)
    normed_ref, new_res_ref = fused.fused_add_rms_norm_torch(x, before, weight, 1e-6)
    assert torch.equal(new_res, new_res_ref) and torch.equal(residual, before)
    assert_exactish(normed, normed_ref)


@gpu
@pytest.mark.parametrize("dtype", FUSED_DTYPES)
@pytest.mark.parametrize("inter", [3072, 1000])
def test_silu_and_mul_matches_twin(dtype, inter):
    gate_up = (2 * torch.randn(41, 2 * inter, device="cuda")).to(dtype)
    assert_exactish(fused.silu_and_mul_triton(gate_up), fused.silu_and_mul_torch(gate_up))


def rotary_cos_sin(tokens: int, head_dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin [T, D] as HF's rotary embedding builds them (cat(freqs, freqs))."""
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    pos = torch.randint(0, 30000, (tokens,), device=device).float()
    emb = torch.outer(pos, inv_freq).repeat(1, 2)
    return emb.cos(), emb.sin()


@gpu
@pytest.mark.parametrize("dtype", FUSED_DTYPES)
@pytest.mark.parametrize("head_dim", [128, 64])
def test_rope_and_qk_norm_rope_match_twins(dtype, head_dim):
    qkv = torch.randn(53, (16 + 16) * head_dim, device="cuda").to(dtype)
    q = qkv[:, : 16 * head_dim].view(53, 16, head_dim)  # strided views, as the model's
    k = qkv[:, 16 * head_dim : 24 * head_dim].view(53, 8, head_dim)
    cos, sin = rotary_cos_sin(53, head_dim, "cuda")
    for out, ref in zip(
        fused.rope_triton(q, k, cos, sin), fused.rope_torch(q, k, cos, sin), strict=True
    ):
        assert_exactish(out, ref)
    qw = (1 + 0.1 * torch.randn(head_dim, device="cuda")).to(dtype)
    kw = (1 + 0.1 * torch.randn(head_dim, device="cuda")).to(dtype)
    outs = fused.qk_norm_rope_triton(q, k, qw, kw, 1e-6, cos, sin)
    refs = fused.qk_norm_rope_torch(q, k, qw, kw, 1e-6, cos, sin)
    for out, ref in zip(outs, refs, strict=True):
        assert_exactish(out, ref)


@gpu
@pytest.mark.parametrize("dtype", FUSED_DTYPES)
def test_gelu_tanh_and_mul_matches_twin(dtype):
    gate_up = (2 * torch.randn(41, 2 * 1000, device="cuda")).to(dtype)
    # the kernel's tanh (via exp) differs from torch's in the last fp32 bits
    out, ref = fused.gelu_tanh_and_mul_triton(gate_up), fused.gelu_tanh_and_mul_torch(gate_up)
    assert_close_norm(out, ref)
    gate, up = gate_up[:, :700], gate_up[:, 1000:1700]  # two strided [T, I] views
    assert_close_norm(fused.gelu_tanh_mul_triton(gate, up), fused.gelu_tanh_mul_torch(gate, up))


@gpu
@pytest.mark.parametrize("dtype", FUSED_DTYPES)
def test_gemma_rms_norm_matches_twin(dtype):
    """With and without weight, with the residual add, on 2D rows and on strided head views
    of a fused qkv output (as Gemma 4's v norm sees them)."""
    eps = 1e-6
    x = torch.randn(37, 1536, device="cuda").to(dtype)
    res = torch.randn_like(x)
    w = (1 + 0.1 * torch.randn(1536, device="cuda")).to(dtype)

    def check(t, weight, residual=None):
        out = fused.gemma_rms_norm_triton(t, weight, eps, residual)
        assert_close_norm(out, fused.gemma_rms_norm_torch(t, weight, eps, residual))

    check(x, w)
    check(x, None)
    check(x, w, res)
    scale = torch.tensor([0.37], device="cuda").to(dtype)  # a layer_scalar
    out = fused.gemma_rms_norm_triton(x, w, eps, res, scale)
    assert_close_norm(out, fused.gemma_rms_norm_torch(x, w, eps, res, scale))
    qkv = torch.randn(9, (8 + 2) * 256, device="cuda").to(dtype)
    check(qkv[:, 9 * 256 :].view(9, 1, 256), None)  # v: a strided head view, no weight
    check(qkv[:, : 8 * 256].view(9, 8, 256), (1 + 0.1 * torch.randn(256, device="cuda")).to(dtype))


def assert_close_norm(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Within one rounding step: the kernel's 1/sqrt and torch's pow(-0.5) may differ in the
    last fp32 bit, so a 16-bit result may round the other way now and then."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    eps = torch.finfo(ref.dtype).eps
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=2 * eps)


@gpu
@pytest.mark.parametrize("dtype", FUSED_DTYPES)
@pytest.mark.parametrize("head_dim", [256, 512])
def test_gemma_qk_norm_rope_matches_twin(dtype, head_dim):
    qkv = torch.randn(21, (8 + 2) * head_dim, device="cuda").to(dtype)
    q = qkv[:, : 8 * head_dim].view(21, 8, head_dim)  # strided views, as the model's
    k = qkv[:, 8 * head_dim : 9 * head_dim].view(21, 1, head_dim)
    cos, sin = (t.to(dtype) for t in rotary_cos_sin(21, head_dim, "cuda"))
    qw = (1 + 0.1 * torch.randn(head_dim, device="cuda")).to(dtype)
    kw = (1 + 0.1 * torch.randn(head_dim, device="cuda")).to(dtype)
    outs = fused.gemma_qk_norm_rope_triton(q, k, qw, kw, 1e-6, cos, sin)
    refs = fused.gemma_qk_norm_rope_torch(q, k, qw, kw, 1e-6, cos, sin)
    for out, ref in zip(outs, refs, strict=True):
        # a last-bit difference of the fp32 variance (tl.sum vs torch's mean) may flip one
        # rounding of a normed value; RoPE's difference of products then carries one ulp of
        # the larger (O(1)) operand into a smaller result: one dtype eps absolute (and fp32's
        # rsqrt is approximate in Triton, a few ulp from torch's)
        assert out.dtype == ref.dtype and out.shape == ref.shape
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(out, ref, atol=max(eps, 1e-5), rtol=2 * eps)
    q_only, none = fused.gemma_qk_norm_rope_triton(q, None, qw, None, 1e-6, cos, sin)
    assert none is None
    assert torch.equal(q_only, outs[0])


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["rope", "qk_norm", "gemma"])
def test_rope_with_kv_store_equals_rope_then_store(dtype, kind):
    """The fused store (k rotated straight into its slot, v copied beside it) writes what the
    unfused kernels write; a cache of another dtype falls back to rope, then store."""
    t, heads, kv_heads, head_dim = 45, 8, 2, 128
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, device="cuda").to(dtype)
    q = qkv[:, : heads * head_dim].view(t, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(t, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(t, kv_heads, head_dim)
    cos, sin = rotary_cos_sin(t, head_dim, "cuda")
    if kind == "gemma":
        cos, sin = cos.to(dtype), sin.to(dtype)
    qw = (1 + 0.1 * torch.randn(head_dim, device="cuda")).to(dtype)
    kw = (1 + 0.1 * torch.randn(head_dim, device="cuda")).to(dtype)
    fn, norm = {
        "rope": (fused.rope_triton, ()),
        "qk_norm": (fused.qk_norm_rope_triton, (qw, kw, 1e-6)),
        "gemma": (fused.gemma_qk_norm_rope_triton, (qw, kw, 1e-6)),
    }[kind]
    slots = torch.randperm(500, device="cuda")[:t] + 1
    slots[-5:] = 0  # padding rows
    q_ref, k_ref = fn(q, k, *norm, cos, sin)
    for cache_dtype in (dtype, torch.float16):
        caches = [
            torch.zeros(600, kv_heads, head_dim, device="cuda", dtype=cache_dtype) for _ in "kvkv"
        ]
        q_out, none = fn(q, k, *norm, cos, sin, ops.KVWrite(v, caches[0], caches[1], slots))
        assert none is None and torch.equal(q_out, q_ref)
        kv_store.store_kv_triton(caches[2], caches[3], slots, k_ref, v)
        assert torch.equal(caches[0][1:], caches[2][1:]) and torch.equal(
            caches[1][1:], caches[3][1:]
        )


@gpu
def test_ops_dispatches_to_triton_on_cuda():
    """The CUDA path of ``ops`` is the Triton kernel (same result as calling it directly)."""
    x = torch.randn(9, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, device="cuda", dtype=torch.bfloat16)
    assert ops.triton_available()
    assert torch.equal(ops.rms_norm(x, w, 1e-6), fused.rms_norm_triton(x, w, 1e-6))


# --------------------------------------------------------------------------- CPU: ops


def test_ops_on_cpu_equal_the_twins():
    torch.manual_seed(0)
    x, res = torch.randn(5, 64), torch.randn(5, 64)
    w = torch.randn(64)
    assert torch.equal(ops.rms_norm(x, w, 1e-6), fused.rms_norm_torch(x, w, 1e-6))
    for a, b in zip(
        ops.fused_add_rms_norm(x, res, w, 1e-6),
        fused.fused_add_rms_norm_torch(x, res, w, 1e-6),
        strict=True,
    ):
        assert torch.equal(a, b)
    gu = torch.randn(5, 128)
    assert torch.equal(ops.silu_and_mul(gu), fused.silu_and_mul_torch(gu))
    q, k = torch.randn(5, 4, 32), torch.randn(5, 2, 32)
    cos, sin = rotary_cos_sin(5, 32, "cpu")
    for a, b in zip(ops.rope(q, k, cos, sin), fused.rope_torch(q, k, cos, sin), strict=True):
        assert torch.equal(a, b)
    qw, kw = torch.randn(32), torch.randn(32)
    outs = ops.qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin)
    refs = fused.qk_norm_rope_torch(q, k, qw, kw, 1e-6, cos, sin)
    for a, b in zip(outs, refs, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(ops.gelu_tanh_and_mul(gu), fused.gelu_tanh_and_mul_torch(gu))
    assert torch.equal(
        ops.gemma_rms_norm(x, None, 1e-6, res), fused.gemma_rms_norm_torch(x, None, 1e-6, res)
    )
    outs = ops.gemma_qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin)
    refs = fused.gemma_qk_norm_rope_torch(q, k, qw, kw, 1e-6, cos, sin)
    for a, b in zip(outs, refs, strict=True):
        assert torch.equal(a, b)
    # with a KV store: q returned, k/v in their slots (slot 0: padding)
    caches = [torch.zeros(8, 2, 32) for _ in "kv"]
    slots, v2 = torch.tensor([3, 0, 5, 1, 7]), k * 2
    q_out, none = ops.qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin, ops.KVWrite(v2, *caches, slots))
    q_ref, k_ref = fused.qk_norm_rope_torch(q, k, qw, kw, 1e-6, cos, sin)
    assert none is None and torch.equal(q_out, q_ref)
    assert torch.equal(caches[0][slots[slots > 0]], k_ref[slots > 0])
    assert torch.equal(caches[1][slots[slots > 0]], v2[slots > 0])

    kc, vc, meta, rows = paged_batch([(3, 4), (0, 2)], 2, 32, torch.float32, "cpu")
    q = torch.randn(rows, 4, 32)
    o, o_ref = torch.zeros_like(q), torch.zeros_like(q)
    ops.extend_attention(q, o, kc, vc, meta, 0.2)
    ext.extend_attention_torch(q, o_ref, kc, vc, meta, 0.2)
    assert torch.equal(o, o_ref)
    qd = torch.randn(2, 4, 32)
    od, od_ref = torch.zeros_like(qd), torch.zeros_like(qd)
    ops.decode_attention(qd, od, kc, vc, meta, 0.2)  # decode reads the key side only
    dec.decode_attention_torch(qd, od_ref, kc, vc, meta, 0.2)
    assert torch.equal(od, od_ref)
    kc2, vc2 = kc.clone(), vc.clone()
    slots = torch.tensor([4, 0, 9])
    ops.store_kv(kc, vc, slots, q[:3, :2], q[:3, 2:])
    kv_store.store_kv_torch(kc2, vc2, slots, q[:3, :2], q[:3, 2:])
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


def test_ops_extend_attention_passes_max_seq_len_on_cpu():
    """The twin ignores the split hint: same result with and without it."""
    kc, vc, meta, rows = paged_batch([(30, 4), (0, 2)], 2, 32, torch.float32, "cpu")
    q = torch.randn(rows, 4, 32)
    o, o_ref = torch.zeros_like(q), torch.zeros_like(q)
    ops.extend_attention(q, o, kc, vc, replace(meta, max_seq_len=34), 0.2)
    ext.extend_attention_torch(q, o_ref, kc, vc, meta, 0.2)
    assert torch.equal(o, o_ref)


def test_forward_batch_builds_its_attention_meta_once():
    """Every layer of a step reads one meta: the batch's own tensors and host-known bounds
    (no device work); decode carries no key bound (a capture batch's host lengths are fake)."""
    table = torch.zeros(4, 64, dtype=torch.int32)
    batch = ForwardBatch.build(
        ForwardMode.EXTEND, list(range(7)), list(range(1, 8)), [2, 0], [30, 0], [4, 3], "cpu"
    )
    meta = batch.attention_meta(table)
    assert batch.attention_meta(table) is meta
    assert (meta.max_extend_len, meta.max_seq_len) == (4, 34)
    assert meta.seq_lens is batch.seq_lens and meta.extend_start_loc is batch.extend_start_loc
    decode = ForwardBatch.build(ForwardMode.DECODE, [5, 6], [8, 9], [2, 0], [34, 3], [1, 1], "cpu")
    decode_meta = decode.attention_meta(table)
    assert (decode_meta.max_extend_len, decode_meta.max_seq_len) == (1, None)


def test_extend_twin_is_causal_softmax_attention():
    """The twin itself: one request without prefix equals causal SDPA with repeated kv heads."""
    kc, vc, meta, rows = paged_batch([(0, 9)], 2, 16, torch.float32, "cpu", pad_rows=0)
    q = torch.randn(rows, 4, 16)
    o = torch.zeros_like(q)
    ext.extend_attention_torch(q, o, kc, vc, meta, 0.25)
    slots = meta.req_to_token[meta.req_pool_indices[0], :9].long()
    k = kc[slots].repeat_interleave(2, dim=1).transpose(0, 1)
    v = vc[slots].repeat_interleave(2, dim=1).transpose(0, 1)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k, v, is_causal=True, scale=0.25
    ).transpose(0, 1)
    torch.testing.assert_close(o, ref, atol=1e-5, rtol=1e-5)


def test_ops_imports_and_runs_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` fail
        "import torch\n"
        "from breakgraph.kernels import ops\n"
        "assert not ops.triton_available()\n"
        "x = torch.randn(3, 8); w = torch.ones(8)\n"
        "assert ops.rms_norm(x, w, 1e-6).shape == (3, 8)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_twins_follow_hf_arithmetic():
    """Bit-identical to HF's LlamaRMSNorm, LlamaMLP activation and apply_rotary_pos_emb."""
    pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    torch.manual_seed(0)
    dtype = torch.bfloat16
    norm = LlamaRMSNorm(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(64))
    x, res = torch.randn(7, 64).to(dtype), torch.randn(7, 64).to(dtype)
    assert torch.equal(fused.rms_norm_torch(x, norm.weight, 1e-6), norm(x))
    normed, new_res = fused.fused_add_rms_norm_torch(x, res, norm.weight, 1e-6)
    assert torch.equal(new_res, res + x) and torch.equal(normed, norm(res + x))

    gate, up = torch.randn(7, 48).to(dtype), torch.randn(7, 48).to(dtype)
    ref = torch.nn.functional.silu(gate) * up
    assert torch.equal(fused.silu_and_mul_torch(torch.cat([gate, up], -1)), ref)

    q, k = torch.randn(7, 4, 32).to(dtype), torch.randn(7, 2, 32).to(dtype)
    cos, sin = rotary_cos_sin(7, 32, "cpu")
    # HF: q [B, H, T, D], cos/sin [B, T, D] already in the activation dtype
    hq, hk = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos.to(dtype)[None], sin.to(dtype)[None]
    )
    oq, ok = fused.rope_torch(q, k, cos, sin)
    assert torch.equal(oq, hq[0].transpose(0, 1)) and torch.equal(ok, hk[0].transpose(0, 1))
    qn, kn = LlamaRMSNorm(32, 1e-6).to(dtype), LlamaRMSNorm(32, 1e-6).to(dtype)
    hq, hk = apply_rotary_pos_emb(
        qn(q).transpose(0, 1)[None],
        kn(k).transpose(0, 1)[None],
        cos.to(dtype)[None],
        sin.to(dtype)[None],
    )
    oq, ok = fused.qk_norm_rope_torch(q, k, qn.weight, kn.weight, 1e-6, cos, sin)
    assert torch.equal(oq, hq[0].transpose(0, 1)) and torch.equal(ok, hk[0].transpose(0, 1))


# ------------------------------------------------------------------- CPU: sliding window


def _dense_reference(q, kc, vc, meta, scale, allowed):
    """Per request: softmax attention over its keys where ``allowed(q_pos, k_pos)``."""
    group = q.shape[1] // kc.shape[1]
    out = torch.zeros_like(q)
    fields = (meta.req_pool_indices, meta.seq_lens, meta.extend_start_loc, meta.extend_lens)
    for req, s, st, e in zip(*(t.tolist() for t in fields), strict=True):
        slots = meta.req_to_token[req, :s].long()
        k = kc[slots].repeat_interleave(group, dim=1).transpose(0, 1)
        v = vc[slots].repeat_interleave(group, dim=1).transpose(0, 1)
        mask = torch.tensor([[allowed(s - e + i, j) for j in range(s)] for i in range(e)])
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[st : st + e].transpose(0, 1), k, v, attn_mask=mask, scale=scale
        )
        out[st : st + e] = ref.transpose(0, 1)
    return out


@pytest.mark.parametrize("window", [1, 3, 8])
def test_sliding_window_twins_follow_hf_sliding_mask(window):
    """Extend and decode twins with a window equal attention under HF's own sliding mask
    (``sliding_window_causal_mask_function``: a row at p sees keys p - W + 1 .. p)."""
    masking = pytest.importorskip("transformers.masking_utils")
    hf_allowed = masking.sliding_window_causal_mask_function(window)

    def allowed(q_pos, k_pos):
        return bool(hf_allowed(*(torch.tensor(i) for i in (0, 0, q_pos, k_pos))))

    kc, vc, meta, rows = paged_batch(
        [(0, 9), (13, 4), (3, 1), (20, 1)], 2, 16, torch.float32, "cpu"
    )
    q = torch.randn(rows, 4, 16)
    o = torch.zeros_like(q)
    ext.extend_attention_torch(q, o, kc, vc, meta, 0.3, sliding_window=window)
    ref = _dense_reference(q, kc, vc, meta, 0.3, allowed)
    torch.testing.assert_close(o, ref, atol=1e-5, rtol=1e-5)
    # via ops, and decode (one row per request: the last) over the same caches
    o_ops = torch.zeros_like(q)
    ops.extend_attention(q, o_ops, kc, vc, meta, 0.3, sliding_window=window)
    assert torch.equal(o_ops, o)
    qd = torch.randn(4, 4, 16)
    od = torch.zeros_like(qd)
    ops.decode_attention(qd, od, kc, vc, meta, 0.3, sliding_window=window)
    rows_meta = AttentionMeta.decode(meta.req_to_token, meta.req_pool_indices, meta.seq_lens)
    ref = _dense_reference(qd, kc, vc, rows_meta, 0.3, allowed)
    torch.testing.assert_close(od, ref, atol=1e-5, rtol=1e-5)


@gpu
@pytest.mark.parametrize("window", [1, 8, 100, 1000])
@pytest.mark.parametrize(
    "head_dim,dtype",
    [(128, torch.bfloat16), (256, torch.bfloat16), (512, torch.bfloat16), (64, torch.float32)],
)
def test_sliding_window_kernels_match_twins(window, head_dim, dtype):
    """Triton extend (one pass, keys outside every window skipped) and decode (split-KV over
    the window) equal their twins, over prefixes far longer than the window."""
    kc, vc, meta, rows = paged_batch(
        [(0, 300), (2000, 37), (5, 1), (700, 130)], 1, head_dim, dtype, "cuda"
    )
    q = torch.randn(rows, 8, head_dim, device="cuda").to(dtype)
    scale = head_dim**-0.5
    o, ref = torch.zeros_like(q), torch.zeros_like(q)
    bounded = replace(meta, max_seq_len=2037)
    ops.extend_attention(q, o, kc, vc, bounded, scale, sliding_window=window)
    ext.extend_attention_torch(q, ref, kc, vc, meta, scale, sliding_window=window)
    n = int(meta.extend_lens.sum())
    torch.testing.assert_close(o[:n].float(), ref[:n].float(), atol=TOL[dtype], rtol=TOL[dtype])
    qd = torch.randn(4, 8, head_dim, device="cuda").to(dtype)
    od, refd = torch.zeros_like(qd), torch.zeros_like(qd)
    ops.decode_attention(qd, od, kc, vc, meta, scale, sliding_window=window)
    dec.decode_attention_torch(qd, refd, kc, vc, meta, scale, sliding_window=window)
    torch.testing.assert_close(od.float(), refd.float(), atol=TOL[dtype], rtol=TOL[dtype])


PEAK_SCRIPT = r"""
import resource, torch
from breakgraph.kernels import extend_attention as ext
from breakgraph.kernels.attention_meta import AttentionMeta
torch.manual_seed(0)
n, heads, kv_heads, dim = 4096, 9, 3, 64  # SmolLM2's attention, one 4K-token prompt
k = torch.randn(n + 1, kv_heads, dim)
v = torch.randn(n + 1, kv_heads, dim)
q = torch.randn(n, heads, dim)
o = torch.empty_like(q)
table = torch.arange(1, n + 1, dtype=torch.int32)[None]
i32 = lambda x: torch.tensor([x], dtype=torch.int32)
meta = AttentionMeta(table, torch.tensor([0]), i32(n), i32(0), i32(n), n, n)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
ext.extend_attention_torch(q, o, k, v, meta, dim**-0.5)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((after - before) // 1024)
"""


def test_cpu_attention_memory_is_bounded_for_a_4k_prompt():
    """The twin is the CPU serving path: a 4K-token prompt must not build the whole
    [heads, 4K, 4K] score matrix (600 MiB in float32; more with softmax's copies)."""
    out = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    peak_mib = int(out.stdout.strip().splitlines()[-1])
    assert peak_mib < 400, f"attention over a 4K prompt grew the peak RSS by {peak_mib} MiB"


def test_workspace_grows_without_moving_what_graphs_hold():
    """An outgrown buffer stays alive and listed: an earlier list is a prefix of a later one
    (the graph banks' address guards compare so); counters start at zero."""
    ws = dec.DecodeWorkspace()
    part_o, _ = ws.get(2, 4, 8, 16, torch.device("cpu"))
    counters = ws.counters(8, torch.device("cpu"))
    assert not counters.any()
    before = [b.data_ptr() for b in ws.buffers()]
    bigger, _ = ws.get(64, 4, 8, 16, torch.device("cpu"))  # grows the partials only
    after = [b.data_ptr() for b in ws.buffers()]
    assert after[: len(before)] == before and len(after) == len(before) + 1
    assert bigger.data_ptr() != part_o.data_ptr()
    assert ws.counters(8, torch.device("cpu")).data_ptr() == counters.data_ptr()


def test_default_workspaces_list_their_buffers_in_allocation_order(monkeypatch):
    """Across the kernels' default workspaces, the buffers graphs hold are listed in
    allocation order, so a decode buffer grown after capture does not shift the others."""
    from breakgraph.kernels import workspace

    monkeypatch.setattr(workspace, "_GRAPH_HELD", [])
    cpu = torch.device("cpu")
    decode, skinny = dec.DecodeWorkspace(graph_held=True), sg.SkinnyWorkspace(graph_held=True)
    decode.get(2, 4, 8, 16, cpu)
    skinny.partials(100, cpu)
    before = [b.data_ptr() for b in ops.graph_workspaces()]
    decode.get(64, 4, 8, 16, cpu)  # grows after a capture would have listed the others
    after = [b.data_ptr() for b in ops.graph_workspaces()]
    assert after[: len(before)] == before and len(after) == 3


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_tail_matches_twin(dtype, inverse):
    """DeepSeek V4's interleaved RoPE on the last 64 of 512 channels: [T, H, D] heads (a
    strided slice) and [T, D] rows, the twin's arithmetic (no FMA): equal up to rounding;
    in place too, every other channel and head untouched."""
    cos, sin = torch.randn(2, 37, 32, device="cuda").unbind(0)
    bases = (torch.randn(37, 9, 512, device="cuda"), torch.randn(37, 512, device="cuda"))
    for base in bases:
        base = base.to(dtype)
        x = base[:, 1:] if base.dim() == 3 else base
        ref = fused.rope_tail_torch(x, cos, sin, inverse)
        out = fused.rope_tail_triton(x, cos, sin, inverse)
        torch.testing.assert_close(out, ref, atol=TOL[dtype] / 100, rtol=TOL[dtype] / 100)
        before = base.clone()
        assert fused.rope_tail_triton(x, cos, sin, inverse, in_place=True) is x
        torch.testing.assert_close(x, ref, atol=TOL[dtype] / 100, rtol=TOL[dtype] / 100)
        assert torch.equal(base[..., :-64], before[..., :-64])
        if base.dim() == 3:
            assert torch.equal(base[:, 0], before[:, 0])


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_clamped_silu_mul_matches_twin(dtype):
    """DeepSeek V4's clamped SwiGLU in one kernel: HF's arithmetic, values past the limit."""
    gate, up = (torch.randn(33, 2 * 2048, device="cuda") * 8).to(dtype).chunk(2, dim=-1)
    ref = fused.clamped_silu_mul_torch(gate, up, 7.0)
    torch.testing.assert_close(fused.clamped_silu_mul_triton(gate, up, 7.0), ref)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_penalty_apply_is_bit_identical_to_twin(dtype):
    """The penalty pool's one-pass apply over a real pool (Qwen3's vocabulary): every
    penalty, logit_bias and min_new_tokens' bans, bit-identical to the gathered twin on the
    device; the neutral row's logits unchanged; inside a CUDA graph it reserves only its
    output."""
    from breakgraph.engine.penalties import PenaltyPool
    from breakgraph.engine.request import Req, SamplingParams
    from breakgraph.kernels import penalties as pen

    vocab = 151936
    pool = PenaltyPool(vocab, torch.device("cuda"), {2}, capacity=4)
    reqs = []
    for i, sp in enumerate([
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=1.3),
        SamplingParams(repetition_penalty=0.7, logit_bias={"5": 3.0, "9": -100.0}),
        SamplingParams(min_new_tokens=6, stop_token_ids=[7], presence_penalty=-0.5),
    ]):  # fmt: skip
        req = Req(f"r{i}", list(range(i, 4000, 3 + i)), sp)
        req.output_ids = [11 * i + 1, 5, 5, 9]
        pool.acquire(req)
        reqs.append(req)
    held = [0, *(r.penalty_row for r in reqs)]
    rows = torch.tensor([held[i % 4] for i in range(64)], device="cuda")
    logits = (torch.randn(len(rows), vocab, device="cuda") * 4).to(dtype)
    ref = pen.apply_penalties_torch(logits, rows, *pool.tensors())
    out = pen.apply_penalties_triton(logits, rows, *pool.tensors())
    assert torch.equal(out, ref)
    assert torch.equal(out[0], logits[0].float()) and torch.isinf(out[3, 7])

    def captured_pool(fn):  # what a graph of fn reserves in its own pool, and its output
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved()
        with torch.cuda.graph(graph):
            result = fn(logits, rows, *pool.tensors())
        graph.replay()
        torch.cuda.synchronize()
        return torch.cuda.memory_reserved() - before, result, graph

    kernel_bytes, captured, _g1 = captured_pool(pen.apply_penalties_triton)
    twin_bytes, _, _g2 = captured_pool(pen.apply_penalties_torch)
    assert torch.equal(captured, ref)
    # its output alone (the allocator rounds a segment up to 2 MiB); the twin's ~5 copies
    assert kernel_bytes <= out.numel() * 4 + (2 << 20) < twin_bytes / 3, (kernel_bytes, twin_bytes)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_norm_rope_tail_matches_twin(dtype):
    """DeepSeek V4's norm + interleaved RoPE (+ store) in one kernel, on its shapes: the
    unweighted q norm over 64 heads of 512 (a strided slice), the weighted kv norm stored
    at slots of the [S, 1, 512] cache; the twin's roundings (bit-equal in practice, within
    one rounding of a reduction-order tie)."""
    cos, sin = torch.randn(2, 37, 32, device="cuda").unbind(0)
    q = (torch.randn(37, 64, 520, device="cuda") * 3).to(dtype)[:, :, :512]
    torch.testing.assert_close(
        fused.norm_rope_tail_triton(q, None, 1e-6, cos, sin),
        fused.norm_rope_tail_torch(q, None, 1e-6, cos, sin),
    )
    kv = (torch.randn(37, 512, device="cuda") * 2).to(dtype)
    weight = torch.rand(512, device="cuda") + 0.5
    loc = torch.randperm(100, device="cuda")[:37]
    got, want = (torch.zeros(100, 1, 512, device="cuda", dtype=dtype) for _ in range(2))
    fused.norm_rope_tail_triton(kv, weight, 1e-6, cos, sin, got, loc)
    fused.norm_rope_tail_torch(kv, weight, 1e-6, cos, sin, want, loc)
    torch.testing.assert_close(got, want)
    # a compressor's pooled entries: float32 rows rounded to the cache's dtype first
    pooled = torch.randn(37, 512, device="cuda") * 2
    got, want = (torch.zeros(100, 512, device="cuda", dtype=dtype) for _ in range(2))
    fused.norm_rope_tail_triton(pooled, weight, 1e-6, cos, sin, got, loc)
    fused.norm_rope_tail_torch(pooled, weight, 1e-6, cos, sin, want, loc)
    torch.testing.assert_close(got, want)


@gpu
def test_window_score_matches_twin():
    """A DeepSeek V4 compressor's pooling logits in one kernel: bf16 projection output plus
    its window slot's float32 bias, exactly the twin's float32 sum."""
    from breakgraph.kernels import compressed_attention as ca

    gate = torch.randn(301, 1024, device="cuda").to(torch.bfloat16)
    bias = torch.randn(4, 1024, device="cuda")
    slot = torch.randint(0, 4, (301,), device="cuda")
    assert torch.equal(
        ca.window_score_triton(gate, bias, slot), ca.window_score_torch(gate, bias, slot)
    )
