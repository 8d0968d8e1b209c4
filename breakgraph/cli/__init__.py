"""The one entry point: ``breakgraph generate | serve | bench``.

This module imports nothing of its own at the top, so that a Ctrl-C while the command's
modules load still ends quietly (status 130)."""

from __future__ import annotations

import signal


def main(argv: list[str] | None = None) -> int:
    """Run ``breakgraph`` with ``argv`` (default: the command line); its exit status."""
    try:
        from breakgraph.cli.run import run
    except KeyboardInterrupt:
        return 128 + signal.SIGINT  # run.EXIT_INTERRUPTED
    return run(argv)


def build_parser():
    """The argparse parser of every subcommand (cli/parser.py)."""
    from breakgraph.cli.parser import build_parser as build

    return build()
