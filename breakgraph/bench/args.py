"""The ``breakgraph bench`` subcommands and their flags, apart from their code: building the CLI
parser (``breakgraph serve`` included) imports neither torch nor a bench's own dependencies.

Each subcommand names the function that runs it (``module:function``), imported only when
that subcommand runs.
"""

from __future__ import annotations

import argparse
import importlib

from breakgraph.bench.kernel_args import (
    add_allreduce_args,
    add_device,
    add_gemm_args,
    add_kernels_args,
    add_models,
    add_moe_args,
    add_outputs,
    add_tp,
)
from breakgraph.bench.peers import PEERS_EXAMPLE, PEERS_HELP, add_peers_args

DEFAULT_URL = "http://127.0.0.1:30000"


def add_step_args(p) -> None:
    add_models(p, ["qwen3-0.6b"])
    p.add_argument(
        "--new-tokens", "-N", type=int, nargs="+", default=[256, 1024, 8192], help="the step's N"
    )
    p.add_argument(
        "--prefix-tokens", "-P", type=int, nargs="+", default=[0], help="cached tokens before N"
    )
    p.add_argument("--reps", type=int, default=10, help="timed calls per arm (their median)")
    add_device(p)
    p.add_argument(
        "--dtype",
        choices=["auto", "bfloat16", "float16", "float32"],
        default="auto",
        help="auto: bfloat16 on CUDA, float32 on the CPU",
    )
    p.add_argument("--no-hf", action="store_true", help="no HF transformers arms")
    p.add_argument("--no-compile", action="store_true", help="no HF torch.compile arm")
    p.add_argument(
        "--compile-timeout", type=float, default=120.0, help="seconds HF's torch.compile may take"
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="CUDA: per arm, the GPU's span and busy time, the delay to its first kernel, and "
        "its kernels by time beside the floor's",
    )
    add_tp(p)
    add_outputs(p, "step ms against N")


def add_decode_args(p) -> None:
    add_models(p, ["qwen3-0.6b"])
    p.add_argument(
        "--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64], help="requests"
    )
    p.add_argument("--context", type=int, default=1024, help="each request's cached tokens")
    p.add_argument("--reps", type=int, default=20, help="timed steps per point (their median)")
    add_device(p)
    p.add_argument(
        "--profile",
        action="store_true",
        help="CUDA: where a step's GPU time goes (GEMM, attention, all-reduce, other kernels)",
    )
    p.add_argument(
        "--variants",
        nargs="+",
        metavar="V",
        help="CUDA: decode graphs captured under each variant, timed in interleaved rounds "
        "against the first: base, nogemv, skinny=PATH (a bench gemm --table-out table), "
        "moegemv<N> (MoE steps of up to N tokens on the GEMV path), moetable=PATH",
    )
    p.add_argument("--rounds", type=int, default=7, help="--variants: interleaved rounds")
    p.add_argument(
        "--draft-tokens",
        type=int,
        default=0,
        metavar="K",
        help="time a speculative verify step instead (each request's token and K drafts), "
        "beside the plain step's graph",
    )
    add_tp(p)
    add_outputs(p, "step ms against batch size")


def add_prefill_args(p) -> None:
    p.add_argument("mode", choices=["cold", "hit"], help="cold: cache flushed; hit: cached prefix")
    p.add_argument("tokens", type=int, help="cold: prompt tokens; hit: cached prefix tokens")
    p.add_argument("concurrency", type=int, help="requests sent at once per wave")
    _add_url(p)
    p.add_argument(
        "--hit-new-tokens", type=int, default=1024, help="hit: new tokens after the prefix"
    )
    p.add_argument(
        "--keep-cache",
        action="store_true",
        help="hit: no flush first; the prefix an earlier run with the same --seed cached hits",
    )
    p.add_argument("--warmup-waves", type=int, default=2, help="unmeasured waves first")
    p.add_argument("--waves", type=int, default=5, help="measured waves")
    p.add_argument("--seed", type=int, default=0, help="the prompts' random token ids")
    add_outputs(p, "TTFT p50/p90 bars")


def _add_url(p) -> None:
    p.add_argument("--url", default=DEFAULT_URL, help="the running `breakgraph serve`")


def add_serving_args(p) -> None:
    _add_url(p)
    p.add_argument(
        "--concurrency", type=int, nargs="+", default=[1, 2, 4, 8], help="requests in flight"
    )
    p.add_argument("--input-len", type=int, default=8192, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=1024, help="new tokens per request")
    p.add_argument(
        "--requests-per-level",
        type=int,
        default=None,
        help="requests at each concurrency (default: 4 x concurrency; at least the concurrency)",
    )
    p.add_argument("--rounds", type=int, default=2, help="even rounds run in reverse order")
    p.add_argument("--seed", type=int, default=0, help="the prompts' random token ids")
    add_outputs(p, "each metric against concurrency")


