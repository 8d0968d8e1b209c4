"""The MoE layer's GEMMs on torch's grouped GEMM (``torch._grouped_mm``, CUTLASS on sm90:
device offsets, no padding, capturable) against the Triton grouped GEMMs, in one process.

Per M (qwen3-30b-a3b expert shapes, bf16, routing from random logits), do_bench ms of:
- the table's Triton layer, graph-replayed, and the dense cuBLAS pair of the same FLOPs;
- each piece of a grouped-mm layer: x's rows gathered in sorted order, gate/up, SiLU-and-mul,
  down, the top-k sum; and the whole chain graph-replayed (capture-safety), with its output
  against the Triton layer's;
- the hybrid: the Triton gate/up writing its rows in sorted (block-padded) order, then down
  on the grouped GEMM over the padded groups.
Usage: python benchmarks/moe_grouped_mm.py [M ...]   (default 1024 8192)"""

from __future__ import annotations

import sys

import torch

from breakgraph.bench import moe as bm
from breakgraph.bench.kernels import bench_ms
from breakgraph.kernels import fused_moe as fm
from breakgraph.kernels import ops
from breakgraph.kernels.fused import silu_and_mul_triton


def group_ends(ids: torch.Tensor, experts: int, block: int) -> torch.Tensor:
    """Each expert's end row in the sorted order, its group padded to ``block`` rows."""
    counts = torch.zeros(experts, dtype=torch.int32, device=ids.device)
    counts.index_add_(0, ids.reshape(-1).long(), torch.ones_like(ids.reshape(-1)))
    padded = (counts + block - 1) // block * block
    return padded.cumsum(0).to(torch.int32)


def sum_rows(y: torch.Tensor, inverse: torch.Tensor, m: int, top_k: int) -> torch.Tensor:
    out = torch.empty((m, y.shape[1]), dtype=y.dtype, device=y.device)
    block = min(1024, fm.triton.next_power_of_2(y.shape[1]))
    fm._moe_sum_kernel[(m, fm.triton.cdiv(y.shape[1], block))](
        y, inverse, out, y.shape[1], y.stride(0), out.stride(0), TOP_K=top_k, BLOCK=block,
        SORTED=True, num_warps=4,
    )  # fmt: skip
    return out


def run(m: int) -> None:
    s = bm.expert_shapes("qwen3-30b-a3b")
    layer = bm.Layer(m, s)
    e, k, inter = s["experts"], s["top_k"], s["inter"]
    w, ids = ops.moe_route(layer.logits[0], k)
    x, gu_w, dn_w = layer.x, layer.gate_up, layer.down
    gu_t, dn_t = gu_w.transpose(1, 2), dn_w.transpose(1, 2)  # [E, K, N], column-major per group

    t_layer = bench_ms(bm.graphed(layer))
    t_dense = bench_ms(bm.dense_reference(m, s))
    up_d, down_d = bm.dense_halves(m, s)
    print(f"M={m}: triton layer graph {t_layer:.3f} ms, dense {t_dense:.3f} "
          f"(gate/up {up_d:.3f}, down {down_d:.3f}); layer/dense {t_layer / t_dense:.2f}x")  # fmt: skip

    # unpadded: every group its own rows
    sorted_ids, _, _, inverse = fm.moe_align(ids, e, 1, inverse=True)
    offs = group_ends(ids, e, 1)
    tok = (sorted_ids // k).long()
    ws = w.reshape(-1)
    pieces = {
        "align(bm=1)": lambda: fm.moe_align(ids, e, 1, inverse=True),
        "gather": lambda: x.index_select(0, tok),
    }
    xs = x.index_select(0, tok)
    pieces["gate/up gmm"] = lambda: torch._grouped_mm(xs, gu_t, offs=offs)
    gu = torch._grouped_mm(xs, gu_t, offs=offs)
    pieces["silu_mul"] = lambda: silu_and_mul_triton(gu)
    hs = silu_and_mul_triton(gu)
    pieces["down gmm"] = lambda: torch._grouped_mm(hs, dn_t, offs=offs)
    y = torch._grouped_mm(hs, dn_t, offs=offs)
    pieces["topk sum"] = lambda: sum_rows(y, inverse, m, k)
    total = 0.0
    for name, fn in pieces.items():
        ms = bench_ms(fn)
        total += ms
        print(f"  gmm {name:12s} {ms:.3f} ms", flush=True)
    print(f"  gmm pieces total {total:.3f} ms ({total / t_dense:.2f}x dense)")

    def chain():
        sid, _, _, inv = fm.moe_align(ids, e, 1, inverse=True)
        xs = x.index_select(0, (sid // k).long())
        h = silu_and_mul_triton(torch._grouped_mm(xs, gu_t, offs=offs))
        # routing weights applied on the sorted rows before the sum
        y = torch._grouped_mm(h, dn_t, offs=offs) * ws.index_select(0, sid.long())[:, None].to(
            h.dtype
        )
        return sum_rows(y, inv, m, k)

    try:
        g, out = bm.capture(chain)
        ms = bench_ms(g.replay)
        ref = ops.fused_experts(x, gu_w, dn_w, w, ids, "silu")
        err = (out.float() - ref.float()).abs().max().item() / ref.float().abs().max().item()
        print(
            f"  gmm chain graph {ms:.3f} ms ({ms / t_dense:.2f}x dense), rel err vs triton {err:.2e}"
        )
    except Exception as ex:  # noqa: BLE001
        print(f"  gmm chain graph failed: {type(ex).__name__}: {str(ex)[:200]}")

    # hybrid: Triton gate/up into sorted padded rows, then down on the grouped GEMM
    cfg = fm.moe_config(m, k, e)
    align = fm.moe_align(ids, e, cfg.block_m, inverse=True)
    pad_offs = group_ends(ids, e, cfg.block_m)
    h_pad = torch.empty((align[0].shape[0], inter), dtype=x.dtype, device=x.device)

    def gate_up_sorted():
        fm._launch_gemm(
            x, gu_w, h_pad, w.float(), align, k, inter, cfg.block_m, cfg.group_m, cfg.gate_up,
            A_PER_TOKEN=True, GATED=True, GELU=False, MUL_WEIGHT=False, tma=cfg.tma,
            A_SORTED=False, C_SORTED=True,
        )  # fmt: skip

    print(f"  hybrid triton gate/up (sorted, bm {cfg.block_m}) {bench_ms(gate_up_sorted):.3f} ms")
    gate_up_sorted()
    print(
        f"  hybrid down gmm (padded groups) {bench_ms(lambda: torch._grouped_mm(h_pad, dn_t, offs=pad_offs)):.3f} ms"
    )
    y_pad = torch._grouped_mm(h_pad, dn_t, offs=pad_offs)
    print(
        f"  hybrid topk sum {bench_ms(lambda: sum_rows(y_pad, align[3], m, k)):.3f} ms", flush=True
    )


if __name__ == "__main__":
    for m in [int(a) for a in sys.argv[1:]] or [1024, 8192]:
        run(m)
