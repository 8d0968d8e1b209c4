"""Split kernels under Triton's interpreter on CPU tensors, against their torch twins
(float32): decode attention (split KV and the merge kernel; plain and with a sliding window)
and the skinny GEMM, whose last split to finish merges the others (the arrival counters back
at zero after; split K, ragged tiles, bias; gate/up with SiLU or GELU in the epilogue; the
residual add + RMSNorm as its prologue); the GEMV kernel; and one request's extend attention
zeroing its padding rows (a whole prefill graph's). Run
as ``TRITON_INTERPRET=1 python -m tests.kernels.interpret_kernels`` (started so by
``test_triton_interpret.py``)."""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

from breakgraph.kernels import decode_attention as dec
from breakgraph.kernels import skinny_gemm as sg
from breakgraph.kernels.attention_meta import AttentionMeta

SEQ_LENS = [0, 1, 2, 63, 64, 65, 300, 777]


def main() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1"
    torch.manual_seed(0)
    kv_heads, group, head_dim = 2, 3, 32
    batch, slots = len(SEQ_LENS), sum(SEQ_LENS) + 1
    kc = torch.randn(slots, kv_heads, head_dim)
    vc = torch.randn(slots, kv_heads, head_dim)
    table = torch.zeros(batch, max(SEQ_LENS), dtype=torch.int32)
    perm = torch.randperm(slots - 1) + 1  # slot 0 is the padding slot
    at = 0
    for b, n in enumerate(SEQ_LENS):
        table[b, :n] = perm[at : at + n].to(torch.int32)
        at += n
    seq_lens = torch.tensor(SEQ_LENS, dtype=torch.int32)
    meta = AttentionMeta.decode(table, torch.arange(batch), seq_lens)
    q = torch.randn(batch, kv_heads * group, head_dim)
    failed = 0
    for window in (None, 50):
        ref = torch.zeros_like(q)
        dec.decode_attention_torch(q, ref, kc, vc, meta, 0.3, sliding_window=window)
        for splits in (1, 2, 5):
            o = torch.full_like(q, 7.0)
            dec.decode_attention_triton(
                q, o, kc, vc, meta, 0.3, num_kv_splits=splits, workspace=dec.DecodeWorkspace(),
                sliding_window=window,
            )  # fmt: skip
            diff = (o - ref).abs().max().item()
            ok = diff <= 1e-5
            failed += not ok
            print(f"{'ok' if ok else 'FAIL'} window={window} splits={splits}: max diff {diff:.1e}")
    return (
        failed
        + decode_rows()
        + rope_tail()
        + clamped_silu_mul()
        + skinny_gemm()
        + extend_zero_pad()
        + mixed_decode_rows()
        + sweep_tiles()
        + apply_penalties()  # after the cases that draw from the global generator unseeded
        + norm_rope_tail()
    )


