"""API-side handle on the engine process: spawn it, wait for ready, send it requests and
calls, and hand its step messages to the in-flight requests (server/inflight.py).

The engine socket's reader (a callback of the event loop) decodes each message from the
engine: a step's outputs go to their requests' queues, a call's answer to its future.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import multiprocessing
import time
from collections.abc import Callable

from breakgraph.common import messages
from breakgraph.common.messages import EngineStats
from breakgraph.common.sampling_params import MAX_SAMPLES, SamplingParams
from breakgraph.engine.args import EngineArgs
from breakgraph.server.errors import EngineError, RequestRejected
from breakgraph.server.inflight import InFlight, InFlightRequests, request_log
from breakgraph.server.ipc import EngineConnection, IpcPaths, accept_engine
from breakgraph.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

# /metrics and /get_server_info wait this long for the engine's own answer before they take
# the stats it last published (it answers between two steps; one step can take seconds)
STATS_WAIT_S = 0.05


def _engine_main(engine_args: EngineArgs, paths: IpcPaths, log_level: str) -> None:
    """The spawned engine process's target: the engine (and torch) are imported there, not here."""
    from breakgraph.server.engine_process import run_engine_process

    run_engine_process(engine_args, paths, log_level)


class EngineClient:
    def __init__(
        self, engine_args: EngineArgs, log_level: str = "warning", log_requests: bool = False
    ):
        self.engine_args = engine_args
        self.log_level = log_level
        self.log_requests = log_requests  # one INFO line per request received and finished
        self.draining = False  # shutting down: no new requests
        self.metrics = ServerMetrics()
        self.requests = InFlightRequests(self.metrics, log_requests)
        self.info: messages.ModelInfo | None = None
        self.process: multiprocessing.Process | None = None
        self.dead = False  # the engine process exited without being asked to
        self.on_death: Callable[[], None] | None = None
        self._closing = False
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._paths: IpcPaths | None = None
        self._conn: EngineConnection | None = None
        self._ready: asyncio.Future | None = None  # Ready's model info, or why it failed
        # the engine's latest stats (any StatsReply) and when they came (monotonic)
        self._stats: EngineStats | None = None
        self._stats_at = 0.0
        self._stats_call: asyncio.Future | None = None  # latest_stats' question in flight

    # ---- lifecycle ----
    async def start(self) -> messages.ModelInfo:
        """Spawn the engine process and wait until its model is loaded."""
        self._paths = paths = IpcPaths.create()
        listener = paths.listen()
        mp = multiprocessing.get_context("spawn")
        self.process = mp.Process(
            target=_engine_main,
            args=(self.engine_args, paths, self.log_level),
            name="breakgraph-engine",
            # daemonic: multiprocessing terminates it if the API process exits without close();
            # with --tp-size > 1 it spawns the TP workers, which a daemonic process may not
            # (it then watches the API process itself, as every engine process does)
            daemon=self.engine_args.tp_size == 1,
        )
        self.process.start()
        logger.info("engine process %d started; loading the model", self.process.pid)
        loop = asyncio.get_running_loop()
        try:
            with listener:
                sock = await accept_engine(listener, self.process.is_alive)
        except ConnectionError:
            raise RuntimeError(self._exit_message()) from None
        self._ready = loop.create_future()
        self._conn = EngineConnection(sock, self._on_message, self._on_lost)
        self.info = await self._wait_ready()
        loop.add_reader(self.process.sentinel, self._on_process_exit)
        return self.info

    async def _wait_ready(self) -> messages.ModelInfo:
        while not self._ready.done():
            await asyncio.wait([self._ready], timeout=0.2)
            if not self._ready.done() and not self.process.is_alive():
                self._conn.deliver()  # its last word (StartupError) may still be unread
                if not self._ready.done():
                    raise RuntimeError(self._exit_message())
        return self._ready.result()

    def _exit_message(self) -> str:
        self.process.join(1)
        return f"the engine process exited with code {self.process.exitcode}"

    def close(self, timeout_s: float = 10.0, kill: bool = False) -> None:
        """Stop the engine process (politely, then by force) and release the sockets.
        ``kill``: an engine still busy after ``timeout_s`` is killed at once (a forced exit;
        a ready engine only notes a SIGTERM, see engine_process.py)."""
        if self._closing:
            return
        self._closing = True
        proc = self.process
        start = time.monotonic()
        if proc is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(proc.sentinel)
            if proc.is_alive() and self.info is not None:
                with contextlib.suppress(EngineError):
                    self._send(messages.Shutdown())
                    self._conn.flush(timeout_s=1.0)  # the loop will not run to write it
                proc.join(timeout_s)
            if proc.is_alive() and not kill:
                if self.info is not None:
                    logger.warning("engine process did not stop; terminating it")
                proc.terminate()  # still loading the model: nothing to lose
                proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
            logger.info(
                "engine process exited (code %s) in %.2f s", proc.exitcode, time.monotonic() - start
            )
        self._fail_all(EngineError("the server is shutting down"))
        if self._conn is not None:
            self._conn.close()
        if self._paths is not None:
            self._paths.remove()

    def _on_process_exit(self) -> None:
        asyncio.get_running_loop().remove_reader(self.process.sentinel)
        if self._closing:
            return
        self.process.join(1)
        self.dead = True
        logger.error("the engine process died (exit code %s)", self.process.exitcode)
        self._fail_all(EngineError("the engine process died"))
        if self.on_death is not None:
            self.on_death()

    @property
    def alive(self) -> bool:
        return not self.dead and not self._closing and self.process is not None

    @property
    def admitting(self) -> bool:
        return self.alive and not self.draining

    def drain(self) -> None:
        """Stop admitting requests (503); those in flight go on."""
        self.draining = True

    def end_all(self, message: str) -> int:
        """End every in-flight request now: abort it in the engine and answer its waiter 503."""
        rids = self.requests.rids()
        for rid in rids:
            with contextlib.suppress(EngineError):
                self.abort(rid)
        error = EngineError(message)
        for rid in rids:
            self.requests.end(rid, error)
        return len(rids)

    # ---- requests ----
    def submit(
        self,
        rid: str,
        input_ids: list[int],
        sampling: SamplingParams,
        return_logprob: bool,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        received_at: float | None = None,
        received_perf: float | None = None,
    ) -> asyncio.Queue:
        """Send a validated request; its TokenDeltas (or an exception, last) arrive on the queue.

        ``received_at`` (time.time) and ``received_perf`` (perf_counter): when the API process
        received it (default: now); TTFT and end-to-end latency count from there."""
        if not self.alive:
            raise EngineError("the engine is not running")
        if self.draining:
            raise EngineError("the server is shutting down")
        if rid in self.requests:
            raise RequestRejected(f"request id {rid!r} is already in use")
        try:  # encode before registering: a request that cannot be sent leaves nothing behind
            data = messages.encode(
                messages.GenerateReq(
                    rid, input_ids, sampling, return_logprob, logprob_start_len, top_logprobs_num
                )
            )
        except (ValueError, TypeError, OverflowError) as e:
            raise RequestRejected(f"the request cannot be sent to the engine: {e}") from None
        now_perf, now = time.perf_counter(), time.time()
        entry = InFlight(
            asyncio.Queue(),
            now_perf if received_perf is None else received_perf,
            now if received_at is None else received_at,
            now,
        )
        # sent_at (``now``) is stamped before the send: the engine may read the message
        # before this coroutine runs again, and the IPC stage must not come out negative
        self._send_bytes(data)
        self.requests.add(rid, entry)
        if self.log_requests:
            request_log.info(
                "received %s: %d prompt tokens, max_new_tokens=%d temperature=%g",
                rid,
                len(input_ids),
                sampling.max_new_tokens,
                sampling.temperature,
            )
        return entry.queue

    def sent_at(self, rid: str) -> float | None:
        """Wall-clock time the request's message was handed to the engine socket."""
        entry = self.requests.get(rid)
        return None if entry is None else entry.sent_at

    def abort(self, rid: str) -> bool:
        """Ask the engine to abort a request; it answers with a finished output. False if
        the request is not in flight or its abort was asked already."""
        entry = self.requests.get(rid)
        if entry is None or entry.aborting or not self.alive:
            return False
        entry.aborting = True
        self._send(messages.AbortReq(rid))
        return True

    def abort_samples(self, rid: str) -> int:
        """Abort ``rid``, or if no request has that id, the samples of an ``n`` > 1 request
        sent with it (``rid-0`` .. ``rid-63``); returns how many were asked to abort now (a
        sample whose abort was asked before is not counted again)."""
        if rid in self.requests:
            return int(self.abort(rid))
        samples = (f"{rid}-{j}" for j in range(MAX_SAMPLES))
        return sum(self.abort(r) for r in samples if r in self.requests)

    def abort_all(self) -> int:
        rids = self.requests.rids()
        for rid in rids:
            self.abort(rid)
        return len(rids)

    @property
    def num_inflight(self) -> int:
        return len(self.requests)

    async def stats(self, timeout_s: float = 30.0) -> EngineStats:
        """The engine's live load and KV usage (``Engine.stats()``), answered between two steps."""
        reply: messages.StatsReply = await self._call(messages.StatsReq, timeout_s)
        return reply.stats

    async def latest_stats(self, wait_s: float = STATS_WAIT_S) -> tuple[EngineStats, float]:
        """The engine's stats and their age in seconds: its answer if it comes within
        ``wait_s`` (it answers between two steps), else what it last published (its loop
        publishes them before and during work, engine_process.py), so a scrape or a probe
        never waits for a long step. Concurrent callers share one question."""
        if self._stats_call is None or self._stats_call.done():
            self._stats_call = call = asyncio.ensure_future(self.stats())
            call.add_done_callback(_retrieve)  # its error is raised below, or not wanted
        call = self._stats_call
        await asyncio.wait([call], timeout=None if self._stats is None else wait_s)
        if call.done() and call.exception() is not None:
            raise call.exception()
        return self._stats, time.monotonic() - self._stats_at

    async def flush_cache(self, timeout_s: float = 30.0) -> bool:
        """Drop the prefix cache; False while requests are in flight."""
        reply: messages.FlushCacheReply = await self._call(messages.FlushCacheReq, timeout_s)
        return reply.flushed

    async def profile(
        self, start: bool, output_dir: str = "", timeout_s: float = 300.0
    ) -> messages.ProfileReply:
        """Start or stop the engine's profiler (engine/profiling.py); a stop waits for the
        trace to be written (seconds for a long profile)."""
        make = functools.partial(messages.ProfileReq, start=start, output_dir=output_dir)
        return await self._call(make, timeout_s, "ProfileReq")

    async def _call(
        self, request: Callable[[int], messages.ToEngine], timeout_s: float, name: str = ""
    ) -> messages.StatsReply | messages.FlushCacheReply | messages.ProfileReply:
        """Send ``request(call_id)`` and wait for the reply with that call id."""
        if not self.alive:
            raise EngineError("the engine is not running")
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        self._send(request(call_id))
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            name = name or request.__name__
            raise EngineError(f"the engine did not answer {name} in {timeout_s} s") from None
        finally:
            self._calls.pop(call_id, None)

    def _send(self, msg: messages.ToEngine) -> None:
        self._send_bytes(messages.encode(msg))

    def _send_bytes(self, data: bytes) -> None:
        try:
            self._conn.send(data)
        except ConnectionError as e:
            raise EngineError(f"cannot reach the engine process: {e}") from e

    # ---- receiving ----
    def _on_message(self, data: bytes) -> None:
        try:
            msg = messages.decode(data)
            if not self._ready.done():  # starting: the first message says how it went
                if isinstance(msg, messages.Ready):
                    self._ready.set_result(msg.info)
                elif isinstance(msg, messages.StartupError):
                    error = RuntimeError(f"the engine failed to start: {msg.message}")
                    self._ready.set_exception(error)
                return
            self._dispatch(msg)
        except Exception:
            logger.exception("failed to dispatch an engine message")

    def _on_lost(self) -> None:
        """The engine's end of the socket closed: it exited (``_on_process_exit`` reports
        a death), or it is exiting after a shutdown."""
        logger.debug("the engine process closed its socket")

    def _dispatch(self, msg: messages.FromEngine) -> None:
        match msg:
            case messages.StepResult():
                self.requests.route(msg)
            case messages.StatsReply() | messages.FlushCacheReply() | messages.ProfileReply():
                if isinstance(msg, messages.StatsReply):
                    self._stats, self._stats_at = msg.stats, time.monotonic()
                fut = self._calls.get(msg.call_id)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            case _:
                logger.error("unexpected engine message %s", type(msg).__name__)

    def _fail_all(self, error: EngineError) -> None:
        self.requests.fail_all(error)
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(error)


def _retrieve(future: asyncio.Future) -> None:
    """Mark a future's error as seen (asyncio logs an error no one retrieved)."""
    if not future.cancelled():
        future.exception()