def add_host_args(p) -> None:
    p.add_argument(
        "what",
        choices=["decode", "prefill", "api"],
        help="decode: a decode step's host stages per batch size; prefill: a cold prompt's; "
        "api: the API process's CPU time per streamed token (a CPU server)",
    )
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256], help="decode")
    p.add_argument("--steps", type=int, default=24, help="decode: steps per run")
    p.add_argument(
        "--speculative", choices=["NGRAM"], default=None,
        help="decode: time NGRAM verify steps instead (every draft kept; a draft model's "
        "steps would count as host time)",
    )  # fmt: skip
    p.add_argument("--draft-tokens", type=int, default=3, help="decode: with --speculative")
    p.add_argument("--tokens", type=int, nargs="+", default=[256], help="prefill: prompt tokens")
    p.add_argument("--requests", type=int, default=None, help="prefill: 100; api: 128")
    add_device(p, "cpu")
    p.add_argument(
        "--model-path", default=None, help="default: a two-layer Qwen3 layout, dummy weights"
    )
    p.add_argument("--concurrency", type=int, default=64, help="api")
    p.add_argument("--input-len", type=int, default=16, help="api")
    p.add_argument("--output-len", type=int, default=64, help="api")
    p.add_argument("--flags", default="", help="api: more serve flags for this tree's server")
    p.add_argument("--ref", help="also a commit's tree (git archive), the arms interleaved")
    p.add_argument("--ref-flags", default="", help="api: more serve flags for the ref's server")
    p.add_argument("--rounds", type=int, default=3, help="runs per arm, interleaved")
    add_outputs(p)


def add_spec_args(p) -> None:
    p.add_argument(
        "--model-path", default=None, help="default: the embedded SmolLM2 (real weights)"
    )
    p.add_argument("--output-len", type=int, default=64, help="tokens decoded per arm")
    p.add_argument(
        "--input-len", type=int, default=0,
        help="a prompt of this many random token ids (default: the chat prompt; 1024 ids for "
        "a model without a tokenizer, e.g. a built-in config with dummy weights)",
    )  # fmt: skip
    p.add_argument("--draft-tokens", type=int, default=4, help="--speculative-num-draft-tokens")
    p.add_argument(
        "--algorithm", nargs="+", choices=["NGRAM", "STANDALONE", "NEXTN"], default=["NGRAM"],
        help="the arms beside plain decoding",
    )  # fmt: skip
    p.add_argument(
        "--draft-model-path", default=None, help="STANDALONE's draft (default: the model)"
    )
    p.add_argument(
        "--synthetic-accept-length", type=float, default=None,
        help="keep this mean number of tokens per verify step whatever the model says "
        "(--bench-synthetic-accept-length: the mechanics, not the model)",
    )  # fmt: skip
    p.add_argument(
        "--unchained", action="store_true",
        help="also run STANDALONE with each verify step read back before the next "
        "(BREAKGRAPH_SPEC_CHAIN=0): what verify steps back to back give, under overlap",
    )  # fmt: skip
    add_device(p, "cpu")
    add_outputs(p)


