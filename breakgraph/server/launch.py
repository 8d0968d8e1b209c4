"""``breakgraph serve``: start the engine process, then listen once its model is loaded.

Shutdown: uvicorn owns SIGINT/SIGTERM while serving; its graceful shutdown runs the app's
lifespan exit, which stops the engine process. Before that (while the model loads) a
signal cancels the start-up, and the engine process is stopped on the way out. If the
engine process dies, the server stops and the exit status is 1.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
from collections.abc import Callable
from pathlib import Path

import uvicorn

from breakgraph.engine.args import EngineArgs
from breakgraph.server.client import EngineClient
from breakgraph.server.detokenize import load_tokenizer
from breakgraph.server.http import create_app
from breakgraph.server.state import ServerState

logger = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 3


def serve(args: argparse.Namespace, on_ready: Callable[[str], None] | None = None) -> int:
    """Run the server until a signal (exit status 0) or the engine's death (1)."""
    try:
        return asyncio.run(_serve(args, on_ready))
    except (KeyboardInterrupt, asyncio.CancelledError):
        return 0


async def _serve(args: argparse.Namespace, on_ready: Callable[[str], None] | None) -> int:
    engine_args = EngineArgs.from_namespace(args)
    client = EngineClient(engine_args, args.log_level)
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()
    serving = False

    def on_signal(signum: int, frame: object) -> None:
        # uvicorn handles the signals while serving (and re-raises them when done: then ignore)
        if not serving:
            loop.call_soon_threadsafe(main_task.cancel)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        tokenizer_task = asyncio.create_task(
            asyncio.to_thread(load_tokenizer, engine_args.model_path)
        )
        try:
            info = await client.start()
            tokenizer = await tokenizer_task
        except asyncio.CancelledError:
            logger.warning("interrupted while loading the model")
            return 0
        except Exception as e:
            logger.error("cannot start the server: %s", e)
            return 1
        name = args.served_model_name or args.model_path or Path(info.model_source).stem
        server_args = {
            "host": args.host,
            "port": args.port,
            "served_model_name": name,
            **dataclasses.asdict(engine_args),
        }
        state = ServerState(client, tokenizer, info, name, args.model_path, server_args)
        config = uvicorn.Config(
            create_app(state),
            host=args.host,
            port=args.port,
            log_level=args.log_level.lower(),
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
        server = uvicorn.Server(config)

        def on_engine_death() -> None:
            server.should_exit = True

        client.on_death = on_engine_death
        announce = None
        if on_ready is not None:
            url = f"http://{args.host}:{args.port}"
            announce = asyncio.create_task(_announce(server, on_ready, f"{name} on {url}"))
        serving = True
        await server.serve()
        if announce is not None:
            announce.cancel()
        if client.dead:
            logger.error("the engine process died; the server stopped")
            return 1
        return 0 if server.started else 1
    finally:
        serving = True
        client.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


async def _announce(server: uvicorn.Server, on_ready: Callable[[str], None], what: str) -> None:
    while not server.started:
        await asyncio.sleep(0.05)
    on_ready(what)
