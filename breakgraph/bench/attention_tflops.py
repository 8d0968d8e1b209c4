"""``bench kernels --tflops``: prefill (extend) attention's throughput against the chip's
matrix rate, measured in the same run (#56's kernel table).

Cases: N new tokens after P cached ones, one request, causal (bottom-right aligned: new row
i sees P + i + 1 keys), over the paged KV the engine reads: N = 1K, 8K, 32K at P = 0 and 1K
over 16K and 64K. Head sizes 128 (Llama-3.1-8B's 32 query and 8 KV heads) and 512 (Gemma
4's full layers: 8 and 1). Each case runs the Triton kernel as the engine plans it
(``extend_attention_triton`` with the step's longest sequence known, so a long prefix takes
the split-KV path), FlashInfer's batch prefill where it imports and serves the head size (its
Hopper backend, FA3's kernels: 64-256), and torch's varlen flash attention where it serves
the shape. TFLOP/s counts the two matmuls' multiply-adds of the keys each row sees (causal
tiles skipped count nothing); the matrix rate is a dense bf16 GEMM's, timed here too.
"""

from __future__ import annotations

from dataclasses import replace

import torch

CASES = ((0, 1024), (0, 8192), (0, 32768), (16384, 1024), (65536, 1024))  # (P, N)
HEADS = {128: (32, 8), 256: (16, 8), 64: (32, 8), 512: (8, 1)}  # head size -> (q, kv) heads
# --sweep: the one-pass Triton kernel at these (BLOCK_M, BLOCK_N, warps, stages[, BLOCK_DV])
# too, on the 8K causal case and 1K over 16K (there also the split kernel at each tile, with
# the key splits its heuristic picks); BLOCK_DV < 512: the value split, each program a share
# of the output columns
TILE_SWEEP = {
    512: [(16, 32, 4, 2), (32, 32, 4, 2), (32, 64, 4, 2), (32, 64, 8, 2), (64, 32, 8, 2),
          (64, 32, 8, 1), (64, 64, 8, 1), (32, 16, 4, 3), (16, 64, 4, 2),
          (64, 32, 4, 2, 256), (64, 32, 8, 2, 256), (64, 64, 8, 2, 256), (128, 32, 8, 2, 256),
          (64, 32, 4, 2, 128), (128, 32, 8, 2, 128)],
    256: [(64, 32, 8, 2), (64, 64, 8, 2), (128, 32, 8, 2), (128, 64, 8, 1), (64, 64, 4, 2)],
    128: [(128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 2), (64, 128, 4, 3), (128, 64, 4, 3)],
}  # fmt: skip
SWEEP_CASES = ((0, 8192), (16384, 1024))


def attention_flops(prefix: int, new: int, heads: int, head_dim: int) -> float:
    """Causal attention's matmul FLOPs: QK^T and PV, two FLOPs per multiply-add, over the
    keys each of the ``new`` rows sees (row i: ``prefix + i + 1``)."""
    keys = new * prefix + new * (new + 1) // 2
    return 4.0 * heads * head_dim * keys