def decode_rows() -> int:
    """Several rows of one request at consecutive positions (a verify step's decode rows):
    each run's first program attends for the run's rows, one key pass, each row masked at
    its own position; runs longer than a tile, runs cut by the batch's end, a request's rows
    that are not one position apart, padding rows (length 1) and a sliding window. Every row
    equals the twin's, which attends row by row."""
    torch.manual_seed(1)
    head_dim, failed = 32, 0
    # (request, first row's length, rows): runs of 1-7 rows, short and long contexts
    runs = [(0, 5, 3), (1, 1, 1), (2, 70, 7), (3, 300, 4), (0, 20, 2), (4, 129, 1), (5, 64, 6)]
    lens = [n + i for _, n, k in runs for i in range(k)]
    reqs = [r for r, _, k in runs for _ in range(k)]
    lens += [1, 1, 1]  # padding rows: the padding request at length 1
    reqs += [6, 6, 6]
    slots = 7 * 400 + 1
    table = torch.randperm(slots - 1)[: 7 * 400].view(7, 400).to(torch.int32) + 1
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    meta = AttentionMeta.decode(table, torch.tensor(reqs), seq_lens)
    for kv_heads, group in ((2, 1), (1, 2), (2, 3), (1, 4), (2, 8), (1, 16)):
        kc = torch.randn(slots, kv_heads, head_dim)
        vc = torch.randn(slots, kv_heads, head_dim)
        q = torch.randn(len(lens), kv_heads * group, head_dim)
        for window in (None, 40):
            ref = torch.zeros_like(q)
            dec.decode_attention_torch(q, ref, kc, vc, meta, 0.3, sliding_window=window)
            worst = 0.0
            for splits in (1, 3):
                for cut in (len(lens), 9):  # the whole batch, and a replay piece's first rows
                    o = torch.full_like(q, 7.0)
                    part = AttentionMeta.decode(table, meta.req_pool_indices[:cut], seq_lens[:cut])
                    dec.decode_attention_triton(
                        q[:cut], o[:cut], kc, vc, part, 0.3, num_kv_splits=splits,
                        workspace=dec.DecodeWorkspace(), sliding_window=window,
                    )  # fmt: skip
                    worst = max(worst, (o[:cut] - ref[:cut]).abs().max().item())
            ok = worst <= 1e-5
            failed += not ok
            print(
                f"{'ok' if ok else 'FAIL'} decode rows group={group} window={window}: "
                f"max diff {worst:.1e}"
            )
    return failed


def rope_tail() -> int:
    """DeepSeek V4's interleaved RoPE on a row's trailing channels (``fused.rope_tail``):
    [T, D] rows, [T, H, D] heads of a wider tensor (strided), the inverse rotation."""
    from breakgraph.kernels import fused

    torch.manual_seed(2)
    failed = 0
    cos, sin = torch.randn(5, 8), torch.randn(5, 8)  # 16 rope channels of 40
    for x in (torch.randn(5, 40), torch.randn(5, 3, 48)[..., :40]):
        for inverse in (False, True):
            ref = fused.rope_tail_torch(x, cos, sin, inverse)
            diff = (fused.rope_tail_triton(x, cos, sin, inverse) - ref).abs().max().item()
            ok = diff <= 1e-6
            failed += not ok
            print(f"{'ok' if ok else 'FAIL'} rope tail {tuple(x.shape)} inverse={inverse}: "
                  f"max diff {diff:.1e}")  # fmt: skip
    return failed


def clamped_silu_mul() -> int:
    """DeepSeek V4's clamped SwiGLU in one kernel: values past the limit both ways, gate and
    up as strided halves of one [T, 2I] output, against HF's arithmetic."""
    from breakgraph.kernels import fused

    torch.manual_seed(3)
    failed = 0
    for limit in (0.5, 7.0):
        gate, up = (torch.randn(6, 2 * 70) * 4).chunk(2, dim=-1)
        ref = fused.clamped_silu_mul_torch(gate, up, limit)
        diff = (fused.clamped_silu_mul_triton(gate, up, limit) - ref).abs().max().item()
        ok = diff <= 1e-6
        failed += not ok
        print(f"{'ok' if ok else 'FAIL'} clamped silu mul limit={limit}: max diff {diff:.1e}")
    return failed


