"""The command line's parsers: ``generate``, ``serve`` and ``bench`` with their flag groups,
``--version``, and flag errors in two lines (a short usage, then the problem, with the flag
meant where a close one exists and what to use where another engine's flag was given)."""

from __future__ import annotations

import argparse
import difflib
import importlib.metadata
import platform

from breakgraph.bench.args import add_bench_parsers
from breakgraph.common.logs import DEFAULT_LOG_LEVEL, LOG_LEVELS
from breakgraph.engine.flags import (
    LOGGING,
    SERVER,
    HelpFormatter,
    add_engine_args,
    argument_group,
)
from breakgraph.engine.server_flags import add_server_args

FLAGS_DOC = "Every flag, grouped: docs/flags.md. Environment variables: docs/env.md."

# SGLang's or vLLM's flags that have no twin here, each answered with what to do instead
# (their twins with the same meaning are aliases of ours: --max-model-len, --tp, ...)
PEER_FLAGS = {
    "--tokenizer-path": "the tokenizer is read from --model-path (tokenizer.json, "
    "tokenizer_config.json beside config.json): put its files there",
    "--gpu-memory-utilization": "use --mem-fraction-static: the share of GPU memory the "
    "weights and the KV pool may fill",
    "--max-num-batched-tokens": "use --chunked-prefill-size: the most tokens one prefill step "
    "computes",
    "--enable-prefix-caching": "the radix prefix cache is on unless --disable-radix-cache",
    "--download-dir": "set HF_HUB_CACHE (or HF_HOME): hub ids resolve through huggingface_hub's "
    "cache",
    "--quantization": "not supported: weights load in --dtype (a .gguf file is dequantized)",
}
PEER_FLAGS["--tokenizer"] = PEER_FLAGS["--tokenizer-path"]


class Parser(argparse.ArgumentParser):
    """argparse's parser whose errors are two lines: a short usage (``--help`` has the full
    one: serve's is 35 lines) and the problem."""

    def error(self, message: str):
        self.exit(2, f"{self.short_usage()}\n{self.prog}: error: {message}\n")

    def short_usage(self) -> str:
        usage = self.format_usage().strip()
        if usage.count("\n") < 3:
            return usage
        positionals = [
            a.metavar or a.dest
            for a in self._actions
            if not a.option_strings and a.help is not argparse.SUPPRESS
        ]
        words = [self.prog, "[flags]", *map(str, positionals)]
        return f"usage: {' '.join(words)}  ({self.prog} --help: every flag)"


