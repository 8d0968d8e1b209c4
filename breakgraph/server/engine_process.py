"""The engine process: owns the Engine and runs the step loop, apart from the HTTP work.

Idle, it waits on its socket (server/ipc.py). With work, each iteration reads what arrived
without blocking, runs one ``engine.step()`` and sends that step's outputs as one message;
between steps it publishes its stats now and then (``STATS_INTERVAL_S``). It exits on a
shutdown message, when the API process closes its end, or when the API process that spawned
it is gone.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import time

from breakgraph.common import gc_watch
from breakgraph.common.logs import configure_logging
from breakgraph.common.messages import (
    STATS_PUBLISHED,
    AbortReq,
    FlushCacheReply,
    FlushCacheReq,
    FromEngine,
    GenerateReq,
    ModelInfo,
    ProfileReply,
    ProfileReq,
    Ready,
    RequestError,
    Shutdown,
    StartupError,
    StatsReply,
    StatsReq,
    StepResult,
    ToEngine,
    TokenDelta,
    decode,
    encode,
)
from breakgraph.engine.args import EngineArgs
from breakgraph.engine.engine import Engine
from breakgraph.engine.profiling import EngineProfiler
from breakgraph.server.ipc import EngineSocket, IpcPaths

logger = logging.getLogger(__name__)

PARENT_CHECK_INTERVAL_S = 1.0
GRAMMAR_POLL_S = 0.002  # idle but a request's grammar compiles: how often to look
# the loop publishes its stats (a StatsReply, STATS_PUBLISHED) as it starts work, this often
# while it works, and as it goes idle: /metrics and /get_server_info fall back on the latest
# when the engine does not answer at once (a long prefill on the CPU is one step of seconds)
STATS_INTERVAL_S = 0.1
# SIGTERM sent to the whole process group (systemd, `timeout`, `kill -- -PGID`) reaches us too:
# keep serving while the API process shuts down gracefully (--shutdown-timeout), and stop on
# its word; stop anyway this long after its grace period (a SIGTERM meant for the engine alone).
SIGTERM_GRACE_S = 10.0


def run_engine_process(engine_args: EngineArgs, paths: IpcPaths, log_level: str) -> None:
    """Entry point of the spawned engine process."""
    # Ctrl-C reaches the whole foreground process group; the API process decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging(log_level, process="engine")  # start-up progress at the default level
    sock = EngineSocket.connect(paths.socket_path)
    code = 0
    engine = None
    try:
        try:
            engine = Engine(engine_args)
            report = engine.run_warmups()  # --warmups / --skip-server-warmup
            if report is not None:
                logger.info("warm-up: %s", report)
        except Exception as e:  # the API process reports it in one line; the trace at debug
            logger.debug("engine failed to start", exc_info=True)
            sock.send(encode(StartupError(f"{type(e).__name__}: {e}")))
            code = 1
            return
        signal.signal(signal.SIGTERM, _on_sigterm)  # while loading, SIGTERM just ends us
        engine.mark_ready()
        frozen = gc_watch.freeze()  # start-up's objects out of every later collection
        logger.info("ready; %d objects frozen out of garbage collection", frozen)
        sock.send(encode(Ready(model_info(engine))))
        grace_s = engine_args.shutdown_timeout + SIGTERM_GRACE_S
        EngineLoop(engine, sock, grace_s, engine_args.resolved_idle_spin_s()).run()
    except Exception:
        logger.exception("engine loop crashed")
        code = 1
    finally:
        if engine is not None:
            # its TP workers, if any; the group is not torn down: this process exits next
            # (NCCL's teardown waits on every peer's: 10 s and more on two H200s)
            engine.shutdown(leave_group=False)
        sock.flush(timeout_s=1.0)  # the last outputs, or why the engine failed
        sock.close()
        tp = sys.modules.get("breakgraph.engine.tp.teardown")  # imported only where TP ran
        if tp is not None:
            tp.exit_if_stuck(code)
        if code:
            sys.exit(code)


_sigterm_at: float | None = None


def _on_sigterm(signum: int, frame: object) -> None:
    global _sigterm_at
    if _sigterm_at is None:
        _sigterm_at = time.monotonic()


def model_info(engine: Engine) -> ModelInfo:
    return ModelInfo(
        model_source=engine.model_source,
        architecture=engine.model_config.architecture,
        vocab_size=engine.vocab_size,
        context_length=engine.context_len,
        max_running_requests=engine.max_running_requests,
        kv_capacity_tokens=engine.allocator.capacity,
        dtype=str(engine.dtype).removeprefix("torch."),
        device=str(engine.device),
        engine_pid=os.getpid(),
        memory=engine.rank.memory,
    )


class EngineLoop:
    def __init__(
        self,
        engine: Engine,
        sock: EngineSocket,
        sigterm_grace_s: float = SIGTERM_GRACE_S,
        idle_spin_s: float = 0.0,
    ):
        self.engine = engine
        self.sigterm_grace_s = sigterm_grace_s
        self.sock = sock
        self.idle_spin_s = idle_spin_s  # --idle-spin-ms
        self._worked = False  # the last iteration stepped or read input
        self._stop = False
        # produced between steps (aborts, rejected adds); sent with the next step's outputs
        self._outputs: list[TokenDelta] = []
        self._token_rids: list[str] = []  # plain tokens (StepResult.token_rids), this step's
        self._token_ids: list[int] = []
        self._delta_rids: set[str] = set()  # the rids in _outputs
        # stats calls read this turn, answered at its end (after the release: an abort read
        # before one has left the running requests, and its KV is released then)
        self._stats_calls: list[int] = []
        self._errors: list[RequestError] = []
        self._parent = multiprocessing.parent_process()
        self._last_parent_check = time.monotonic()
        self._stats_at = 0.0  # when the last stats snapshot was published (monotonic)
        self._stats_busy = False  # whether the engine had work then
        self.profiler = EngineProfiler()  # /start_profile, /stop_profile
        # finished requests' KV is released after their outputs are sent (below)
        engine.release_finished(defer=True)

    def run(self) -> None:
        self._publish_stats()
        while not self._stop:
            self.turn()
        if self.profiler.running:  # a profile the client never stopped: its trace, kept
            logger.warning("profile stopped at shutdown: %s", self.profiler.stop()[1])
        logger.info("engine loop stopped")

    def turn(self) -> None:
        """One iteration: wait for input while idle, read it, step, send, release."""
        if not self.engine.has_work:
            # polled for idle_spin_s right after work, then asleep in poll
            spin, self._worked = (self.idle_spin_s if self._worked else 0.0), False
            wait_s = GRAMMAR_POLL_S if self.engine.compiling else PARENT_CHECK_INTERVAL_S
            if not self.sock.wait(wait_s, spin):
                self._check_parent()
                return
        self._worked = True
        self._drain()
        if self._stop:
            return
        # before a step that may be long: what it starts with (going idle waits for the
        # release below: an abort read just now still holds its KV)
        self._publish_stats_if_due(idle=False)
        step_ms = None
        if self.engine.has_work:
            start = time.perf_counter()
            outs = self.engine.step()
            step_ms = (time.perf_counter() - start) * 1000.0
            self._add_outputs(outs)
            # requests whose grammar did not compile: a 400 each
            self._errors += [RequestError(r, m) for r, m in self.engine.take_rejected()]
        if step_ms is not None or self._outputs or self._errors:
            self._send_step(step_ms)
        self.engine.release_finished()
        if self._stats_calls:
            stats, calls, self._stats_calls = self.engine.stats(), self._stats_calls, []
            for call_id in calls:
                self._send(StatsReply(call_id, stats))
        self._publish_stats_if_due()
        self._check_parent()

    def _publish_stats_if_due(self, idle: bool = True) -> None:
        """A snapshot as the engine starts work or (``idle``: once finished requests'
        KV is released) goes idle, and every STATS_INTERVAL_S while it works."""
        busy = self.engine.has_work
        if (busy != self._stats_busy and (busy or idle)) or (
            busy and time.monotonic() - self._stats_at >= STATS_INTERVAL_S
        ):
            self._publish_stats()

    def _publish_stats(self) -> None:
        self._stats_at, self._stats_busy = time.monotonic(), self.engine.has_work
        self._send(StatsReply(STATS_PUBLISHED, self.engine.stats()))

    def _add_outputs(self, outs: list[TokenDelta]) -> None:
        """A step's outputs: plain tokens into the message's two columns, the rest as deltas.
        The API routes the columns first, so a request with a delta in the message already
        sends any later token as a delta too (its outputs keep their order)."""
        rids, ids, after = self._token_rids, self._token_ids, self._delta_rids
        for o in outs:
            if is_plain(o) and o.rid not in after:
                rids.append(o.rid)
                ids.append(o.token_ids[0])
            else:
                self._add_delta(o)

    def _add_delta(self, out: TokenDelta) -> None:
        self._outputs.append(out)
        self._delta_rids.add(out.rid)

    def _send_step(self, step_ms: float | None) -> None:
        msg = StepResult(step_ms, self._outputs, self._errors,
                         token_rids=self._token_rids, token_ids=self._token_ids)  # fmt: skip
        if step_ms is not None:
            t = self.engine.last_step_timing
            msg.forward_ms, msg.gpu_ms, msg.gpu_step_ms = t.forward_ms, t.gpu_ms, t.gpu_step_ms
        self._send(msg)
        self._outputs, self._errors, self._token_rids, self._token_ids = [], [], [], []
        self._delta_rids = set()

    def _send(self, msg: FromEngine) -> None:
        try:
            self.sock.send(encode(msg))
        except ConnectionError:  # the API process's end is gone: no one to answer
            self._stop = True

    def _check_parent(self) -> None:
        now = time.monotonic()
        if now - self._last_parent_check < PARENT_CHECK_INTERVAL_S:
            return
        self._last_parent_check = now
        if self._parent is not None and not self._parent.is_alive():
            logger.warning("the API process is gone; engine exiting")
            self._stop = True
        elif _sigterm_at is not None and now - _sigterm_at > self.sigterm_grace_s:
            logger.warning(
                "SIGTERM %.0f s ago and no shutdown message; engine exiting", self.sigterm_grace_s
            )
            self._stop = True

    def _drain(self) -> None:
        frames = self.sock.read()
        received_at = time.time()  # the requests' timeline: they reached the engine
        for data in frames:
            if self._stop:
                return
            try:
                msg = decode(data)
            except ValueError as e:
                logger.error("dropped a message: %s", e)
                continue
            self._handle(msg, received_at)
        if self.sock.closed and not self._stop:
            logger.warning("the API process closed its end of the socket; engine exiting")
            self._stop = True

    def _handle(self, msg: ToEngine, received_at: float) -> None:
        match msg:
            case GenerateReq():
                self._add(msg, received_at)
            case AbortReq():
                out = self.engine.abort(msg.rid)
                if out is not None:
                    self._add_delta(out)
            case StatsReq():
                self._stats_calls.append(msg.call_id)
            case FlushCacheReq():
                flushed = self.engine.flush_cache()
                self._publish_stats()  # ahead of the reply: a read after it sees the flush
                self._send(FlushCacheReply(msg.call_id, flushed))
            case ProfileReq(start=True):
                self._send(ProfileReply(msg.call_id, *self.profiler.start(msg.output_dir)))
            case ProfileReq():
                self._send(ProfileReply(msg.call_id, *self.profiler.stop()))
            case Shutdown():
                self._stop = True
            case _:
                logger.error("unexpected message %s", type(msg).__name__)

    def _add(self, msg: GenerateReq, received_at: float) -> None:
        try:
            self.engine.add_request(
                msg.input_ids,
                msg.sampling,
                rid=msg.rid,
                return_logprob=msg.return_logprob,
                logprob_start_len=msg.logprob_start_len,
                top_logprobs_num=msg.top_logprobs_num,
                received_at=received_at,
            )
        except (ValueError, TypeError) as e:  # the API validates first; this is the backstop
            self._errors.append(RequestError(msg.rid, str(e)))


def is_plain(out: TokenDelta) -> bool:
    """One token and nothing else: neither the request's first output (its timeline, its
    counts) nor its last, no logprobs. The API process rebuilds its delta from the rid, the
    token and what the request's earlier deltas said."""
    return (
        out.timeline is None
        and not out.finished
        and len(out.token_ids) == 1
        and not out.logprobs
        and not out.top_logprobs
        and out.input_logprobs is None
    )