def apply_penalties() -> int:
    """The penalty pool's apply in one pass (``kernels/penalties.py``), bit-identical to the
    twin: float32 and bfloat16 logits, the neutral row, repetition both ways, counts,
    presence, logit_bias and min_new_tokens' bans (one row still banned, one past it), a
    vocabulary not a multiple of the block."""
    from breakgraph.kernels import penalties as pen

    torch.manual_seed(4)
    rows_n, vocab = 5, 2 * pen.BLOCK + 77
    counts = torch.randint(0, 3, (rows_n, vocab)).float()
    counts[0] = 0
    seen = torch.rand(rows_n, vocab) < 0.3
    seen[0] = False
    bias = torch.randn(rows_n, vocab) * (torch.rand(rows_n, vocab) < 0.1)
    bias[0] = 0
    banned = torch.rand(rows_n, vocab) < 0.05
    params = torch.tensor([[0, 0, 1], [0.5, 0.25, 1.3], [0, 0.7, 0.8], [1.1, 0, 1], [0.2, 0.1, 2]])
    min_new = torch.tensor([0, 4, 0, 9, 2], dtype=torch.int32)
    generated = torch.tensor([0, 2, 5, 9, 1], dtype=torch.int32)
    pool = (counts, seen, bias, banned, params.float(), min_new, generated)
    rows = torch.tensor([0, 1, 2, 3, 4, 1, 0], dtype=torch.int64)
    failed = 0
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(len(rows), vocab) * 3).to(dtype)
        ref = pen.apply_penalties_torch(logits, rows, *pool)
        out = pen.apply_penalties_triton(logits, rows, *pool)
        same = out.dtype == ref.dtype and torch.equal(out, ref)
        neutral = torch.equal(out[0], logits[0].float())
        failed += not (same and neutral)
        print(f"{'ok' if same and neutral else 'FAIL'} apply penalties {dtype}: "
              f"bit-identical {same}, neutral row unchanged {neutral}")  # fmt: skip
    return failed


def norm_rope_tail() -> int:
    """DeepSeek V4's norm, interleaved RoPE and store in one kernel: its unweighted q norm
    over [T, H, D] heads of a wider tensor (strided), its weighted kv norm over [T, D] rows
    stored at slots of a [S, 1, D] cache and of an [S, D] one, against the twin."""
    from breakgraph.kernels import fused

    torch.manual_seed(5)
    failed = 0
    cos, sin = torch.randn(6, 8), torch.randn(6, 8)  # 16 rope channels of 80
    q = (torch.randn(6, 3, 96) * 3)[:, :, :80]
    diff = (fused.norm_rope_tail_triton(q, None, 1e-6, cos, sin)
            - fused.norm_rope_tail_torch(q, None, 1e-6, cos, sin)).abs().max().item()  # fmt: skip
    ok = diff <= 1e-6
    failed += not ok
    print(f"{'ok' if ok else 'FAIL'} norm rope tail, unweighted heads: max diff {diff:.1e}")
    # in place over contiguous heads, as the prefill attention's q (rows of 3 heads a tile)
    q = torch.randn(6, 3, 80) * 3
    want = fused.norm_rope_tail_torch(q, None, 1e-6, cos, sin)
    got = fused.norm_rope_tail_triton(q, None, 1e-6, cos, sin, in_place=True)
    diff = (q - want).abs().max().item()
    ok = diff <= 1e-6 and got.data_ptr() == q.data_ptr()
    failed += not ok
    print(
        f"{'ok' if ok else 'FAIL'} norm rope tail, unweighted heads in place: max diff {diff:.1e}"
    )
    kv, weight, loc = torch.randn(6, 80) * 2, torch.rand(80) + 0.5, torch.tensor([3, 0, 7, 1, 9, 4])
    for shape in ((11, 1, 80), (11, 80)):
        got, want = torch.zeros(shape), torch.zeros(shape)
        fused.norm_rope_tail_triton(kv, weight, 1e-6, cos, sin, got, loc)
        fused.norm_rope_tail_torch(kv, weight, 1e-6, cos, sin, want, loc)
        diff = (got - want).abs().max().item()
        ok = diff <= 1e-6 and bool(got[2].eq(0).all())  # a slot not in loc untouched
        failed += not ok
        print(f"{'ok' if ok else 'FAIL'} norm rope tail, weighted, stored {shape}: "
              f"max diff {diff:.1e}")  # fmt: skip
    # float32 rows into a half cache (a compressor's pooled entries): rounded in first
    got, want = torch.zeros(11, 80, dtype=torch.float16), torch.zeros(11, 80, dtype=torch.float16)
    fused.norm_rope_tail_triton(kv, weight, 1e-6, cos, sin, got, loc)
    fused.norm_rope_tail_torch(kv, weight, 1e-6, cos, sin, want, loc)
    diff = (got.float() - want.float()).abs().max().item()
    ok = diff <= 1e-3 and bool(got[2].eq(0).all())
    failed += not ok
    print(f"{'ok' if ok else 'FAIL'} norm rope tail, float32 rows into a float16 cache: "
          f"max diff {diff:.1e}")  # fmt: skip
    return failed


