"""``breakgraph bench moe``: the fused Triton MoE layer against references measured in the same
run, and the tables of kernels/fused_moe.py it regenerates.

Per token count M, one MoE layer of the model's expert shapes (bf16, routing from random
logits: about uniform over the experts): routing + experts (what ``ops`` runs) against

- a dense bf16 cuBLAS GEMM pair of the same active FLOPs (M*K rows through [H, 2I], then
  their first I columns through [I, H]): the goal at M = 8K is <= 1.4x its time;
- the bandwidth floor: the bytes of the experts the step touches (distinct experts x 3*H*I
  x 2) at the measured device copy bandwidth: the goal at decode sizes (M = 1..64).

Each timed call routes new logits (a cycle of 16), so small steps read experts that are not
all in L2. "moe ms" launches the kernels from Python, as an eager step does: at decode sizes
that is paced by the host. "graph ms" replays the layer captured in a CUDA graph, as the
decode and prefill graphs run it (plus one copy of the next routing logits): the GPU's time,
which the floor ratio uses. The grouped path's config search, kernel breakdown and A/B are in
moe_tune.py; the GEMV path of a few tokens in moe_gemv.py; the layer itself in moe_layer.py.
"""

from __future__ import annotations

import json

import torch

from breakgraph.bench.kernels import bench_ms, copy_bandwidth_bytes_per_ms
from breakgraph.bench.moe_layer import (
    VARIANT_FLAGS,
    Layer,
    dense_reference,
    expert_shapes,
    graphed,
)
from breakgraph.kernels import fused_moe as fm


def parse_flag_overrides(items: list[str]) -> dict[str, bool]:
    """``["sorted_y=1", ...]`` -> ``{"sorted_y": True}``; a bad item is a usage error."""
    out = {}
    for item in items:
        name, _, value = item.partition("=")
        if name not in VARIANT_FLAGS or value not in ("0", "1"):
            raise SystemExit(
                f"error: --set {item!r}: expected FLAG=0|1, FLAG one of {VARIANT_FLAGS}"
            )
        out[name] = value == "1"
    return out


def run_moe_bench(args) -> list[dict]:
    from breakgraph.bench import moe_gemv, moe_tune

    overrides = parse_flag_overrides(args.set)
    if not torch.cuda.is_available():
        raise SystemExit("error: bench moe needs a CUDA device")
    if args.gemv_kernels:
        return moe_gemv.run_gemv_kernels(args)
    if args.ab:
        return moe_tune.run_ab(args)
    if overrides:
        table = fm.moe_config
        fm.moe_config = lambda *a: table(*a)._replace(**overrides)
        print(f"table flags overridden: {overrides}")
    bw = copy_bandwidth_bytes_per_ms()
    rows, tuned = [], []
    for model in args.models:
        s = expert_shapes(model)
        print(f"{torch.cuda.get_device_name()}  {model}: {s}  copy {bw / 1e6:.0f} GB/s")
        print("M      moe ms  graph ms   dense ms  graph/dense  floor ms  graph/floor  "
              "|moe - twin|/|twin|")  # fmt: skip
        for m in args.tokens:
            layer = Layer(m, s)
            moe, graph = bench_ms(layer), bench_ms(graphed(layer))
            dense = bench_ms(dense_reference(m, s))
            floor, rel = layer.touched_bytes() / bw, layer.error()
            print(f"{m:<6} {moe:7.3f} {graph:9.3f} {dense:10.3f} {graph / dense:11.2f}x "
                  f"{floor:9.3f} {graph / floor:11.2f}x  {rel:.1e}", flush=True)  # fmt: skip
            row = dict(model=model, m=m, moe_ms=moe, graph_ms=graph, dense_ms=dense,
                       floor_ms=floor, rel_error=rel)  # fmt: skip
            if m <= args.gemv:
                row.update(moe_gemv.gemv_row(layer, args.gemv, floor, args.gemv_sweep))
            if args.breakdown:
                moe_tune.breakdown(layer)
            if args.sweep:
                cfg, ms = moe_tune.sweep(layer, args.sweep_block_m, args.sweep_table_flags)
                tuned.append((m * s["top_k"] / s["experts"], cfg, ms, moe))
                print(f"  best {cfg}: {ms:.3f} ms (default {moe:.3f})", flush=True)
            rows.append(row)
    if tuned:
        print("\n# fused_moe._CONFIGS candidates (mean rows per expert, config; ms vs default):")
        for mean_rows, cfg, ms, moe in tuned:
            print(f"    ({mean_rows:g}, {cfg!r}),  # {ms:.3f} ms vs {moe:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows
