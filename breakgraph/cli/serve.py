"""``breakgraph serve``: the flags checked and the model path resolved in this (the API)
process, without torch; then the server (server/launch.py)."""

from __future__ import annotations

import argparse
import sys

from breakgraph.cli import preflight


def cmd_serve(args: argparse.Namespace) -> int:
    preflight.apply_cpu_threads(args.cpu_threads)
    preflight.check_device(args.device, import_torch=False)
    preflight.resolve_model(args)
    from breakgraph.server.launch import serve

    def on_ready(what: str) -> None:
        print(f"breakgraph: serving {what}", file=sys.stderr, flush=True)

    return serve(args, on_ready)
