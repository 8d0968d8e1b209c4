"""``breakgraph serve``: bind the port, start the engine process, then listen once its model
is loaded.

Shutdown: uvicorn owns SIGINT/SIGTERM while serving. On the first signal the server stops
admitting (new requests and /health answer 503), lets in-flight requests finish for up to
``--shutdown-timeout`` seconds, then ends the rest: a stream with an error event and
``[DONE]``, a whole answer with a JSON 503. Then the engine process is stopped (it finishes
its current step). A second Ctrl-C (SIGINT) ends every request that way at once, gives their
last bytes up to ``FORCE_FLUSH_S`` to go out, and exits without waiting for the engine's step
(the engine process is killed if it is still busy). Before serving (while the model loads) a
signal cancels the start-up, and the engine process is stopped on the way out. If the engine
process dies, the server stops and the exit status is 1.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import errno
import importlib.util
import logging
import signal
import socket
from collections.abc import Callable
from pathlib import Path

import uvicorn

from breakgraph.common import envs, gc_watch
from breakgraph.engine.args import EngineArgs
from breakgraph.models.model_path import ModelPathError, resolve_model_path
from breakgraph.server.client import EngineClient
from breakgraph.server.detokenize import load_tokenizer
from breakgraph.server.http import create_asgi_app
from breakgraph.server.protocol import max_token_bytes
from breakgraph.server.state import ServerState

logger = logging.getLogger(__name__)

# after --shutdown-timeout, how long the ended requests have to write their last bytes
SHUTDOWN_FLUSH_S = 5.0
# after a second Ctrl-C, how long the ended requests have to write their last bytes, and how
# long the engine process has to stop before it is killed
FORCE_FLUSH_S = 2.0
FORCE_ENGINE_WAIT_S = 2.0


class StartupProblem(Exception):
    """An argument problem found before the model loads; reported as one line."""


def check_model_path(model_path: str | None) -> None:
    """What the loaders will need, checked without loading anything (models/model_path.py:
    the path, a config.json's architecture; the CLI has resolved a hub id already)."""
    try:
        resolve_model_path(model_path, load_format="dummy")  # weights: the engine's to check
    except ModelPathError as e:
        raise StartupProblem(str(e)) from None


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound now: a port in use is found before the model loads."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, addr = infos[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise StartupProblem(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        sock.close()
        reason = "the port is already in use" if e.errno == errno.EADDRINUSE else e.strerror
        raise StartupProblem(f"cannot listen on {host}:{port}: {reason}") from None
    return sock


class _GracefulServer(uvicorn.Server):
    """uvicorn's server whose shutdown first drains the engine client (see the module doc)."""

    def __init__(self, config: uvicorn.Config, client: EngineClient, shutdown_timeout_s: float):
        super().__init__(config)
        self.client = client
        self.shutdown_timeout_s = shutdown_timeout_s
        self.forced = False  # a second Ctrl-C came
        self._loop = asyncio.get_running_loop()

    def handle_exit(self, sig: int, frame: object) -> None:
        """A signal (in the main thread, between two bytecodes of the loop's): the first starts
        the graceful shutdown (uvicorn's); a second SIGINT ends every request now (a third
        stops waiting even for their last bytes, as uvicorn's second does)."""
        if sig == signal.SIGINT and self.should_exit and not self.forced:
            self.forced = True
            self._loop.call_soon_threadsafe(self._force)
            return
        super().handle_exit(sig, frame)

    def _force(self) -> None:
        ended = self.client.end_all("the server was stopped")
        logger.warning("second Ctrl-C: ended %d request(s); exiting", ended)
        self.client.drain()
        self._loop.call_later(FORCE_FLUSH_S, setattr, self, "force_exit", True)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        client = self.client
        client.drain()
        if client.num_inflight and not self.forced:
            logger.warning(
                "shutting down: %d request(s) in flight get up to %.0f s to finish "
                "(Ctrl-C again to end them now)",
                client.num_inflight,
                self.shutdown_timeout_s,
            )
        loop = asyncio.get_running_loop()
        timer = loop.call_later(self.shutdown_timeout_s, self._end_remaining)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _end_remaining(self) -> None:
        ended = self.client.end_all("the server is shutting down")
        if ended:
            logger.warning("shutdown: ended %d unfinished request(s) with an error", ended)


def serve(args: argparse.Namespace, on_ready: Callable[[str], None] | None = None) -> int:
    """Run the server until a signal (exit status 0) or the engine's death (1)."""
    try:
        loop_factory = event_loop_factory(args.loop)
    except StartupProblem as e:
        logger.error("%s", e)
        return 2
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            return runner.run(_serve(args, on_ready))
    except (KeyboardInterrupt, asyncio.CancelledError):
        return 0


def event_loop_factory(choice: str = "auto") -> Callable[[], asyncio.AbstractEventLoop] | None:
    """``--loop``: uvloop's loop (libuv: the HTTP, socket and queue wake-ups of each request
    and each streamed token cost less host time), asyncio's (None), or auto: uvloop where it
    is installed, as uvicorn's own "auto" does."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise StartupProblem("--loop uvloop: uvloop is not installed") from None
        return None
    return uvloop.new_event_loop


async def _serve(args: argparse.Namespace, on_ready: Callable[[str], None] | None) -> int:
    engine_args = EngineArgs.from_namespace(args)
    try:
        check_model_path(engine_args.model_path)
        sock = bind_socket(args.host, args.port)
    except StartupProblem as e:
        logger.error("%s", e)
        return 2
    with sock:
        return await _serve_on(args, engine_args, sock, on_ready)


async def _serve_on(
    args: argparse.Namespace,
    engine_args: EngineArgs,
    sock: socket.socket,
    on_ready: Callable[[str], None] | None,
) -> int:
    client = EngineClient(engine_args, args.log_level, engine_args.log_requests)
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
            if tokenizer is not None:  # computed once, off the event loop (~50 ms)
                await asyncio.to_thread(max_token_bytes, tokenizer)
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
        state = ServerState(
            client, tokenizer, info, name, args.model_path, server_args, args.max_request_bytes,
            incremental_streaming_output=engine_args.incremental_streaming_output,
            stream_interval=engine_args.stream_interval,
        )  # fmt: skip
        api_key = args.api_key or envs.API_KEY.get() or None
        if api_key:
            logger.info("an API key is required on every route but /health and /health_generate")
        config = uvicorn.Config(
            create_asgi_app(state, api_key),
            host=args.host,
            port=args.port,
            log_level=args.log_level.lower(),
            lifespan="off",  # the engine process is stopped below, however serving ends
            # a backstop: the requests were ended at --shutdown-timeout (_GracefulServer)
            timeout_graceful_shutdown=int(engine_args.shutdown_timeout + SHUTDOWN_FLUSH_S),
        )
        if engine_args.log_requests:
            logging.getLogger("breakgraph.requests").setLevel(logging.INFO)
            logging.getLogger("uvicorn.access").setLevel(logging.INFO)
        if importlib.util.find_spec("httptools") is None:  # uvicorn's "auto" takes it if present
            logger.warning("httptools not installed: uvicorn parses HTTP in pure Python (h11), "
                           "about 2 ms more per request")  # fmt: skip
        server = _GracefulServer(config, client, engine_args.shutdown_timeout)
        gc_watch.freeze()  # the API process's start-up objects, likewise (engine_process)

        def on_engine_death() -> None:
            server.should_exit = True

        client.on_death = on_engine_death
        announce = None
        if on_ready is not None:
            url = f"http://{args.host}:{args.port}"
            what = f"{name} on {url}" + (" (API key required)" if api_key else "")
            announce = asyncio.create_task(_announce(server, on_ready, what))
        serving = True
        await server.serve(sockets=[sock])
        if announce is not None:
            announce.cancel()
        if server.forced:
            client.close(FORCE_ENGINE_WAIT_S, kill=True)
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
