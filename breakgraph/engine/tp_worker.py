"""Tensor parallelism across processes: rank 0 (the engine) drives ranks 1..N-1 (workers).

Rank 0 runs the scheduler. Before each forward its ModelRunner sends every worker one small
message (``StepMessage``: the step's lengths, slots, table rows and the request-table writes
made since the last step; a fixed binary layout, not a pickle), broadcasts the step's input
ids over the TP group (they may be a device tensor from overlap scheduling: never read on the
host), and every rank runs the same forward on its shard; only rank 0 samples.

Startup goes over the pipes, not collectives: each worker reports that it is up, then its KV
capacity (rank 0 waits for both watching the worker's process, so a worker that dies while
starting fails the engine at once, naming its error). A worker exits when rank 0 says so,
closes its pipe or dies; rank 0 raises a RuntimeError naming a dead worker (and its last
error) at its next step or read-back. A watchdog thread on rank 0 waits on the workers'
processes: one that dies outside shutdown aborts the group at once, so rank 0 is never left
waiting in a collective (NCCL would wait ``breakgraph.distributed.DEFAULT_TIMEOUT_S``, then
kill the process; gloo fails at once on the closed connection). On CUDA (NCCL,
``cuda:{rank}``, graphs capturing the all-reduce) every rank tears the group down at once at
shutdown: NCCL's teardown waits for its peers.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import socket
import struct
import sys
import threading
import time
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from breakgraph.distributed import TPGroup, abort_tp_group, destroy_tp_group, init_tp_group
from breakgraph.forward_batch import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)

_POLL_S = 1.0  # how often an idle worker checks that rank 0 is alive
_JOIN_S = 10.0  # how long shutdown waits for a worker before terminating it
_ABORT_S = 10.0  # how long a dead worker's group abort may take before rank 0 exits
# After a step a worker polls its pipe without sleeping for this long before it blocks: the
# next step's message usually comes within a step's time, and a blocked process's wake-up
# (tens of µs to more on an idle core) is on every step's critical path (rank 0's first
# all-reduce waits for the worker's launch). Costs one busy core per worker while serving;
# CUDA only.
SPIN_S = float(os.environ.get("BREAKGRAPH_TP_SPIN_MS", 50)) / 1e3
# BREAKGRAPH_TP_TRACE=1: at shutdown rank 0 logs its sends' host time and each worker where
# its steps' went (rank 0's send -> its receive -> its batch built -> its forward launched),
# as percentiles
TRACE = os.environ.get("BREAKGRAPH_TP_TRACE", "0") == "1"


@dataclass
class StepMessage:
    """One step as rank 0 sends it: everything but the input ids (broadcast as a tensor)."""

    mode: str  # ForwardMode value
    out_cache_loc: np.ndarray  # int32 [T]
    req_pool_indices: np.ndarray  # int32 [B]
    prefix_lens: np.ndarray  # int32 [B]
    extend_lens: np.ndarray  # int32 [B]
    table_writes: tuple[np.ndarray, np.ndarray, np.ndarray] | None  # (rows, cols, slots)
    prompt_rows: int = -1  # forward_prompt: rows (and targets) broadcast after the ids; -1: none
    top_k: int = 0
    sent_at: float = 0.0  # rank 0's time.perf_counter() at sending (CLOCK_MONOTONIC: host-wide)
    # forward (graphs when they fit), eager, or capture_whole (the step as one CUDA graph,
    # kept until the next capture: benches replay it with ReplayWhole)
    kind: str = "forward"


_MODES = tuple(m.value for m in ForwardMode)  # by index on the wire
_KINDS = ("forward", "eager", "capture_whole")
# a step on the wire: b"S", mode, kind, tokens, requests, table writes (-1: none), prompt
# rows, top_k, sent_at; then int32 slots [T], rows, prefix and extend lengths [B] each, and
# the table writes' rows, columns and slots [W] each
_STEP = struct.Struct("<cBBiiiiid")


def _step_bytes(msg: StepMessage) -> bytes:
    """``msg`` in a fixed binary layout: no pickling on the step's path (pickle and unpickle
    of a decode step: ~50 µs on a 2-core CPU; this: a few)."""
    writes = msg.table_writes
    arrays = [msg.out_cache_loc, msg.req_pool_indices, msg.prefix_lens, msg.extend_lens]
    if writes is not None:
        arrays += list(writes)
    head = _STEP.pack(
        b"S", _MODES.index(msg.mode), _KINDS.index(msg.kind), len(msg.out_cache_loc),
        len(msg.req_pool_indices), -1 if writes is None else len(writes[0]), msg.prompt_rows,
        msg.top_k, msg.sent_at,
    )  # fmt: skip
    return b"".join([head, *(np.asarray(a, dtype=np.int32).tobytes() for a in arrays)])


def _step_from_bytes(data: bytes) -> StepMessage:
    _, mode, kind, t, b, w, prompt_rows, top_k, sent_at = _STEP.unpack_from(data)
    flat = np.frombuffer(data, dtype=np.int32, offset=_STEP.size)
    at = t + 3 * b
    writes = None if w < 0 else (flat[at : at + w], flat[at + w : at + 2 * w], flat[at + 2 * w :])
    return StepMessage(
        _MODES[mode], flat[:t], flat[t : t + b], flat[t + b : t + 2 * b],
        flat[t + 2 * b : at], writes, prompt_rows, top_k, sent_at, _KINDS[kind],
    )  # fmt: skip


def _wire(obj) -> bytes:
    """What rank 0 sends a worker: a step in its binary layout, anything else pickled."""
    if isinstance(obj, StepMessage):
        return _step_bytes(obj)
    return b"P" + pickle.dumps(obj)


def _unwire(data: bytes):
    return _step_from_bytes(data) if data[:1] == b"S" else pickle.loads(data[1:])


@dataclass
class ReplayWhole:
    """Replay the step last captured whole (every rank at once: its all-reduces pair up)."""


@dataclass
class ExitNow:
    """Rank 0's process exits next: exit at once, without tearing the group down (NCCL's
    teardown waits for every peer's, and on two H200s it did not return in 10 s)."""


