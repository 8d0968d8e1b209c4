"""``breakgraph bench kernels``: Triton kernels against references measured in the same run.

Extend attention at 8K new tokens (Qwen3-0.6B shape) against torch's flash varlen
attention (or SDPA's flash backend); extend attention of 256 and 1024 new tokens over a
32K cached prefix (the split-KV path; before: the one-pass kernel) against the same
references with bottom-right causal alignment; decode attention (batch 32 x 8K context)
against the bandwidth floor, KV bytes / measured device-to-device copy bandwidth, also in
its long-context variant and over a verify step's rows; the fused norm, activation and RoPE
kernels against their torch twins; a decode step's sampling of a top_k request (the top-k
path against the full sort) and the penalty pool's apply (one pass against the gathering
twin) over Qwen3's vocabulary at batch 1, 64 and 256. Medians. Where FlashInfer imports, its
batch prefill over the same paged KV is one more extend reference (the candidate fast path
on Hopper).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from breakgraph.bench.attention_refs import (
    flashinfer_reference,
    one_request_extend,
    sdpa_flash_lower_right_reference,
    sdpa_flash_reference,
    varlen_reference,
)
from breakgraph.kernels import decode_attention as dec
from breakgraph.kernels import extend_attention as ext
from breakgraph.kernels import fused
from breakgraph.kernels.attention_meta import AttentionMeta

HEADS, KV_HEADS, HEAD_DIM, DTYPE = 16, 8, 128, torch.bfloat16  # Qwen3-0.6B
VERIFY_DRAFTS = 3


def bench_ms(fn, rep: int = 200) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def copy_bandwidth_bytes_per_ms(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy: each byte is read once and written once."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / bench_ms(lambda: dst.copy_(src))


def _paged_kv(
    num_tokens_per_req: list[int], shuffle: bool, device="cuda", kv_heads=KV_HEADS,
    head_dim=HEAD_DIM,
):  # fmt: skip
    """Caches holding every request's tokens; slots in order (a fresh pool) or shuffled.
    Returns ``(k_cache, v_cache, meta)``, ``meta`` one query row per request (decode)."""
    total = sum(num_tokens_per_req)
    k_cache = torch.randn(total + 1, kv_heads, head_dim, device=device, dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    slots = torch.arange(1, total + 1, device=device)
    if shuffle:
        slots = slots[torch.randperm(total, device=device)]
    req_to_token = torch.zeros(
        len(num_tokens_per_req), max(num_tokens_per_req), dtype=torch.int32, device=device
    )
    at = 0
    for r, n in enumerate(num_tokens_per_req):
        req_to_token[r, :n] = slots[at : at + n].int()
        at += n
    pool = torch.arange(len(num_tokens_per_req), device=device)
    seq_lens = torch.tensor(num_tokens_per_req, dtype=torch.int32, device=device)
    return k_cache, v_cache, AttentionMeta.decode(req_to_token, pool, seq_lens)


def bench_extend(n: int, sweep: bool) -> list[tuple]:
    rows = []
    k_cache, v_cache, meta = _paged_kv([n], shuffle=False)
    meta = one_request_extend(meta, n)
    q = torch.randn(n, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    o = torch.empty_like(q)
    args = (k_cache, v_cache, meta, HEAD_DIM**-0.5)
    triton_ms = bench_ms(lambda: ext.extend_attention_triton(q, o, *args))
    k, v = k_cache[1:], v_cache[1:]  # the same keys, contiguous
    shape = f"1 x {n} new, {HEADS}/{KV_HEADS} heads, d{HEAD_DIM}"
    refs = []
    varlen = varlen_reference(q, k, v, n)
    if varlen is not None:
        refs.append(("varlen_attn (flash)", bench_ms(varlen)))
    refs.append(("SDPA flash", bench_ms(sdpa_flash_reference(q, k, v))))
    flash = flashinfer_reference(q, k_cache, v_cache, meta, n)
    if flash is not None:
        ext.extend_attention_triton(q, o, *args)
        print(f"  flashinfer: |flashinfer - triton| max {_max_diff(flash(), o):.2e}")
        refs.append(("flashinfer (paged)", bench_ms(flash)))
    for name, ref_ms in refs:
        rows.append(("extend attention", shape, triton_ms, name, ref_ms))
    k_shuf, v_shuf, meta_shuf = _paged_kv([n], shuffle=True)
    shuffled = (k_shuf, v_shuf, one_request_extend(meta_shuf, n), HEAD_DIM**-0.5)
    shuffled_ms = bench_ms(lambda: ext.extend_attention_triton(q, o, *shuffled))
    rows.append(("extend, shuffled slots", shape, shuffled_ms, refs[0][0], refs[0][1]))
    if sweep:
        for cfg in [
            (128, 64, 8, 3),
            (128, 64, 8, 2),
            (128, 64, 4, 3),
            (128, 128, 8, 3),
            (128, 128, 8, 2),
            (64, 64, 4, 3),
            (128, 32, 4, 4),
            (64, 128, 8, 3),
        ]:
            fn = lambda cfg=cfg: _extend_at(q, o, *args, cfg)  # noqa: E731
            rows.append(("  extend sweep", f"BM,BN,warps,stages={cfg}", bench_ms(fn), "", None))
    return rows


def _extend_at(q, o, k_cache, v_cache, meta, sm_scale, config, splits=0) -> None:
    """Extend attention at a (BLOCK_M, BLOCK_N, warps, stages) config: the one-pass kernel
    (``splits`` 0) or the split-KV kernel and merge."""
    ext.ExtendPlan(q, k_cache, meta, sm_scale, config=config, splits=splits)(q, o, k_cache, v_cache)


def _max_diff(out, ref) -> float:
    return (out.float() - ref.float()).abs().max().item()


LONG_SPLIT_CONFIGS = [  # (BLOCK_M, BLOCK_N, warps, stages) swept for the split path
    (128, 128, 8, 3),
    (128, 64, 8, 3),
    (128, 128, 8, 2),
    (64, 64, 4, 3),
    (64, 128, 4, 3),
    (64, 64, 4, 2),
]


def bench_long_prefix(n: int, prefix: int, sweep: bool) -> list[tuple]:
    """1 request, ``n`` new tokens over a ``prefix``-token cached prefix (split-KV path).

    References get the same problem laid out contiguously: q = the new tokens, k/v = the
    prefix and the new tokens, causal with the offset (bottom-right aligned).
    """
    seq = prefix + n
    k_cache, v_cache, meta = _paged_kv([seq], shuffle=False)
    meta = one_request_extend(meta, n)
    q = torch.randn(n, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    o = torch.empty_like(q)
    o_one = torch.empty_like(q)
    args = (k_cache, v_cache, meta, HEAD_DIM**-0.5)
    bounded = (k_cache, v_cache, replace(meta, max_seq_len=seq), HEAD_DIM**-0.5)
    after = lambda: ext.extend_attention_triton(q, o, *bounded)  # noqa: E731
    before = lambda: ext.extend_attention_triton(q, o_one, *args)  # noqa: E731
    after()
    before()
    splits = ext.ExtendPlan(q, k_cache, replace(meta, max_seq_len=seq), HEAD_DIM**-0.5).splits
    print(f"{n} new over {prefix} prefix: {splits} splits; |split - one pass| max "
          f"{_max_diff(o, o_one):.2e}")  # fmt: skip
    k, v = k_cache[1:], v_cache[1:]  # the same keys, contiguous
    refs = []
    varlen = varlen_reference(q, k, v, n, seq)
    if varlen is not None:
        refs.append(("varlen_attn (flash)", varlen))
    sdpa = sdpa_flash_lower_right_reference(q, k, v)
    try:
        sdpa()
        refs.append(("SDPA flash lower-right", sdpa))
    except Exception as e:
        print(f"SDPA flash lower-right unavailable: {type(e).__name__}: {str(e)[:200]}")
    flash = flashinfer_reference(q, k_cache, v_cache, meta, seq)
    if flash is not None:
        refs.append(("flashinfer (paged)", flash))
    shape = f"1 x {n} new + {prefix} prefix, {HEADS}/{KV_HEADS} heads, d{HEAD_DIM}"
    after_ms, before_ms = bench_ms(after), bench_ms(before)
    rows = [(f"extend long prefix ({splits} splits)", shape, after_ms, "", None)]
    rows.append(("  one pass (before)", shape, before_ms, "split-KV (after)", after_ms))
    for name, fn in refs:
        # exact only if the reference's causal mask is bottom-right aligned, as flash's is
        print(f"  {name}: |reference - triton| max {_max_diff(fn(), o):.2e}")
        rows.append(("  split-KV vs reference", shape, after_ms, name, bench_ms(fn)))
    if sweep:
        for cfg_ in LONG_SPLIT_CONFIGS:
            for s in (1, 2, 4, 8, 16) if n <= 256 else (1, 2, 4, 8):
                fn = lambda c=cfg_, s=s: _extend_at(q, o, *args, c, s)  # noqa: E731
                rows += _sweep_row("  split sweep", f"{n} new, BM,BN,warps,stages={cfg_} S={s}", fn)
        for cfg_ in LONG_SPLIT_CONFIGS:
            fn = lambda c=cfg_: _extend_at(q, o_one, *args, c)  # noqa: E731
            rows += _sweep_row("  one-pass sweep", f"{n} new, BM,BN,warps,stages={cfg_}", fn)
    return rows


def _sweep_row(kind: str, label: str, fn) -> list[tuple]:
    """One timed sweep point, printed at once (a config may not compile: reported)."""
    try:
        ms = bench_ms(fn, rep=60)
    except Exception as e:
        print(f"{kind.strip()} {label}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
        return []
    print(f"{kind.strip()} {label}: {ms:.3f} ms", flush=True)
    return [(kind, label, ms, "", None)]


def bench_decode(batch: int, context: int, sweep: bool) -> list[tuple]:
    k_cache, v_cache, meta = _paged_kv([context] * batch, shuffle=False)
    q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    o = torch.empty_like(q)
    args = (k_cache, v_cache, meta, HEAD_DIM**-0.5)
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * k_cache.element_size()
    floor_ms = kv_bytes / copy_bandwidth_bytes_per_ms()
    shape = f"{batch} x {context} ctx, {HEADS}/{KV_HEADS} heads, d{HEAD_DIM}"
    splits = dec.default_num_kv_splits(batch, KV_HEADS, q.device)
    ms = bench_ms(lambda: dec.decode_attention_triton(q, o, *args))
    rows = [("decode attention", f"{shape}, {splits} splits", ms, "bandwidth floor", floor_ms)]
    with dec.long_context():  # the variant batch-1 graphs replay over long contexts
        long_ms = bench_ms(lambda: dec.decode_attention_triton(q, o, *args))
    rows.append(("  long-context variant", shape, long_ms, "bandwidth floor", floor_ms))
    # a verify step's rows: 1 + 3 per request at consecutive positions (one key pass per
    # request, kernels/decode_attention.py), against the plain step's time
    n = 1 + VERIFY_DRAFTS
    ends = (meta.seq_lens - VERIFY_DRAFTS).repeat_interleave(n)
    verify = AttentionMeta.decode(
        meta.req_to_token,
        meta.req_pool_indices.repeat_interleave(n),
        ends + torch.arange(n, dtype=torch.int32, device=q.device).repeat(batch),
    )
    qv = torch.randn(batch * n, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    ov = torch.empty_like(qv)
    verify_ms = bench_ms(lambda: dec.decode_attention_triton(qv, ov, *args[:2], verify, args[3]))
    rows.append(("  verify rows", f"{shape}, {n} rows per request", verify_ms, "plain step", ms))
    if sweep:
        for s in (4, 8, 16, 32, 64):
            fn = lambda s=s: dec.decode_attention_triton(q, o, *args, num_kv_splits=s)  # noqa: E731
            rows.append(
                ("  decode sweep", f"splits={s}", bench_ms(fn), "bandwidth floor", floor_ms)
            )
    return rows


def bench_fused(n: int) -> list[tuple]:
    x = torch.randn(n, 1024, device="cuda", dtype=DTYPE)
    w = torch.randn(1024, device="cuda", dtype=DTYPE)
    gate_up = torch.randn(n, 2 * 3072, device="cuda", dtype=DTYPE)
    q = torch.randn(n, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    k = torch.randn(n, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    qw = torch.randn(HEAD_DIM, device="cuda", dtype=DTYPE)
    cos, sin = torch.randn(n, HEAD_DIM, device="cuda"), torch.randn(n, HEAD_DIM, device="cuda")
    cases = [
        ("rms_norm", f"{n} x 1024", fused.rms_norm_triton, fused.rms_norm_torch, (x, w, 1e-6)),
        (
            "fused_add_rms_norm",
            f"{n} x 1024",
            fused.fused_add_rms_norm_triton,
            fused.fused_add_rms_norm_torch,
            (x, x, w, 1e-6),
        ),
        (
            "silu_and_mul",
            f"{n} x 2*3072",
            fused.silu_and_mul_triton,
            fused.silu_and_mul_torch,
            (gate_up,),
        ),
        (
            "qk_norm_rope",
            f"{n} x {HEADS}+{KV_HEADS} heads",
            fused.qk_norm_rope_triton,
            fused.qk_norm_rope_torch,
            (q, k, qw, qw, 1e-6, cos, sin),
        ),
    ]
    rows = []
    for name, shape, tri, twin, args in cases:
        ms = bench_ms(lambda tri=tri, args=args: tri(*args))
        ref_ms = bench_ms(lambda twin=twin, args=args: twin(*args))
        rows.append((name, shape, ms, "torch twin (eager)", ref_ms))
    return rows


def bench_sampling(batches: list[int]) -> list[tuple]:
    """A decode step's sampling and penalties over Qwen3's vocabulary: a top_k request's
    top-k path against the sorted path of the same filters, and the penalty pool's one-pass
    apply against its gathering twin (every row with penalties, logit_bias and a min)."""
    from breakgraph.engine import sampler
    from breakgraph.engine.penalties import PenaltyPool
    from breakgraph.engine.request import Req, SamplingParams
    from breakgraph.kernels import penalties as pen

    vocab, rows = 151936, []
    pool = PenaltyPool(vocab, torch.device("cuda"), {2}, capacity=max(batches))
    sp = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, frequency_penalty=0.5,
                        repetition_penalty=1.1, logit_bias={"5": 2.0}, min_new_tokens=4)  # fmt: skip
    for i in range(max(batches)):
        pool.acquire(Req(f"r{i}", list(range(i, 2000, 7)), sp))
    for b in batches:
        logits = torch.randn(b, vocab, device="cuda") * 3
        args = (logits, [sp] * b, [None] * b, logits.argmax(dim=-1))
        ms = bench_ms(lambda args=args: sampler._sample_top_k(*args))
        ref = bench_ms(lambda args=args: sampler._sample_sorted(*args))
        rows.append(("sample (top_k 50, top_p 0.9)", f"{b} x {vocab}", ms, "full sort", ref))
        at = torch.arange(1, b + 1, device="cuda")
        args = (logits, at, *pool.tensors())
        ms = bench_ms(lambda args=args: pen.apply_penalties_triton(*args))
        ref = bench_ms(lambda args=args: pen.apply_penalties_torch(*args))
        rows.append(("penalty apply", f"{b} x {vocab}", ms, "torch twin (gathers)", ref))
    return rows


def run_kernels_bench(args) -> None:
    if not torch.cuda.is_available():
        raise SystemExit("error: bench kernels needs a CUDA device")
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    if args.tflops is not None:
        from breakgraph.bench import attention_tflops as at

        head_dims = args.tflops or [128, 512]
        if not set(head_dims) <= at.HEADS.keys():
            raise SystemExit(f"error: --tflops takes head sizes {sorted(at.HEADS)}")
        rate = at.matrix_tflops(bench_ms)
        rows = at.bench_tflops(head_dims, bench_ms, _paged_kv, sweep=args.sweep)
        print("\n".join(at.format_tflops(rows, rate)))
        return
    if args.mixed:
        from breakgraph.bench.mixed_attention import bench_mixed

        rows = bench_mixed(bench_ms, _paged_kv)
    elif args.v4_attention:
        from breakgraph.bench.v4_attention import (
            bench_hc_mixes,
            bench_norm_rope,
            bench_v4_attention,
        )

        cases = [(0, 1024, 1), (0, 8192, 1), (65536, 1024, 1), (8192, 1, 1), (8192, 32, 32)]
        rows = bench_v4_attention(cases) + bench_hc_mixes([1, 32, 1024, 8000])
        rows += bench_norm_rope([1, 32, 8000])
    elif args.decode_sweep:
        from breakgraph.bench.decode_sweep import bench_decode_sweep

        rows = bench_decode_sweep(
            args.sweep_batches, args.sweep_contexts, _paged_kv, copy_bandwidth_bytes_per_ms(),
            HEADS,
        )  # fmt: skip
    else:
        rows = [] if args.long_prefix_only else bench_extend(args.extend_tokens, args.sweep)
        for n in (256, 1024):
            rows += bench_long_prefix(n, args.prefix, args.sweep)
        if not args.long_prefix_only:
            rows += bench_decode(args.decode_batch, args.decode_context, args.sweep)
            rows += bench_fused(args.extend_tokens)
            rows += bench_sampling([1, 64, 256])
    header = ("kernel", "shape", "triton ms", "reference", "ref ms", "ratio")
    table = [
        (
            k,
            s,
            f"{ms:.3f}",
            r,
            "" if rms is None else f"{rms:.3f}",
            "" if rms is None else f"{ms / rms:.2f}x",
        )
        for k, s, ms, r, rms in rows
    ]
    widths = [max(len(str(c)) for c in col) for col in zip(header, *table, strict=True)]
    for line in [header, tuple("-" * w for w in widths), *table]:
        print("  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)))