def extend_zero_pad() -> int:
    """One request's extend attention with ``zero_pad`` (a whole prefill graph's): its rows
    equal the twin's, every row past them up to o's last is zero (o starts as NaN), on the
    one-pass kernel (whose blocks past the request write the zeros) and the split one."""
    from dataclasses import replace

    from breakgraph.kernels import extend_attention as ext
    from tests.support.kernels import paged_batch

    failed, rows = 0, 48
    for prefix, extend in ((7, 5), (0, 40), (130, 1)):
        kc, vc, meta, _ = paged_batch([(prefix, extend)], 2, 32, torch.float32, "cpu")
        meta = replace(meta, max_extend_len=rows, max_seq_len=prefix + extend)
        q = torch.randn(rows, 4, 32)
        ref = torch.zeros_like(q)
        ext.extend_attention_torch(q, ref, kc, vc, meta, 0.3)
        cfg = ext._extend_config(32, torch.float32, q.device)
        for splits in (0, 2):
            o = torch.full_like(q, float("nan"))
            ext.ExtendPlan(q, kc, meta, 0.3, config=cfg, splits=splits, zero_pad=True)(q, o, kc, vc)
            diff = (o[:extend] - ref[:extend]).abs().max().item()
            zeros = bool((o[extend:] == 0).all())
            ok = diff <= 1e-5 and zeros
            failed += not ok
            print(
                f"{'ok' if ok else 'FAIL'} extend zero_pad prefix={prefix} extend={extend} "
                f"splits={splits}: max diff {diff:.1e}, padding zero {zeros}"
            )
    return failed


def mixed_decode_rows() -> int:
    """A mixed step (prefill requests, then running requests of one query row each): the
    plan that sends the one-row requests to the decode kernel equals the twin, with and
    without a window, and where every request has one row."""
    from breakgraph.kernels import extend_attention as ext
    from breakgraph.kernels import ops
    from tests.support.kernels import paged_batch

    failed = 0
    cases = {  # (prefix, new tokens) per request; the one-row requests at the end
        "mixed": ([(7, 5), (0, 40), (20, 1), (130, 1), (64, 1)], 3),
        "decode rows only": ([(20, 1), (3, 1)], 2),
    }
    for name, (batch, expected) in cases.items():
        kc, vc, meta, rows = paged_batch(batch, 2, 32, torch.float32, "cpu", host=True)
        q = torch.randn(rows, 4, 32)
        tail = ops._decode_tail(meta)
        for window in (None, 16):
            ref = torch.zeros_like(q)
            ext.extend_attention_torch(q, ref, kc, vc, meta, 0.3, sliding_window=window)
            o = torch.zeros_like(q)
            ops._plan_with_decode_rows(q, kc, meta, 0.3, window, tail)(q, o, kc, vc)
            diff = (o - ref).abs().max().item()
            ok = diff <= 1e-5 and tail == expected
            failed += not ok
            print(
                f"{'ok' if ok else 'FAIL'} {name} window={window}, {tail} decode rows: "
                f"max diff {diff:.1e}"
            )
    return failed


