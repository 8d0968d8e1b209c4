"""The flags of the benches of one kernel or layer (moe, gemm, kernels, allreduce), and the
flag groups every bench shares; bench/args.py registers the subcommands."""

from __future__ import annotations


def add_tp(p) -> None:
    p.add_argument("--tp-size", "--tp", type=int, default=1, help="tensor-parallel ranks (CUDA)")
    p.add_argument(
        "--disable-custom-all-reduce",
        action="store_true",
        help="TP on CUDA: every all-reduce on NCCL (the engine's flag)",
    )


def add_outputs(p, plot: str | None = None) -> None:
    p.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON")
    if plot:
        p.add_argument("--plot", default=None, metavar="FILE.png", help=plot)


def add_models(p, default: list[str]) -> None:
    p.add_argument(
        "--models", nargs="+", default=default, help="built-in configs, run on dummy weights"
    )


def add_device(p, default: str = "auto") -> None:
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default=default,
        help="auto: CUDA where torch sees a GPU",
    )


def add_moe_args(p) -> None:
    add_models(p, ["qwen3-30b-a3b"])
    p.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=[1, 8, 32, 64, 256, 1024, 8192],
        help="tokens per step (M)",
    )
    p.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="FLAG=0|1",
        help="override the table's variant flags for the whole run (e.g. sorted_y=1 tma=0)",
    )
    g = p.add_argument_group("tuning the grouped path (fused_moe's config table)")
    g.add_argument("--sweep", action="store_true", help="search launch configs per M")
    g.add_argument("--sweep-block-m", type=int, nargs="+", help="the sweep's BLOCK_M values")
    g.add_argument(
        "--sweep-table-flags",
        action="store_true",
        help="the sweep keeps the table's variant flags and searches the tiles only",
    )
    g.add_argument("--breakdown", action="store_true", help="time each kernel (profiler)")
    g.add_argument(
        "--ab",
        metavar="FLAG | gate_up=BN,BK,WARPS,STAGES | down=...",
        help="a variant flag off and on, or one GEMM's tile against the table's: both graph "
        "replays alternating in one process",
    )
    g.add_argument("--rounds", type=int, default=5, help="--ab: alternating rounds")
    g = p.add_argument_group("the GEMV path of a few tokens (fused_moe's GEMV table)")
    g.add_argument(
        "--gemv",
        type=int,
        default=0,
        metavar="N",
        help="steps of up to N tokens: the GEMV path against the grouped one, both graphs",
    )
    g.add_argument(
        "--gemv-sweep",
        action="store_true",
        help="with --gemv: first search the GEMV path's block sizes at each such M",
    )
    g.add_argument(
        "--gemv-kernels",
        action="store_true",
        help="only the GEMV path's two kernels, each alone, every config, per M in --tokens",
    )
    g.add_argument("--procs", type=int, default=None, help="--gemv-kernels: compile processes")
    add_outputs(p)


def add_gemm_args(p) -> None:
    add_models(p, ["qwen3-0.6b", "llama-3.1-8b"])
    p.add_argument("--m", nargs="+", type=int, default=[1, 4, 16, 64], help="rows (tokens)")
    p.add_argument(
        "--tp", nargs="+", type=int, default=[1], help="also each rank's shapes at these TP sizes"
    )
    p.add_argument("--min-gain", type=float, default=0.03, help="keep configs this much faster")
    p.add_argument(
        "--gemv",
        action="store_true",
        help="the batch-1 GEMV kernel's configs per shape instead (the table's one-row entries)",
    )
    p.add_argument("--only", nargs="+", metavar="NAME", help="--gemv: only these projections")
    p.add_argument("--procs", type=int, default=None, help="--gemv: compile processes")
    p.add_argument(
        "--table-out",
        metavar="PATH",
        help="also write the table as JSON (served by BREAKGRAPH_SKINNY=PATH, no edit)",
    )
    add_outputs(p)


def add_kernels_args(p) -> None:
    p.add_argument("--sweep", action="store_true", help="also time other launch configs")
    p.add_argument("--extend-tokens", type=int, default=8192, help="extend cases' new tokens")
    p.add_argument("--decode-batch", type=int, default=32, help="decode cases' requests")
    p.add_argument("--decode-context", type=int, default=8192, help="decode cases' context")
    p.add_argument("--prefix", type=int, default=32768, help="long-prefix case's prefix")
    p.add_argument(
        "--long-prefix-only", action="store_true", help="only the long-prefix extend cases"
    )
    p.add_argument(
        "--decode-sweep", action="store_true",
        help="only decode attention at --sweep-batches x --sweep-contexts, timed inside a CUDA "
        "graph over KV copies that miss the L2 cache, against the bandwidth floor",
    )  # fmt: skip
    p.add_argument(
        "--v4-attention", action="store_true",
        help="only DeepSeek V4's sparse attention at V4-Flash's shapes (CSA and HCA layers; "
        "1K and 8K new tokens, 1K over a 64K prefix, 1 and 32 decode rows over 8K) in each "
        "launch config, against a dense GEMM of the same FLOPs",
    )  # fmt: skip
    p.add_argument(
        "--mixed", action="store_true",
        help="only a mixed step's attention (prefill rows, then one-row requests) as the engine "
        "plans it (the one-row requests on the decode kernel) against one extend launch",
    )  # fmt: skip
    p.add_argument(
        "--tflops", type=int, nargs="*", metavar="HEAD_DIM", default=None,
        help="only prefill attention's TFLOP/s against a bf16 GEMM's, per head size (default "
        "128 512): 1K, 8K, 32K causal and 1K over 16K and 64K cached; Triton, FlashInfer, "
        "torch's varlen flash; with --sweep the Triton kernel at other tiles too",
    )  # fmt: skip
    p.add_argument(
        "--sweep-batches", type=int, nargs="+", default=[1, 8, 64],
        help="--decode-sweep: requests per case",
    )  # fmt: skip
    p.add_argument(
        "--sweep-contexts", type=int, nargs="+", default=[8192, 16384, 65536],
        help="--decode-sweep: keys per request",
    )  # fmt: skip


def add_allreduce_args(p) -> None:
    p.add_argument("--tp", type=int, default=2, help="ranks (GPUs)")
    p.add_argument(
        "--kib",
        type=int,
        nargs="+",
        default=[8, 16, 32, 64, 128, 256, 512, 1024, 4096],
        help="message sizes",
    )
    p.add_argument("--ops", type=int, default=64, help="all-reduces per graph (a step's)")
    p.add_argument(
        "--norm-rows",
        type=int,
        nargs="*",
        default=[],
        help="also the fused all-reduce + add + RMSNorm at these row counts (e.g. 1 8 64)",
    )
    p.add_argument("--hidden", type=int, default=4096, help="the fused norm's row width")
