"""Flags of ``bench step`` and ``bench decode``, apart from their code: building the CLI parser
(``breakgraph serve`` included) must not import torch."""

from __future__ import annotations


def _add_custom_all_reduce(p) -> None:
    p.add_argument(
        "--disable-custom-all-reduce",
        action="store_true",
        help="TP on CUDA: every all-reduce on NCCL (the engine's flag)",
    )


def add_step_args(p) -> None:
    p.add_argument("--models", nargs="+", default=["qwen3-0.6b"])
    p.add_argument("--new-tokens", "-N", type=int, nargs="+", default=[256, 1024, 8192])
    p.add_argument("--prefix-tokens", "-P", type=int, nargs="+", default=[0])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--compile-timeout", type=float, default=120.0)
    p.add_argument("--tp-size", "--tp", type=int, default=1, help="tensor-parallel ranks")
    _add_custom_all_reduce(p)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, metavar="FILE.png", help="step ms against N")


def add_decode_args(p) -> None:
    p.add_argument("--models", nargs="+", default=["qwen3-0.6b"])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--device", default="auto")
    p.add_argument("--tp-size", "--tp", type=int, default=1, help="tensor-parallel ranks")
    _add_custom_all_reduce(p)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, metavar="FILE.png", help="step ms against batch size")
    p.add_argument(
        "--profile",
        action="store_true",
        help="CUDA: where a step's GPU time goes (GEMM, attention, all-reduce, other kernels)",
    )