def sweep_tiles() -> int:
    """``bench kernels --tflops --sweep``'s d512 tiles (bench/attention_tflops.py) on the
    one-pass extend kernel: each equals the twin (a cached prefix, ragged blocks), so the
    sweep on the GPU measures speed only; a value-split tile also under a sliding window, on
    the split kernel, and zeroing one request's padding rows."""
    from dataclasses import replace

    from breakgraph.bench.attention_tflops import TILE_SWEEP
    from breakgraph.kernels import extend_attention as ext
    from tests.support.kernels import paged_batch

    failed = 0
    kc, vc, meta, rows = paged_batch([(20, 37)], 1, 512, torch.float32, "cpu")
    q = torch.randn(rows, 8, 512)
    ref = torch.zeros_like(q)
    ext.extend_attention_torch(q, ref, kc, vc, meta, 512**-0.5)
    for cfg in TILE_SWEEP[512]:
        o = torch.zeros_like(q)
        ext.ExtendPlan(q, kc, meta, 512**-0.5, config=cfg, splits=0)(q, o, kc, vc)
        diff = (o[:37] - ref[:37]).abs().max().item()
        ok = diff <= 1e-5
        failed += not ok
        print(f"{'ok' if ok else 'FAIL'} d512 tile {cfg}: max diff {diff:.1e}")
    # the value split where it meets the one-pass kernel's other paths: a sliding window,
    # and one request's padding rows zeroed (by every share of the columns)
    cfg = (16, 32, 4, 2, 128)
    refw = torch.zeros_like(q)
    ext.extend_attention_torch(q, refw, kc, vc, meta, 512**-0.5, sliding_window=24)
    o = torch.zeros_like(q)
    plan = ext.ExtendPlan(q, kc, meta, 512**-0.5, config=cfg, splits=0, sliding_window=24)
    plan(q, o, kc, vc)
    diff = (o[:37] - refw[:37]).abs().max().item()
    failed += diff > 1e-5
    print(f"{'ok' if diff <= 1e-5 else 'FAIL'} d512 tile {cfg}, window 24: max diff {diff:.1e}")
    for splits in (1, 3):  # the split kernel's (direct, and through the workspace)
        o = torch.zeros_like(q)
        ext.ExtendPlan(q, kc, meta, 512**-0.5, config=cfg, splits=splits)(q, o, kc, vc)
        diff = (o[:37] - ref[:37]).abs().max().item()
        failed += diff > 1e-5
        print(f"{'ok' if diff <= 1e-5 else 'FAIL'} d512 tile {cfg}, {splits} splits: "
              f"max diff {diff:.1e}")  # fmt: skip
    q = torch.cat([q, torch.randn(64 - rows, 8, 512)])  # a block of padding rows only, too
    meta = replace(meta, max_extend_len=64)
    o = torch.full_like(q, float("nan"))
    ext.ExtendPlan(q, kc, meta, 512**-0.5, config=cfg, splits=0, zero_pad=True)(q, o, kc, vc)
    diff = (o[:37] - ref[:37]).abs().max().item()
    zeros = bool((o[37:] == 0).all())
    ok = diff <= 1e-5 and zeros
    failed += not ok
    print(f"{'ok' if ok else 'FAIL'} d512 tile {cfg}, zero_pad: max diff {diff:.1e}, "
          f"padding zero {zeros}")  # fmt: skip
    return failed