def matrix_tflops(bench_ms, n: int = 8192) -> float:
    """A dense bf16 GEMM's rate (n x n x n, cuBLAS): the chip's matrix rate as measured."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2.0 * n**3 / bench_ms(lambda: a @ b) / 1e9


def bench_tflops(head_dims: list[int], bench_ms, paged_kv, sweep: bool = False) -> list[dict]:
    """Rows ``{case, head_dim, kernel, ms, tflops}`` per case, head size and kernel.
    ``paged_kv(lens, shuffle, kv_heads=, head_dim=)``: ``bench kernels``' KV builder;
    ``sweep``: the Triton kernel at :data:`TILE_SWEEP`'s tiles too (:data:`SWEEP_CASES`)."""
    from breakgraph.bench.attention_refs import (
        flashinfer_reference,
        one_request_extend,
        varlen_reference,
    )
    from breakgraph.kernels import extend_attention as ext
    from breakgraph.kernels import flashinfer_extend as fi

    rows = []
    for head_dim in head_dims:
        heads, kv_heads = HEADS[head_dim]
        for prefix, new in CASES:
            seq = prefix + new
            k_cache, v_cache, meta = paged_kv([seq], False, kv_heads=kv_heads, head_dim=head_dim)
            meta = replace(one_request_extend(meta, new), max_seq_len=seq)
            q = torch.randn(new, heads, head_dim, device=k_cache.device, dtype=k_cache.dtype)
            o = torch.empty_like(q)
            scale = head_dim**-0.5
            args = (q, o, k_cache, v_cache, meta, scale)
            kernels = [("triton", lambda args=args: ext.extend_attention_triton(*args))]
            if sweep and (prefix, new) in SWEEP_CASES:
                for cfg in TILE_SWEEP.get(head_dim, []):
                    plan = ext.ExtendPlan(q, k_cache, meta, scale, config=cfg, splits=0)
                    tile = lambda p=plan, a=args: p(a[0], a[1], a[2], a[3])  # noqa: E731
                    kernels.append(
                        ("triton BM,BN,warps,stages[,DV]=" + ",".join(map(str, cfg)), tile)
                    )
                    if not prefix:
                        continue
                    split = ext.ExtendPlan(q, k_cache, meta, scale, config=cfg)
                    if split.splits:  # the split path the heuristic picks, at this tile
                        tile = lambda p=split, a=args: p(a[0], a[1], a[2], a[3])  # noqa: E731
                        name = f"triton split {split.splits} at " + ",".join(map(str, cfg))
                        kernels.append((name, tile))
            if head_dim in fi.HEAD_DIMS:
                flash = flashinfer_reference(q, k_cache, v_cache, meta, seq)
                if flash is not None:
                    kernels.append(("flashinfer fa3 (paged)", flash))
            varlen = varlen_reference(q, k_cache[1:], v_cache[1:], new, seq)
            if varlen is not None:
                kernels.append(("torch varlen flash", varlen))
            kernels[0][1]()
            ref = o.clone()
            for name, fn in list(kernels[1:]):  # the same problem: their outputs agree
                try:
                    out = fn()
                except Exception as e:  # noqa: BLE001 - a tile past the chip's resources
                    print(f"  d{head_dim} {name}: {type(e).__name__}: {str(e)[:120]}")
                    kernels.remove((name, fn))
                    continue
                out = o if out is None else out[0] if isinstance(out, tuple) else out
                diff = (out.float() - ref.float()).abs().max().item()
                print(f"  d{head_dim} {new} new + {prefix}: |{name} - triton| max {diff:.2e}")
            flops = attention_flops(prefix, new, heads, head_dim)
            label = f"{new} new" + (f" + {prefix} cached" if prefix else " causal")
            for name, fn in kernels:
                ms = bench_ms(fn)
                rows.append({"case": label, "head_dim": head_dim, "heads": f"{heads}/{kv_heads}",
                             "kernel": name, "ms": ms, "tflops": flops / ms / 1e9})  # fmt: skip
            del k_cache, v_cache, q, o, ref, args, kernels
    return rows


def format_tflops(rows: list[dict], rate: float) -> list[str]:
    """The table: each row's TFLOP/s and its share of the matrix rate ``rate``."""
    lines = [f"matrix rate (bf16 GEMM 8192^3, cuBLAS): {rate:.0f} TFLOP/s",
             "| case | d | heads | kernel | ms | TFLOP/s | of matrix rate |",
             "|---|---:|---|---|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['case']} | {r['head_dim']} | {r['heads']} | {r['kernel']} | "
                     f"{r['ms']:.3f} | {r['tflops']:.0f} | {r['tflops'] / rate:.0%} |")  # fmt: skip
    return lines