def add_grammar_args(p) -> None:
    p.add_argument(
        "--models", nargs="+", default=None,
        help="built-in configs (their shapes, dummy weights) with the embedded SmolLM2 "
        "tokenizer's vocabulary (default: llama-3.1-8b on CUDA, smollm2-135m on the CPU)",
    )  # fmt: skip
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64], help="requests")
    p.add_argument("--steps", type=int, default=200, help="timed full-batch steps per arm")
    p.add_argument("--warmup-steps", type=int, default=20, help="untimed ones first, per arm")
    p.add_argument("--rounds", type=int, default=2, help="the arms alternate this many times")
    p.add_argument("--output-len", type=int, default=1024, help="a request's max new tokens")
    p.add_argument("--prompt-len", type=int, default=32, help="a request's prompt tokens")
    p.add_argument(
        "--schema", default=None, metavar="FILE", help="a JSON schema (default: a catalog)"
    )
    p.add_argument(
        "--tokenizer", default=None, metavar="DIR",
        help="an HF directory with the tokenizer.json to use (default: the embedded SmolLM2's)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="the prompts' random token ids")
    add_device(p)
    add_outputs(p)


def add_plot_args(p) -> None:
    p.add_argument("kind", choices=["step", "decode", "prefill", "serving"], help="which bench")
    p.add_argument("json_files", nargs="+", help="one or more runs' --json files")
    p.add_argument("-o", "--output", required=True, metavar="FILE.png", help="the figure")


# name -> (help, flags, the function that runs it)
BENCHES = {
    "step": (
        "one prefill step in-process: graphs against eager, the floor and HF",
        add_step_args,
        "breakgraph.bench.step:run_step_bench",
    ),
    "decode": (
        "one decode step per batch size in-process: graph against eager and the floor",
        add_decode_args,
        "breakgraph.bench.decode:run_decode_bench",
    ),
    "prefill": (
        "TTFT of concurrent prefills against a running server: cold | hit",
        add_prefill_args,
        "breakgraph.bench.prefill:run_prefill_bench",
    ),
    "serving": (
        "closed-loop serving tables per concurrency against a running server",
        add_serving_args,
        "breakgraph.bench.serving:run_serving_bench",
    ),
    "host": (
        "host time outside the forward: a step's stages, the API process's CPU per token",
        add_host_args,
        "breakgraph.bench.host:run_host_bench",
    ),
    "spec": (
        "speculative decoding (NGRAM, STANDALONE, NEXTN) against plain decoding in-process, "
        "on a repeat prompt or token ids",
        add_spec_args,
        "breakgraph.bench.speculative:run_spec_bench",
    ),
    "grammar": (
        "the decode step with every request held to a JSON schema against unconstrained, "
        "in-process; grammar compile times",
        add_grammar_args,
        "breakgraph.bench.grammar:run_grammar_bench",
    ),
    "moe": (
        "CUDA: the fused MoE layer against dense GEMMs and the bandwidth floor; its tables",
        add_moe_args,
        "breakgraph.bench.moe:run_moe_bench",
    ),
    "gemm": (
        "CUDA: decode's projections, cuBLAS against the skinny GEMM; its table",
        add_gemm_args,
        "breakgraph.bench.gemm:run_gemm_bench",
    ),
    "kernels": (
        "CUDA: attention and fused kernels against torch references and the floor",
        add_kernels_args,
        "breakgraph.bench.kernels:run_kernels_bench",
    ),
    "allreduce": (
        "CUDA, 2+ GPUs: NCCL against the one-shot all-reduce per message size",
        add_allreduce_args,
        "breakgraph.bench.allreduce:run_allreduce_bench",
    ),
    "peers": (PEERS_HELP, add_peers_args, "breakgraph.bench.peers:run_peers_bench"),
    "plot": (
        "redraw saved --json results, several runs in one figure",
        add_plot_args,
        "breakgraph.bench.plot:run_plot",
    ),
}


_SERVER = "breakgraph serve --model-path smollm2-135m --load-format dummy &  # a CPU server"
# a run sized for the CPU (seconds to a minute), shown under each bench's --help; the defaults
# are sized for an H200
EXAMPLES = {
    "step": "breakgraph bench step --models smollm2-135m -N 64 --reps 2 --no-hf\n"
    "(on the CPU the eager arm runs; graphs, the floor and launch counts need CUDA)",
    "decode": "breakgraph bench decode --models smollm2-135m --batch-sizes 1 4 --context 256 "
    "--reps 3\n(on the CPU: eager steps only)",
    "prefill": f"{_SERVER}\nbreakgraph bench prefill cold 256 2 --warmup-waves 1 --waves 2",
    "serving": f"{_SERVER}\nbreakgraph bench serving --concurrency 1 2 --input-len 256 "
    "--output-len 16 --requests-per-level 2 --rounds 1",
    "host": "breakgraph bench host decode --batch 1 8 --steps 8 --rounds 1",
    "spec": "breakgraph bench spec --output-len 32\n"
    "breakgraph bench spec --algorithm STANDALONE --unchained --output-len 32\n"
    "breakgraph bench spec --model-path deepseek-v4-tiny --algorithm NEXTN --input-len 64 "
    "--output-len 16",
    "grammar": "breakgraph bench grammar --batch-sizes 1 8 --steps 10 --warmup-steps 3 "
    "--output-len 128",
    "moe": "CUDA only: breakgraph bench moe --models qwen3-moe-tiny --tokens 1 64",
    "gemm": "CUDA only: breakgraph bench gemm --models qwen3-0.6b --m 1",
    "kernels": "CUDA only: breakgraph bench kernels --extend-tokens 1024 --decode-context 1024",
    "allreduce": "CUDA, 2 GPUs: breakgraph bench allreduce --tp 2 --kib 8 64",
    "peers": PEERS_EXAMPLE,
    "plot": "breakgraph bench step --models smollm2-135m -N 64 --reps 2 --no-hf --json a.json\n"
    "breakgraph bench plot step a.json -o step.png",
}


def run_bench(args: argparse.Namespace) -> int:
    module, _, func = BENCHES[args.bench][2].partition(":")
    out = getattr(importlib.import_module(module), func)(args)
    return out if isinstance(out, int) else 0


def add_bench_parsers(bench: argparse.ArgumentParser, formatter_class) -> None:
    """One subparser per entry of :data:`BENCHES` under ``breakgraph bench``, its help with
    each flag's default and a CPU-sized example (:data:`EXAMPLES`, its lines kept)."""
    keep_lines = type("BenchHelp", (argparse.RawDescriptionHelpFormatter, formatter_class), {})
    sub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for name, (text, add_args, _) in BENCHES.items():
        p = sub.add_parser(
            name,
            help=text,
            description=text,
            epilog=f"example:\n{EXAMPLES[name]}",
            formatter_class=keep_lines,
        )
        add_args(p)
        p.set_defaults(func=run_bench, parser=p)
