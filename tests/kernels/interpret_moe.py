"""The fused MoE's launch variants under Triton's interpreter on CPU tensors, against the
torch twin (float32): each of the config table's flags (fused activation, sorted
intermediate rows, TMA descriptors for the weight tiles and the sorted rows, the down GEMM's
rows sorted, persistent programs looping over the tiles, half tiles for blocks half
padding, the top-k sum by atomics in the down GEMM), a weight TMA cannot tile (not
contiguous: loaded through pointers), and the GEMV path of a few tokens. Run as
``TRITON_INTERPRET=1 python -m tests.kernels.interpret_moe`` (started so by
``test_triton_interpret.py``)."""

from __future__ import annotations

import itertools
import os
import sys

import torch

from breakgraph.common import envs
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
    return (
        failed + half_tail(gate_up, down) + atomic_sum(gate_up, down)
        + gemv(x, gate_up, down, w, ids, ref) + clamped(gate_up, down) + routes()
    )  # fmt: skip


def atomic_sum(gate_up, down) -> int:
    """``atomic_sum``: the down GEMM adds each row into its token's output row (Triton's
    atomic_add here; the 16-byte reductions are CUDA's), at 7 tokens (the one-program
    alignment) and at 300 (600 rows: the count and place kernels, three blocks), on the
    table's kind of config, with persistent programs, and with half tiles."""
    failed = 0
    table = fm.moe_config
    base = fm.MoEConfig(16, 1, (32, 32, 4, 2), (32, 32, 4, 2), atomic_sum=True)
    try:
        for m in (7, 300):
            x = torch.randn(m, gate_up.shape[2])
            w, ids = fm.moe_route_torch(torch.randn(m, gate_up.shape[0]), 2)
            ref = fm.fused_experts_torch(x, gate_up, down, w, ids)
            for flags in ({}, {"sorted_h": True, "tma": True}, {"persistent": True},
                          {"block_m": 32, "half_tail": True, "sorted_h": True}):  # fmt: skip
                cfg = base._replace(**flags)
                fm.moe_config = lambda *_, c=cfg: c
                diff = (fm.fused_experts_triton(x, gate_up, down, w, ids) - ref).abs().max().item()
                ok = diff <= 1e-4
                failed += not ok
                print(f"{'ok' if ok else 'FAIL'} moe atomic_sum m={m} {flags}: max diff {diff:.1e}")
    finally:
        fm.moe_config = table
    return failed


def half_tail(gate_up, down) -> int:
    """``half_tail``: blocks of 32 rows whose second half is padding run 16-row tiles. The
    routing is laid out so that both tiles run: expert 0 has 40 rows (a full block, then 8
    rows: half), expert 1 has 20 (a full tile over 12 padding rows), experts 2 and 3 have 10
    (half), the others none."""
    m = 40
    x = torch.randn(m, gate_up.shape[2])
    second = torch.tensor([1] * 20 + [2] * 10 + [3] * 10)[torch.randperm(m)]
    ids = torch.stack([torch.zeros(m, dtype=torch.long), second], 1)
    w = torch.softmax(torch.randn(m, 2), 1)
    ref = fm.fused_experts_torch(x, gate_up, down, w, ids)
    base = fm.MoEConfig(32, 1, (32, 32, 4, 2), (32, 32, 4, 2), half_tail=True)
    table = fm.moe_config
    failed = 0
    try:
        for fuse_act, sorted_h, tma, sorted_y in (
            (True, True, True, False),
            (False, False, False, False),
            (True, True, True, True),
            (True, False, True, True),
        ):
            cfg = base._replace(fuse_act=fuse_act, sorted_h=sorted_h, tma=tma, sorted_y=sorted_y)
            fm.moe_config = lambda *_, c=cfg: c
            diff = (fm.fused_experts_triton(x, gate_up, down, w, ids) - ref).abs().max().item()
            ok = diff <= 1e-4
            failed += not ok
            print(
                f"{'ok' if ok else 'FAIL'} moe half_tail fuse_act={fuse_act} "
                f"sorted_h={sorted_h} tma={tma} sorted_y={sorted_y}: max diff {diff:.1e}"
            )
    finally:
        fm.moe_config = table
    return failed