def unknown_flags_message(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    """What argparse says of arguments no flag takes, and then for the first flag among them
    what to use instead: another engine's flag answered, or the closest of ours."""
    message = f"unrecognized arguments: {' '.join(unknown)}"
    for arg in unknown:
        flag = arg.split("=", 1)[0]
        if not flag.startswith("--"):
            continue
        if flag in PEER_FLAGS:
            return f"{message} ({flag}: {PEER_FLAGS[flag]})"
        ours = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
        close = difflib.get_close_matches(flag, ours, n=1, cutoff=0.6)
        if close:
            return f"{message} (did you mean {close[0]}?)"
    return message


def version() -> str:
    def dist(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    return (
        f"breakgraph {dist('breakgraph')} (torch {dist('torch')}, "
        f"Python {platform.python_version()})"
    )


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"the port must be in [1, 65535], got {port}")
    return port


def _add_log_level(p: argparse.ArgumentParser, top: bool) -> None:
    g = p if top else argument_group(p, LOGGING)
    g.add_argument(
        "--log-level",
        type=str.lower,
        choices=LOG_LEVELS,
        # a subcommand's flag overrides the top-level one only when given
        default=DEFAULT_LOG_LEVEL if top else argparse.SUPPRESS,
        help="the level of Python logging in every process; at the default level start-up "
        "still says what it does (loading, the engine's summary, capture, warm-up)"
        + (
            ""
            if top
            else f" (default: {DEFAULT_LOG_LEVEL}, or the level given before the subcommand)"
        ),
    )


def _add_prompt_args(p: argparse.ArgumentParser) -> None:
    g = argument_group(p, "prompt")
    g.add_argument(
        "prompt",
        metavar="PROMPT",
        help="the prompt: a user message, text (--raw) or ids (--input-ids)",
    )
    g.add_argument("--raw", action="store_true", help="no chat template: complete the text")
    g.add_argument(
        "--input-ids", action="store_true", help="PROMPT is a list of token ids ('1 2 3')"
    )
    g.add_argument(
        "--no-stream",
        dest="stream",
        action="store_false",
        help="print the answer once it is complete (default: its tokens as they come)",
    )


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = argument_group(p, "sampling")
    g.add_argument(
        "--max-new-tokens", metavar="N", type=int, default=128, help="the answer's length bound"
    )
    g.add_argument("--temperature", metavar="T", type=float, default=0.0, help="0: greedy")
    g.add_argument(
        "--top-p", metavar="P", type=float, default=1.0, help="nucleus sampling (1: off)"
    )
    g.add_argument(
        "--top-k", metavar="K", type=int, default=-1, help="the k most likely tokens only (-1: off)"
    )
    g.add_argument(
        "--min-p",
        metavar="P",
        type=float,
        default=0.0,
        help="drop tokens below this share of the top one",
    )
    g.add_argument(
        "--sampling-seed",
        metavar="N",
        type=int,
        default=None,
        help="this request's sampling seed (default: the engine's generator, seeded by --seed)",
    )
    g.add_argument("--ignore-eos", action="store_true", help="run to --max-new-tokens")


def _add_listen_args(p: argparse.ArgumentParser) -> None:
    g = argument_group(p, SERVER)
    g.add_argument("--host", metavar="HOST", default="127.0.0.1", help="the address to listen on")
    g.add_argument(
        "--port", metavar="PORT", type=_port, default=30000, help="the port to listen on"
    )
    g.add_argument(
        "--served-model-name",
        metavar="NAME",
        default=None,
        help="the model name of the OpenAI API, as /v1/models lists it (the alias 'default' "
        "is accepted too); default: the name `serve` prints when ready, from --model-path (a "
        "hub id as given) or the embedded model's file",
    )
    g.add_argument(
        "--loop",
        choices=["auto", "asyncio", "uvloop"],
        default="auto",
        help="the API process's event loop (uvicorn's name): auto takes uvloop where it is "
        "installed (less host time per request and per streamed token), else asyncio's",
    )


def _add_command(sub, name: str, func, add_groups, **kw) -> argparse.ArgumentParser:
    """A subcommand running ``func``: its flag groups in ``add_groups``' order, then the log
    level; the flag reference (``FLAGS_DOC``) as its epilog."""
    cmd = sub.add_parser(name, epilog=FLAGS_DOC, formatter_class=HelpFormatter, **kw)
    for add in add_groups:
        add(cmd)
    _add_log_level(cmd, top=False)
    cmd.set_defaults(func=func, parser=cmd)
    return cmd


def build_parser() -> argparse.ArgumentParser:
    from breakgraph.cli.generate import cmd_generate
    from breakgraph.cli.serve import cmd_serve

    parser = Parser(
        prog="breakgraph",
        description="The one entry point: breakgraph generate | serve | bench.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=version())
    _add_log_level(parser, top=True)
    parser.set_defaults(parser=parser)
    sub = parser.add_subparsers(dest="command", required=True)

    _add_command(
        sub,
        "generate",
        cmd_generate,
        (_add_prompt_args, _add_sampling_args, add_engine_args),
        help="answer one prompt with the chat template applied",
        description="Answer one prompt in-process, the chat template applied.",
    )
    _add_command(
        sub,
        "serve",
        cmd_serve,
        (add_engine_args, _add_listen_args, add_server_args),
        help="HTTP server: SGLang-native /generate and the OpenAI API",
        description="HTTP server: SGLang-native /generate and the OpenAI API, listening once "
        "the model is loaded and its graphs captured.",
    )

    bench = sub.add_parser("bench", help="benchmarks (breakgraph bench BENCH --help)")
    bench.set_defaults(parser=bench)
    add_bench_parsers(bench, HelpFormatter)
    return parser
