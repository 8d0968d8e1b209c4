"""``breakgraph``'s ``run``: parse the flags, set up logging, run the subcommand; a flag's
problem ends under the short usage, any other start-up problem in one log line, and Ctrl-C
in a clean exit (status 130, no traceback)."""

from __future__ import annotations

import logging
import signal
import sys

from breakgraph.cli.parser import build_parser, unknown_flags_message
from breakgraph.cli.preflight import FlagError, StartupError
from breakgraph.common.logs import configure_logging

logger = logging.getLogger("breakgraph.cli")

EXIT_INTERRUPTED = 128 + signal.SIGINT  # what a shell reports for a process ended by Ctrl-C


def run(argv: list[str] | None = None) -> int:
    try:
        code = _run(argv)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second Ctrl-C ends it at once
        print(file=sys.stderr)  # past the ^C the terminal echoed
        logger.warning("interrupted")
        code = EXIT_INTERRUPTED
    tp = sys.modules.get("breakgraph.engine.tp.teardown")  # imported only where TP ran
    if tp is not None:
        tp.exit_if_stuck(code or 0)
    return code


def _run(argv: list[str] | None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    command = args.parser  # the innermost subcommand's parser: its usage, its flags
    if unknown:
        command.error(unknown_flags_message(command, unknown))
    configure_logging(args.log_level)
    try:
        return args.func(args)
    except FlagError as e:
        command.error(str(e))
    except StartupError as e:
        logger.error("%s", e)
        return 2