def routes() -> int:
    """The routing kernel against float64 scores: softmax and sigmoid, and DeepSeek V4's
    sqrt(softplus) chosen with a correction bias and scaled (256 experts, top 6); its experts
    must be the top k by score (plus bias), up to float32 rounding at a near-tie, and its
    weights theirs. Not against the float32 torch twin: torch's softplus is not as close on
    every CPU (off by 2e-4 on one of CI's machines)."""
    failed = 0
    torch.manual_seed(1)  # its own draws, whatever the cases before it consumed
    cases = (
        (8, 2, "softmax", {}),
        (8, 3, "sigmoid", {}),
        (256, 6, "sqrtsoftplus", {"bias": torch.randn(256) * 0.1, "factor": 1.5}),
        (32, 6, "sqrtsoftplus", {"factor": 2.5}),
    )
    for e, k, scoring, extra in cases:
        logits = torch.randn(37, e)
        w, ids = fm.moe_route_triton(logits, k, scoring, True, None, **extra)
        scores = fm._scores(logits, scoring, torch.float64)
        sel = scores + extra.get("bias", torch.zeros(e)).double()
        picked = sel.gather(1, ids.long()).sort(1).values
        gap = (picked - sel.topk(k, 1).values.sort(1).values).abs().max().item()
        exact = scores.gather(1, ids.long())
        exact = exact / exact.sum(1, keepdim=True) * extra.get("factor", 1.0)
        diff = (w.double() - exact).abs().max().item()
        ok = gap <= 1e-6 and diff <= 1e-5
        failed += not ok
        print(f"{'ok' if ok else 'FAIL'} moe route {scoring} e={e} k={k}: max diff {diff:.1e}"
              f", picks off the top k by {gap:.1e}")  # fmt: skip
    return failed
    return failed


def clamped(gate_up, down) -> int:
    """DeepSeek V4's clamped SwiGLU (``limit``): the gate/up GEMM unfused, the clamp between
    the GEMMs; a fused-activation config, sorted rows with the top-k sum by atomics, a few
    tokens on the grouped path and on the GEMV path (its epilogue clamps)."""
    failed = 0
    table = fm.moe_config
    base = fm.MoEConfig(16, 1, (32, 32, 4, 2), (32, 32, 4, 2))
    try:
        for m, flags, gemv in ((7, {"fuse_act": True}, 0),
                               (7, {"sorted_h": True, "atomic_sum": True}, 0), (3, {}, 0),
                               (3, {}, 4)):  # fmt: skip
            x = torch.randn(m, gate_up.shape[2])
            w, ids = fm.moe_route_torch(torch.randn(m, gate_up.shape[0]), 2)
            ref = fm.fused_experts_torch(x, gate_up, down, w, ids, "silu", 0.5)
            cfg = base._replace(**flags)
            fm.moe_config = lambda *_, c=cfg: c
            with envs.MOE_GEMV.override(gemv):
                got = fm.fused_experts_triton(x, gate_up, down, w, ids, "silu", 0.5)
            diff = (got - ref).abs().max().item()
            ok = (
                diff <= 1e-4
                and (ref - fm.fused_experts_torch(x, gate_up, down, w, ids)).abs().max() > 1e-3
            )
            failed += not ok
            print(f"{'ok' if ok else 'FAIL'} moe clamped m={m} {flags} gemv={gemv}: "
                  f"max diff {diff:.1e}")  # fmt: skip
    finally:
        fm.moe_config = table
    return failed


def gemv(x, gate_up, down, w, ids, ref) -> int:
    """The GEMV path of a few tokens (two launches, no alignment): each activation, the
    default config and one with ragged tiles, and the dispatch of
    ``fused_experts_triton`` up to ``BREAKGRAPH_MOE_GEMV`` tokens."""
    failed = 0
    # gate/up's columns and down's K ragged against the intermediate size (48), down's
    # columns past the hidden size (64)
    ragged = fm.MoEGemvConfig(gate_up=(32, 32, 4), down=(128, 32, 2))
    for m in (1, 3):
        for act in fm.ACTIVATIONS:
            want = fm.fused_experts_torch(x[:m], gate_up, down, w[:m], ids[:m], act)
            for cfg in (None, ragged):
                got = fm.fused_experts_gemv_triton(x[:m], gate_up, down, w[:m], ids[:m], act, cfg)
                diff = (got - want).abs().max().item()
                ok = got.shape == want.shape and diff <= 1e-4
                failed += not ok
                print(
                    f"{'ok' if ok else 'FAIL'} moe gemv m={m} {act} cfg={cfg}: max diff {diff:.1e}"
                )
    with envs.MOE_GEMV.override(4):
        diff = (fm.fused_experts_triton(x[:4], gate_up, down, w[:4], ids[:4]) - ref[:4]).abs().max()
    ok = diff.item() <= 1e-4
    failed += not ok
    print(f"{'ok' if ok else 'FAIL'} moe gemv dispatch: max diff {diff.item():.1e}")
    return failed


if __name__ == "__main__":
    sys.exit(main())