@dataclass
class WorkerSetup:
    """What rank 0 decides once and every worker must agree on."""

    max_running_requests: int
    context_len: int
    num_slots: int  # KV slots of every rank's pool: the smallest any rank can hold


# what a worker tells rank 0 at startup, over its pipe (rank 0 waits for these watching the
# worker's process, so a worker that dies while starting fails the engine at once, by name)
@dataclass
class WorkerUp:
    """The worker runs (imports done, arguments read) and joins the group now."""


@dataclass
class WorkerSlots:
    """The KV slots this worker's device has room for, its shard loaded."""

    num_slots: int


@dataclass
class WorkerFailed:
    """The worker's last word before it exits on an error."""

    error: str


def _i32(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)


def free_port() -> int:
    """A TCP port free on this host now (the TP group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(device: torch.device, rank: int) -> torch.device:
    """A rank's device: ``cuda:{rank}`` on CUDA, the CPU otherwise."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def claim_device(device: torch.device) -> None:
    """Make ``device`` this process's own. On CUDA the host's torch ops are bookkeeping
    (slots, table rows: up to 64K elements), which torch would split over an OpenMP thread
    per core; one busy core then holds up the whole op for an OS time slice (a 64K-slot
    table write: 0.24 ms on one thread, 6 ms on two with one core busy; on the H200 every
    other 64K-prefix hit spent ~10 ms more in scheduling). So one intra-op thread there."""
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
        torch.set_num_threads(1)