def skinny_gemm() -> int:
    failed = 0
    for m, n, k in ((1, 40, 70), (3, 100, 300), (17, 64, 256), (64, 20, 64)):
        x, w, bias = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
        for cfg in (sg.SkinnyConfig(16, 32, 1), sg.SkinnyConfig(32, 64, 5)):
            ws = sg.SkinnyWorkspace()
            diff = max(
                (sg.skinny_gemm_triton(x, w, b, cfg, ws) - F.linear(x, w, b)).abs().max().item()
                for b in (None, bias)
            )
            zero = not any(b.any() for b in ws.buffers() if b.dtype == torch.int32)
            ok = diff <= 1e-4 and zero
            failed += not ok
            print(f"{'ok' if ok else 'FAIL'} skinny {m}x{n}x{k} {cfg}: max diff {diff:.1e}")
    for m, k, act in ((1, 70, "silu"), (17, 256, "gelu_tanh")):
        x, gate_up = torch.randn(m, k), torch.randn(2 * 48, k)  # ragged N tiles of 48
        ref = sg.skinny_act_and_mul_torch(x, gate_up, act)
        for cfg in (sg.SkinnyConfig(16, 32, 1), sg.SkinnyConfig(32, 64, 3)):
            out = sg.skinny_gemm_triton(x, gate_up, None, cfg, sg.SkinnyWorkspace(), act)
            rel = ((out - ref).abs() / ref.abs().clamp_min(1)).max().item()
            ok = out.shape == ref.shape and rel <= 1e-4
            failed += not ok
            print(f"{'ok' if ok else 'FAIL'} skinny {act} {m}x{k} {cfg}: max rel diff {rel:.1e}")
    for m, k, act in ((1, 300, None), (17, 256, "silu")):  # the residual add + RMSNorm in front
        x, res, gate_up = torch.randn(m, k), torch.randn(m, k), torch.randn(2 * 48, k)
        norm_w = 1 + 0.1 * torch.randn(k)
        ref, ref_res = sg.skinny_norm_gemm_torch(x, res, norm_w, 1e-6, gate_up, act)
        for cfg in (sg.SkinnyConfig(16, 32, 1), sg.SkinnyConfig(32, 64, 3)):
            out, new_res = sg.skinny_norm_gemm_triton(
                x, res, norm_w, 1e-6, gate_up, cfg, sg.SkinnyWorkspace(), act
            )
            rel = ((out - ref).abs() / ref.abs().clamp_min(1)).max().item()
            ok = out.shape == ref.shape and rel <= 1e-4 and torch.equal(new_res, ref_res)
            failed += not ok
            print(
                f"{'ok' if ok else 'FAIL'} skinny norm+{act} {m}x{k} {cfg}: max rel diff {rel:.1e}"
            )
    return failed + gemv()


def gemv() -> int:
    """The GEMV kernel (``SkinnyConfig(gemv=True)``): rows 1..8, ragged N and K tiles, bias,
    gate/up with its activation; and a norm in front stays apart (the prologue is the tensor-
    core kernel's only)."""
    failed = 0
    cfgs = (sg.SkinnyConfig(4, 32, 1, gemv=True), sg.SkinnyConfig(16, 64, 1, gemv=True))
    for m, n, k in ((1, 40, 70), (3, 100, 300), (8, 9, 64)):
        x, w, bias = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
        for cfg in cfgs:
            diff = max(
                (sg.skinny_gemm_triton(x, w, b, cfg) - F.linear(x, w, b)).abs().max().item()
                for b in (None, bias)
            )
            ok = diff <= 1e-4
            failed += not ok
            print(f"{'ok' if ok else 'FAIL'} gemv {m}x{n}x{k} {cfg}: max diff {diff:.1e}")
    for m, k, act in ((1, 70, "silu"), (5, 256, "gelu_tanh")):
        x, gate_up = torch.randn(m, k), torch.randn(2 * 48, k)
        ref = sg.skinny_act_and_mul_torch(x, gate_up, act)
        out = sg.skinny_gemm_triton(x, gate_up, None, cfgs[1], activation=act)
        rel = ((out - ref).abs() / ref.abs().clamp_min(1)).max().item()
        ok = out.shape == ref.shape and rel <= 1e-4
        failed += not ok
        print(f"{'ok' if ok else 'FAIL'} gemv {act} {m}x{k}: max rel diff {rel:.1e}")
    # a GEMV config with a norm in front, or past GEMV_MAX_M rows: the tensor-core kernel
    rows = sg.GEMV_MAX_M + 1
    x, res, w = torch.randn(rows, 64), torch.randn(rows, 64), torch.randn(9, 64)
    norm_w = 1 + 0.1 * torch.randn(64)
    ref, _ = sg.skinny_norm_gemm_torch(x[:2], res[:2], norm_w, 1e-6, w)
    out, _ = sg.skinny_norm_gemm_triton(x[:2], res[:2], norm_w, 1e-6, w, cfgs[0])
    diff = max(
        (out - ref).abs().max().item(),
        (sg.skinny_gemm_triton(x, w, None, cfgs[0]) - F.linear(x, w)).abs().max().item(),
    )
    ok = diff <= 1e-4
    failed += not ok
    print(f"{'ok' if ok else 'FAIL'} gemv config off its kernel: max diff {diff:.1e}")
    return failed


if __name__ == "__main__":
    sys.exit(main())
