"""``bench kernels --tflops``: its FLOP count, its table and its flag (the kernels run on
CUDA only)."""

from __future__ import annotations

import torch

from breakgraph.bench.attention_tflops import attention_flops, format_tflops


def test_flops_count_the_keys_each_causal_row_sees():
    # 3 new rows after 2 cached: they see 3, 4 and 5 keys; 4 FLOPs per key, head channel, head
    assert attention_flops(2, 3, heads=1, head_dim=1) == 4 * (3 + 4 + 5)
    assert attention_flops(0, 8192, 32, 128) == 4 * 32 * 128 * 8192 * 8193 // 2
    # against the matmuls themselves, masked: QK^T and PV of a 5 x 7 causal bottom-right block
    n, p, d = 5, 2, 4
    mask = torch.ones(n, n + p).tril(diagonal=p)
    assert attention_flops(p, n, 1, d) == 2 * 2 * d * mask.sum().item()


def test_the_table_gives_each_row_its_share_of_the_matrix_rate():
    rows = [{"case": "8192 new causal", "head_dim": 128, "heads": "32/8", "kernel": "triton",
             "ms": 2.0, "tflops": 450.0}]  # fmt: skip
    lines = format_tflops(rows, 750.0)
    assert lines[0] == "matrix rate (bf16 GEMM 8192^3, cuBLAS): 750 TFLOP/s"
    assert lines[-1] == "| 8192 new causal | 128 | 32/8 | triton | 2.000 | 450 | 60% |"


def test_the_flag_takes_head_sizes_or_none():
    from breakgraph.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["bench", "kernels", "--tflops"]).tflops == []
    assert parser.parse_args(["bench", "kernels", "--tflops", "128"]).tflops == [128]
    assert parser.parse_args(["bench", "kernels"]).tflops is None