class TPDriver:
    """Rank 0's side: spawns the workers, sends them each step, stops them."""

    def __init__(self, args, size: int):
        self.size = size
        self.group: TPGroup | None = None
        self.req_pool = None  # set by attach(): the table whose writes go out with each step
        if mp.current_process().daemon:
            raise RuntimeError(
                "--tp-size > 1 needs a non-daemonic engine process (multiprocessing forbids "
                "daemonic processes children): start the engine process with daemon=False"
            )
        self.custom_all_reduce = not args.disable_custom_all_reduce
        self._trace = _StepTrace(0, ("send",)) if TRACE else None
        self.init_method = f"tcp://127.0.0.1:{free_port()}"
        ctx = mp.get_context("spawn")
        self.procs: list = []
        self.conns: list = []
        for rank in range(1, size):
            conn, child = ctx.Pipe()
            proc = ctx.Process(
                target=worker_main,
                args=(args, rank, size, self.init_method, child, os.getpid()),
                name=f"breakgraph-tp{rank}",
                daemon=True,
            )
            proc.start()
            child.close()  # the worker's end lives in the worker only: its death closes the pipe
            self.procs.append(proc)
            self.conns.append(conn)
        # the watchdog (started by setup) stops when told so, by shutdown or the finalizer
        self._watch_stop_r, self._watch_stop = mp.Pipe(duplex=False)
        self._watchdog: threading.Thread | None = None
        self._finalizer = weakref.finalize(
            self, _stop_workers, self.procs, self.conns, self._watch_stop
        )

    def join_group(self, device: torch.device) -> TPGroup:
        """Join the workers' group once each of them is up (a worker that dies while starting
        raises here instead of leaving rank 0 in the rendezvous until it times out)."""
        self._await_all(WorkerUp, "startup")
        try:
            self.group = init_tp_group(
                0, self.size, self.init_method, device,
                custom_all_reduce=self.custom_all_reduce,
            )  # fmt: skip
        except Exception as e:
            self._raise_dead(e, wait_s=2.0)
            raise
        return self.group

    def agree_num_slots(self, num_slots: int) -> int:
        """The KV slots of every rank's pool: the fewest that any rank's free memory allows."""
        reports = self._await_all(WorkerSlots, "model load")
        return min([num_slots, *(r.num_slots for r in reports)])

    def _await_all(self, kind: type, stage: str) -> list:
        return [
            self._await(rank, proc, conn, kind, stage)
            for rank, (proc, conn) in enumerate(zip(self.procs, self.conns, strict=True), 1)
        ]

    @staticmethod
    def _await(rank: int, proc, conn, kind: type, stage: str):
        """The next message of worker ``rank``, which must be a ``kind``; raise naming the
        worker (and its error, if it sent one) if it fails or exits first."""
        msg = None
        with contextlib.suppress(EOFError, OSError):  # a closed pipe: the worker is gone
            while not conn.poll(0.05) and proc.exitcode is None:
                pass
            if conn.poll(0):
                msg = conn.recv()
        if msg is None:
            proc.join(2.0)
            raise RuntimeError(
                f"TP worker rank {rank} exited (exit code {proc.exitcode}) during {stage}"
            )
        if isinstance(msg, WorkerFailed):
            raise RuntimeError(f"TP worker rank {rank} failed during {stage}: {msg.error}")
        if not isinstance(msg, kind):
            raise RuntimeError(f"TP worker rank {rank} sent {msg!r} during {stage}")
        return msg

    def setup(self, req_pool, setup: WorkerSetup) -> None:
        """Send the workers the engine's sizes; log ``req_pool``'s writes from now on; start
        the watchdog (the group is up: from now on a dead worker aborts it)."""
        self.req_pool = req_pool
        req_pool.write_log = []
        self._send(setup)
        self._watchdog = threading.Thread(
            target=_watch_workers, args=(self.procs, self._watch_stop_r, self.group),
            daemon=True, name="breakgraph-tp-watchdog",
        )  # fmt: skip
        self._watchdog.start()

    @contextlib.contextmanager
    def step(
        self, batch: ForwardBatch, rows=None, targets=None, top_k: int = 0, kind: str = "forward"
    ):
        """Send the step to the workers and broadcast its tensors; the body runs rank 0's
        forward. A collective failing because a worker died raises a RuntimeError naming it."""
        self.check_workers()
        msg = StepMessage(
            mode=batch.mode.value,
            out_cache_loc=_i32(batch.out_cache_loc_cpu),
            req_pool_indices=_i32(batch.req_pool_indices_cpu),
            prefix_lens=_i32(batch.prefix_lens_cpu),
            extend_lens=_i32(batch.extend_lens_cpu),
            table_writes=self.req_pool.drain_writes(),
            prompt_rows=-1 if rows is None else rows.shape[0],
            top_k=top_k,
            kind=kind,
        )
        msg.sent_at = time.perf_counter()
        self._send(msg)
        if self._trace is not None:
            self._trace.add(msg.sent_at, time.perf_counter())
        try:
            _broadcast_inputs(self.group, batch.input_ids, rows, targets)
            yield
        except Exception as e:
            self._raise_dead(e, wait_s=2.0)
            raise RuntimeError(f"tensor-parallel step failed: {e}") from e

    def replay_whole(self) -> None:
        """Have every worker replay its whole-step graph (see ``StepMessage.kind``)."""
        self.check_workers()
        self._send(ReplayWhole())

    def check_workers(self) -> None:
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns, strict=True), start=1):
            if proc.exitcode is not None:
                raise RuntimeError(
                    f"TP worker rank {rank} exited (exit code {proc.exitcode})"
                    f"{_last_word(conn)}: the engine cannot run further steps; restart it"
                )

    def _raise_dead(self, cause: Exception, wait_s: float) -> None:
        """If a worker died (give it ``wait_s`` to be reaped), raise naming it."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self.check_workers()
            except RuntimeError as e:
                raise e from cause
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def _send(self, obj) -> None:
        data = _wire(obj)
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send_bytes(data)
            except OSError as e:
                self._raise_dead(e, wait_s=2.0)
                raise RuntimeError(f"TP worker rank {rank} is unreachable: {e}") from e

    def shutdown(self, leave_group: bool = True) -> None:
        """Stop the workers and leave the TP group. Every rank tears the group down at once
        (NCCL's teardown waits for its peers): the workers at the stop message, rank 0 right
        after sending it, then rank 0 reaps them (terminating one that does not exit).

        ``leave_group=False`` where this process exits next (the server's engine process):
        no rank tears the group down (the OS frees what NCCL holds); the workers exit at once
        and this process must end through ``exit_if_stuck`` (its finalizers would tear down)."""
        global TEARDOWN_SKIPPED
        if self._trace is not None and self._trace.samples["send"]:
            logger.warning("%s", self._trace.report())
            self._trace.samples["send"].clear()
        _signal_stop(self._watch_stop)  # the workers exit now: not a failure
        if self._watchdog is not None:
            self._watchdog.join(_JOIN_S)
        stop = None if leave_group else ExitNow()
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send_bytes(_wire(stop))
        group, self.group = self.group, None
        if not leave_group:
            TEARDOWN_SKIPPED = TEARDOWN_SKIPPED or group is not None
            self._finalizer()  # reaps the workers (they exit at once)
            return
        paired = all(p.exitcode is None for p in self.procs)  # else no peer to pair with
        if group is not None and paired:
            _leave_group(group, _JOIN_S)
        self._finalizer()
        if group is not None and not paired:
            _leave_group(group, _JOIN_S)


def _last_word(conn) -> str:
    """``: <error>`` if the dead worker behind ``conn`` said why it failed, else ''."""
    with contextlib.suppress(EOFError, OSError):
        while conn.poll(0):
            msg = conn.recv()
            if isinstance(msg, WorkerFailed):
                return f": {msg.error}"
    return ""


def _watch_workers(procs, stop, group: TPGroup, abort_s: float = _ABORT_S) -> None:
    """Rank 0's watchdog: wait for a worker to exit or ``stop`` to be sent (shutdown); a
    worker gone first aborts the group, so a wait on it fails now (``abort_tp_group``).

    NCCL's abort sets its communicators' abort flag (the kernels waiting on the dead peer,
    inside CUDA graphs too, return), then reclaims their resources, which recent NCCL does
    in step with its peers (NVIDIA/nccl#863): with a peer killed that may never return. If
    the abort has not returned in ``abort_s``, or the group's one-shot all-reduce is on and
    the engine has not stopped ``abort_s`` after the abort, this process cannot be trusted to
    get out of its collectives: it kills the other workers and exits (code 1) after saying
    why, and a server answers 503 for it (the API process watches the engine's)."""
    ranks = {proc.sentinel: rank for rank, proc in enumerate(procs, start=1)}
    ready = mp.connection.wait([stop, *ranks])
    gone = [ranks[r] for r in ready if r in ranks]
    if stop in ready or not gone:
        return
    rank = gone[0]
    procs[rank - 1].join(1.0)  # reap it: its exit code
    said = f"TP worker rank {rank} exited (exit code {procs[rank - 1].exitcode})"
    logger.error("%s: aborting the TP group; the engine stops at its next step", said)
    aborter = threading.Thread(
        target=abort_tp_group, args=(group,), daemon=True, name="breakgraph-tp-abort"
    )
    aborter.start()
    aborter.join(abort_s)
    if aborter.is_alive():
        _exit_engine(procs, f"{said} and the TP group's abort did not return in {abort_s:g} s")
    # the one-shot all-reduce's barrier waits on the GPU for the dead peer's signal, which no
    # abort reaches: a step caught in it never returns, so the engine gets abort_s to stop
    if group.one_shot is not None and not stop.poll(abort_s):
        _exit_engine(
            procs,
            f"{said} and the engine did not stop in {abort_s:g} s (a one-shot all-reduce "
            "waits on the GPU for the dead peer)",
        )


def _exit_engine(procs, why: str) -> None:
    """This process cannot be trusted to get out of its collectives: kill the other workers
    (no orphan left in a collective with nobody; exit skips atexit) and exit, code 1."""
    logger.critical("%s: exiting the engine process", why)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    _exit_now(1)


def _exit_now(code: int) -> None:
    """Exit at once, without finalizers, the logs and output flushed first."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _destroy_quietly(group: TPGroup) -> None:
    try:
        destroy_tp_group(group)
    except Exception as e:  # noqa: BLE001 - an aborted group may refuse its teardown
        logger.warning("TP group teardown failed: %s", e)


# Set when a TP group's teardown did not return: the thread left in it makes the process die
# in C++ at interpreter exit ("terminate called without an active exception", SIGABRT) after
# its work is done; the engine process and the CLI end with os._exit instead (exit_if_stuck).
TEARDOWN_STUCK = False
# Set when rank 0 left its group up on purpose (``TPDriver.shutdown(leave_group=False)``):
# the process ends through exit_if_stuck likewise.
TEARDOWN_SKIPPED = False


def _leave_group(group: TPGroup, timeout_s: float) -> None:
    """Destroy the group, giving up (with a warning) if a peer never joins the teardown."""
    global TEARDOWN_STUCK
    t = threading.Thread(target=_destroy_quietly, args=(group,), daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        TEARDOWN_STUCK = True
        logger.warning("TP group teardown did not finish in %.0f s: a worker is stuck", timeout_s)


def exit_if_stuck(code: int) -> None:
    """End the process now with ``code`` if a TP group's teardown is stuck (see
    TEARDOWN_STUCK) or was skipped (TEARDOWN_SKIPPED): its finalizers would abort the process
    or wait on the group instead."""
    if TEARDOWN_STUCK:
        logger.warning("exiting without finalizers: a TP group's teardown is still running")
        _exit_now(code)
    if TEARDOWN_SKIPPED:
        logger.info("exiting without finalizers: the TP group is left to the OS")
        _exit_now(code)


def _signal_stop(watch_stop) -> None:
    """Tell the watchdog the workers are about to exit (once)."""
    with contextlib.suppress(OSError):
        if not watch_stop.closed:
            watch_stop.send(None)
            watch_stop.close()


def _stop_workers(procs, conns, watch_stop) -> None:
    _signal_stop(watch_stop)
    for conn in conns:
        with contextlib.suppress(OSError):
            conn.send_bytes(_wire(None))
    deadline = time.monotonic() + _JOIN_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.terminate()
            proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in conns:
        conn.close()


def _broadcast_inputs(group: TPGroup, input_ids, rows=None, targets=None) -> None:
    """Rank 0's step tensors into the workers' buffers of the same shapes (int64)."""
    for t in (input_ids, rows, targets):
        if t is not None:
            if group.rank == 0 and (t.dtype != torch.int64 or not t.is_contiguous()):
                t = t.to(torch.int64).contiguous()  # a copy to send; rank 0 keeps its own
            group.broadcast(t, src=0)


class _ParentGone(Exception):
    pass


def _recv(conn, parent_pid: int, spin_s: float = 0.0):
    """The next message from rank 0, polling without a sleep for ``spin_s`` first."""
    if spin_s > 0:
        deadline = time.perf_counter() + spin_s
        while time.perf_counter() < deadline:
            if conn.poll(0):
                return _unwire(conn.recv_bytes())
    while not conn.poll(_POLL_S):
        if os.getppid() != parent_pid:
            raise _ParentGone
    return _unwire(conn.recv_bytes())


class _StepTrace:
    """Host time of a rank's steps between consecutive stamps (``BREAKGRAPH_TP_TRACE=1``):
    rank 0 sends (stamped before and after its pipe writes); a worker's pipe (rank 0's stamp
    to its receive), build and launch."""

    def __init__(self, rank: int, stages: tuple[str, ...]):
        self.rank = rank
        self.samples: dict[str, list[float]] = {s: [] for s in stages}

    def add(self, *stamps: float) -> None:
        """One step's ``time.perf_counter()`` stamps, one more than the stages."""
        for xs, a, b in zip(self.samples.values(), stamps[:-1], stamps[1:], strict=True):
            xs.append((b - a) * 1e6)

    def report(self) -> str:
        parts = []
        for stage, xs in self.samples.items():
            if xs:
                xs = sorted(xs)
                p = [xs[min(len(xs) - 1, int(q * len(xs)))] for q in (0.5, 0.9, 0.99)]
                parts.append(f"{stage} p50 {p[0]:.0f} p90 {p[1]:.0f} p99 {p[2]:.0f}")
        n = len(next(iter(self.samples.values())))
        return f"TP rank {self.rank} trace, {n} steps, us: " + "; ".join(parts)


def worker_main(args, rank: int, size: int, init_method: str, conn, parent_pid: int) -> None:
    """A worker rank: build this rank's shard, KV pool and runner, then run rank 0's steps."""
    logging.basicConfig(level=logging.WARNING, format=f"[tp{rank}] %(levelname)s %(message)s")
    # Ctrl-C reaches the whole process group: rank 0 stops the workers (or they see it gone)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # a stuck rank: `kill -USR1 <pid>` prints every thread's stack to its stderr
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    group = None
    try:
        group = _serve(args, rank, size, init_method, conn, parent_pid)
    except (EOFError, _ParentGone, ConnectionError):
        logger.warning("TP worker rank %d: rank 0 is gone, exiting", rank)
    except Exception as e:
        logger.exception("TP worker rank %d failed", rank)
        with contextlib.suppress(Exception):
            conn.send(WorkerFailed(f"{type(e).__name__}: {e}"))
        os._exit(1)  # no teardown that could block on the group
    finally:
        if group is not None:
            with contextlib.suppress(Exception):
                destroy_tp_group(group)


def _serve(args, rank, size, init_method, conn, parent_pid) -> TPGroup:
    from breakgraph.cache.kv_pool import KVPool
    from breakgraph.cache.req_to_token import ReqToTokenPool
    from breakgraph.engine.engine import capture_graphs, configure_model, num_kv_slots
    from breakgraph.engine.model_runner import ModelRunner
    from breakgraph.models.loader import load_model, resolve_dtype

    device = rank_device(torch.device(args.resolved_device()), rank)
    claim_device(device)
    torch.manual_seed(args.seed)
    conn.send(WorkerUp())
    group = init_tp_group(
        rank, size, init_method, device, custom_all_reduce=not args.disable_custom_all_reduce
    )
    model = load_model(
        args.model_path,
        args.load_format,
        args.dtype,
        device,
        args.seed,
        args.context_length,
        tp_group=group,
    ).model
    configure_model(model, args)
    dtype = resolve_dtype(args.dtype, device)
    conn.send(WorkerSlots(num_kv_slots(args, model, dtype, device)))
    setup: WorkerSetup | None = _recv(conn, parent_pid)
    if setup is None:  # rank 0 failed to start and stops us
        return group
    kv_pool = KVPool.from_shapes(setup.num_slots + 1, model.kv_cache_shapes(), dtype, device)
    req_pool = ReqToTokenPool(setup.max_running_requests + 1, setup.context_len, device)
    runner = ModelRunner(model, kv_pool, req_pool.table)
    if device.type == "cuda":
        capture_graphs(args, runner, req_pool, setup.max_running_requests, setup.context_len)
    whole = None  # the replay of the step last captured whole
    trace = _StepTrace(rank, ("pipe", "build", "launch")) if TRACE else None
    spin_s = SPIN_S if device.type == "cuda" else 0.0  # the CPU's ranks share its cores
    while (msg := _recv(conn, parent_pid, spin_s)) is not None:
        if isinstance(msg, ReplayWhole):
            whole()
        elif isinstance(msg, ExitNow):
            if trace is not None:
                logger.warning("%s", trace.report())
            _exit_now(0)  # no teardown: rank 0 skips its own too (ExitNow)
        else:
            whole = _run_step(msg, runner, req_pool, group, device, trace) or whole
    if trace is not None:
        logger.warning("%s", trace.report())
    return group


def _run_step(msg: StepMessage, runner, req_pool, group: TPGroup, device, trace=None):
    """Run rank 0's step here; for ``capture_whole``, return the captured step's replay."""
    received = time.perf_counter()
    if msg.table_writes is not None:
        req_pool.apply_writes(*msg.table_writes)
    n = len(msg.out_cache_loc)
    decode = msg.mode == ForwardMode.DECODE.value
    batch = ForwardBatch.build(
        ForwardMode(msg.mode),
        np.zeros(n, dtype=np.int64),
        msg.out_cache_loc,
        msg.req_pool_indices,
        msg.prefix_lens,
        msg.extend_lens,
        device,
        table_width=req_pool.max_context_len if decode else None,
    )
    batch.input_ids = torch.empty(n, dtype=torch.int64, device=device)
    if decode:  # rank 0's scheduler wrote its own copy likewise
        req_pool.write_batch(batch)
    if msg.prompt_rows < 0:
        built = time.perf_counter()
        _broadcast_inputs(group, batch.input_ids)
        if msg.kind == "capture_whole":
            return runner.capture_whole(batch)
        (runner.forward_eager if msg.kind == "eager" else runner.forward)(batch)
        if trace is not None:
            trace.add(msg.sent_at, received, built, time.perf_counter())
        return None
    rows = torch.empty(msg.prompt_rows, dtype=torch.int64, device=device)
    targets = torch.empty(msg.prompt_rows, dtype=torch.int64, device=device)
    _broadcast_inputs(group, batch.input_ids, rows, targets)
    runner.forward_prompt(batch, rows, targets, msg.top_k)
    return None
