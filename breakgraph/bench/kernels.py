"""Kernel benchmark: Triton kernels against references measured in the same run.

    python -m breakgraph.bench.kernels [--sweep]

Extend attention at 8K new tokens (Qwen3-0.6B shape) against torch's flash varlen
attention (or SDPA's flash backend); decode attention (batch 32 x 8K context) against
the bandwidth floor, KV bytes / measured device-to-device copy bandwidth. Medians.
"""

from __future__ import annotations

import argparse
import inspect

import torch

from breakgraph.kernels import decode_attention as dec
from breakgraph.kernels import extend_attention as ext
from breakgraph.kernels import fused

HEADS, KV_HEADS, HEAD_DIM, DTYPE = 16, 8, 128, torch.bfloat16  # Qwen3-0.6B


def _bench_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def _copy_bandwidth_bytes_per_ms(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy: each byte is read once and written once."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / _bench_ms(lambda: dst.copy_(src))


def _paged_kv(num_tokens_per_req: list[int], shuffle: bool, device="cuda"):
    """Caches holding every request's tokens; slots in order (a fresh pool) or shuffled."""
    total = sum(num_tokens_per_req)
    k_cache = torch.randn(total + 1, KV_HEADS, HEAD_DIM, device=device, dtype=DTYPE)
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
    return k_cache, v_cache, req_to_token, pool, seq_lens


def _varlen_reference(q, k, v, n: int):
    """A closure running torch's varlen flash attention (causal, GQA), or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    kwargs = {}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)  # causal
    elif "is_causal" in params:
        kwargs["is_causal"] = True
    else:
        return None
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    else:  # older API: same head count for q and kv
        k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
        v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    fn = lambda: varlen_attn(q, k, v, cu, cu, n, n, **kwargs)  # noqa: E731
    try:
        fn()
    except Exception as e:  # report, and the SDPA reference still runs
        print(f"varlen_attn unavailable here: {type(e).__name__}: {str(e).splitlines()[0]}")
        return None
    return fn


def _sdpa_flash_reference(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = HEADS // KV_HEADS
    qt = q.transpose(0, 1)[None]
    kt = k.repeat_interleave(group, dim=1).transpose(0, 1)[None]
    vt = v.repeat_interleave(group, dim=1).transpose(0, 1)[None]

    def fn():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

    return fn


def bench_extend(n: int, sweep: bool) -> list[tuple]:
    rows = []
    k_cache, v_cache, req_to_token, pool, seq_lens = _paged_kv([n], shuffle=False)
    q = torch.randn(n, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    o = torch.empty_like(q)
    starts = torch.zeros(1, dtype=torch.int32, device="cuda")
    args = (k_cache, v_cache, req_to_token, pool, seq_lens, starts, seq_lens, HEAD_DIM**-0.5)
    triton_ms = _bench_ms(lambda: ext.extend_attention_triton(q, o, *args, n))
    k, v = k_cache[1:], v_cache[1:]  # the same keys, contiguous
    shape = f"1 x {n} new, {HEADS}/{KV_HEADS} heads, d{HEAD_DIM}"
    refs = []
    varlen = _varlen_reference(q, k, v, n)
    if varlen is not None:
        refs.append(("varlen_attn (flash)", _bench_ms(varlen)))
    refs.append(("SDPA flash", _bench_ms(_sdpa_flash_reference(q, k, v))))
    for name, ref_ms in refs:
        rows.append(("extend attention", shape, triton_ms, name, ref_ms))
    shuffled = (*_paged_kv([n], shuffle=True), starts, seq_lens, HEAD_DIM**-0.5)
    shuffled_ms = _bench_ms(lambda: ext.extend_attention_triton(q, o, *shuffled, n))
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
            fn = lambda cfg=cfg: ext._launch_extend(q, o, *args, n, *cfg)  # noqa: E731
            rows.append(("  extend sweep", f"BM,BN,warps,stages={cfg}", _bench_ms(fn), "", None))
    return rows


def bench_decode(batch: int, context: int, sweep: bool) -> list[tuple]:
    k_cache, v_cache, req_to_token, pool, seq_lens = _paged_kv([context] * batch, shuffle=False)
    q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    o = torch.empty_like(q)
    args = (k_cache, v_cache, req_to_token, pool, seq_lens, HEAD_DIM**-0.5)
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * k_cache.element_size()
    floor_ms = kv_bytes / _copy_bandwidth_bytes_per_ms()
    shape = f"{batch} x {context} ctx, {HEADS}/{KV_HEADS} heads, d{HEAD_DIM}"
    splits = dec.default_num_kv_splits(batch, KV_HEADS, q.device)
    ms = _bench_ms(lambda: dec.decode_attention_triton(q, o, *args))
    rows = [("decode attention", f"{shape}, {splits} splits", ms, "bandwidth floor", floor_ms)]
    if sweep:
        ws = dec.DecodeWorkspace()
        for s in (4, 8, 16, 32):
            for block_n, warps, stages in ((64, 4, 2), (64, 4, 3), (128, 4, 2), (32, 4, 3)):
                fn = lambda s=s, b=block_n, w=warps, st=stages: dec._launch_decode(  # noqa: E731
                    q, o, *args, s, ws, b, w, st
                )
                cfg = f"splits={s} BN={block_n} warps={warps} stages={stages}"
                rows.append(("  decode sweep", cfg, _bench_ms(fn), "bandwidth floor", floor_ms))
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
        ms = _bench_ms(lambda tri=tri, args=args: tri(*args))
        ref_ms = _bench_ms(lambda twin=twin, args=args: twin(*args))
        rows.append((name, shape, ms, "torch twin (eager)", ref_ms))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time other launch configs")
    parser.add_argument("--extend-tokens", type=int, default=8192)
    parser.add_argument("--decode-batch", type=int, default=32)
    parser.add_argument("--decode-context", type=int, default=8192)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("breakgraph.bench.kernels needs a CUDA device; nothing to measure here.")
        return
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    rows = bench_extend(args.extend_tokens, args.sweep)
    rows += bench_decode(args.decode_batch, args.decode_context, args.sweep)
    rows += bench_fused(args.extend_tokens)
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


if __name__ == "__main__":
    main()
