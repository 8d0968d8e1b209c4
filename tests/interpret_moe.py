"""The fused MoE's launch variants under Triton's interpreter on CPU tensors, against the
torch twin (float32): each of the config table's flags (fused activation, sorted
intermediate rows, TMA descriptors for the weight tiles and the sorted rows, the down GEMM's
rows sorted, persistent programs looping over the tiles), and a weight TMA cannot tile (not contiguous:
loaded through pointers). Run as ``TRITON_INTERPRET=1 python -m
tests.interpret_moe`` (started so by ``test_triton_interpret.py``)."""

from __future__ import annotations

import itertools
import os
import sys

import torch

from breakgraph.kernels import fused_moe as fm


def main() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1"
    torch.manual_seed(0)
    m, e, k, hidden, inter = 7, 8, 2, 64, 48  # inter: ragged against the 32-column tiles
    x = torch.randn(m, hidden)
    gate_up = torch.randn(e, 2 * inter, hidden) * hidden**-0.5
    down = torch.randn(e, hidden, inter) * inter**-0.5
    w, ids = fm.moe_route_torch(torch.randn(m, e), k)
    ref = fm.fused_experts_torch(x, gate_up, down, w, ids)
    strided = gate_up.transpose(1, 2).contiguous().transpose(1, 2)  # same values, not contiguous
    base = fm.MoEConfig(16, 1, (32, 32, 4, 2), (32, 32, 4, 2))
    table = fm.moe_config
    failed = 0
    cases = [(flags, gate_up) for flags in itertools.product((False, True), repeat=5)]
    cases.append(((True, True, True, True, True), strided))
    try:
        for (fuse_act, sorted_h, tma, sorted_y, persistent), weights in cases:
            cfg = base._replace(
                fuse_act=fuse_act, sorted_h=sorted_h, tma=tma, sorted_y=sorted_y,
                persistent=persistent,
            )  # fmt: skip
            fm.moe_config = lambda *_, c=cfg: c
            diff = (fm.fused_experts_triton(x, weights, down, w, ids) - ref).abs().max().item()
            ok = diff <= 1e-4
            failed += not ok
            layout = "contiguous" if weights.is_contiguous() else "strided"
            print(f"{'ok' if ok else 'FAIL'} moe fuse_act={fuse_act} sorted_h={sorted_h} "
                  f"tma={tma} sorted_y={sorted_y} persistent={persistent} {layout}: "
                  f"max diff {diff:.1e}")  # fmt: skip
    finally:
        fm.moe_config = table
    return failed


if __name__ == "__main__":
    sys.exit(main())
