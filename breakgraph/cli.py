"""The one entry point: ``breakgraph generate | serve | bench``."""

from __future__ import annotations

import argparse
import logging
import sys

from breakgraph.bench.args import add_bench_parsers
from breakgraph.engine.flags import (
    LOGGING,
    SERVER,
    HelpFormatter,
    add_engine_args,
    add_server_args,
    argument_group,
)

LOG_LEVELS = ["debug", "info", "warning", "error", "critical"]
DEFAULT_LOG_LEVEL = "warning"
_HELP = HelpFormatter
FLAGS_DOC = "Every flag, grouped: docs/flags.md. Environment variables: docs/env.md."


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
        help="the level of Python logging in every process"
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
        "is accepted too); default: the name `serve` prints when ready, from --model-path or "
        "the embedded model's file",
    )
    g.add_argument(
        "--loop",
        choices=["auto", "asyncio", "uvloop"],
        default="auto",
        help="the API process's event loop (uvicorn's name): auto takes uvloop where it is "
        "installed (less host time per request and per streamed token), else asyncio's",
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from breakgraph.engine.args import EngineArgs
    from breakgraph.engine.engine import Engine
    from breakgraph.engine.memory import MemoryPlanError
    from breakgraph.engine.request import SamplingParams
    from breakgraph.models.gguf_loader import EmbeddedModelMissing

    try:
        engine = Engine(EngineArgs.from_namespace(args))
    except (EmbeddedModelMissing, FileNotFoundError, ValueError, MemoryPlanError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sampling = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.sampling_seed,
        ignore_eos=args.ignore_eos,
    )
    prompt: str | list[int] = args.prompt
    if args.input_ids:
        prompt = [int(t) for t in args.prompt.replace(",", " ").split()]
    try:
        (result,) = engine.generate([prompt], sampling, chat=not args.raw)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(result.text if result.text is not None else " ".join(map(str, result.output_ids)))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from breakgraph.server.launch import serve

    def on_ready(what: str) -> None:
        print(f"breakgraph: serving {what}", file=sys.stderr, flush=True)

    return serve(args, on_ready)


def _add_command(sub, name: str, func, add_groups, **kw) -> argparse.ArgumentParser:
    """A subcommand running ``func``: its flag groups in ``add_groups``' order, then the log
    level; the flag reference (``FLAGS_DOC``) as its epilog."""
    cmd = sub.add_parser(name, epilog=FLAGS_DOC, formatter_class=_HELP, **kw)
    for add in add_groups:
        add(cmd)
    _add_log_level(cmd, top=False)
    cmd.set_defaults(func=func)
    return cmd


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="breakgraph", description=__doc__, formatter_class=_HELP)
    _add_log_level(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = _add_command(
        sub,
        "generate",
        cmd_generate,
        (_add_prompt_args, _add_sampling_args, add_engine_args),
        help="answer one prompt with the chat template applied",
        description="Answer one prompt in-process, the chat template applied.",
    )
    srv = _add_command(
        sub,
        "serve",
        cmd_serve,
        (add_engine_args, _add_listen_args, add_server_args),
        help="HTTP server: SGLang-native /generate and the OpenAI API",
        description="HTTP server: SGLang-native /generate and the OpenAI API, listening once "
        "the model is loaded and its graphs captured.",
    )

    bench = sub.add_parser("bench", help="benchmarks (breakgraph bench BENCH --help)")
    add_bench_parsers(bench, _HELP)
    parser.set_defaults(_parsers={"generate": gen, "serve": srv})
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # name the subcommand's usage, not the top-level one
        sub = getattr(args, "_parsers", {}).get(args.command, parser)
        sub.error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    code = args.func(args)
    tp = sys.modules.get("breakgraph.engine.tp.teardown")  # imported only where TP ran
    if tp is not None:
        tp.exit_if_stuck(code or 0)
    return code


if __name__ == "__main__":
    sys.exit(main())
