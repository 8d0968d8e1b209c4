"""DeepSeek V4's hyper-connection kernels (kernels/hyper_connection.py) under Triton's
interpreter on CPU tensors, against their torch twins (float32): the mixes' GEMM (bf16
streams, float32 weights; split over programs and not), the collapse with its
Sinkhorn-normalised mix, the hyper head's collapse (no mix), and the expansion, on a hidden
size that is not a multiple of the block. Run as ``TRITON_INTERPRET=1 python -m
tests.kernels.interpret_hyper`` (started so by ``test_triton_interpret.py``)."""

from __future__ import annotations

import os
import sys

import torch

from breakgraph.kernels import hyper_connection as hc


def check(name: str, got, want) -> int:
    diff = max((g - w).abs().max().item() for g, w in zip(got, want, strict=True))
    ok = diff <= 2e-5
    print(f"{'ok' if ok else 'FAIL'} {name}: max diff {diff:.1e}")
    return int(not ok)


def main() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1"
    torch.manual_seed(0)
    t, n, hidden = 5, 4, 1100  # two blocks of 1024, the second ragged
    streams = torch.randn(t, n, hidden)
    mixes = torch.randn(t, (2 + n) * n)
    base, scale = torch.randn((2 + n) * n), torch.randn(3)
    args = (streams, mixes, base, scale, 20, 1e-6, 1e-6)
    flat, fn = streams.flatten(1).to(torch.bfloat16), torch.randn((2 + n) * n, n * hidden) / 64
    failed = 0
    for rows in (1, 5, 70):  # the reduction split over programs; one block of rows; two
        x = flat[torch.arange(rows) % t]
        failed += check(
            f"hc mixes t={rows}", [hc.hc_mixes_triton(x, fn)], [hc.hc_mixes_torch(x, fn)]
        )
        head = [hc.hc_mixes_triton(x, fn[:n].contiguous(), splits=1)]
        failed += check(f"hc head mixes t={rows}", head, [hc.hc_mixes_torch(x, fn[:n])])
    failed += check("hc collapse", hc.hc_collapse_triton(*args), hc.hc_collapse_torch(*args))
    head = (streams, mixes[:, :n].contiguous(), base[:n], scale[:1], 0, 1e-6, 1e-6, False)
    failed += check("hc head", hc.hc_collapse_triton(*head)[2:], hc.hc_collapse_torch(*head)[2:])
    post, comb, _ = hc.hc_collapse_torch(*args)
    out = torch.randn(t, hidden)
    failed += check(
        "hc expand",
        [hc.hc_expand_triton(streams, out, post, comb)],
        [hc.hc_expand_torch(streams, out, post, comb)],
    )
    return failed


if __name__ == "__main__":
    sys.exit(main())
