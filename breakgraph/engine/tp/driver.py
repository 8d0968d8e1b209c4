"""Rank 0's side of tensor parallelism: spawn the workers, agree the KV pool's size, send each
step, watch the workers, stop them.

Startup goes over the pipes, not collectives: each worker reports that it is up, then its KV
capacity (rank 0 waits for both watching the worker's process, so a worker that dies while
starting fails the engine at once, naming its error). A worker exits when rank 0 says so,
closes its pipe or dies; rank 0 raises a RuntimeError naming a dead worker (and its last
error) at its next step or read-back. A watchdog thread on rank 0 waits on the workers'
processes: one that dies outside shutdown aborts the group at once, so rank 0 is never left
waiting in a collective (NCCL would wait ``BREAKGRAPH_TP_TIMEOUT_S``, then kill the process;
gloo fails at once on the closed connection).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import socket
import threading
import time
import weakref

import numpy as np
import torch

from breakgraph.common import envs
from breakgraph.distributed import TPGroup, abort_tp_group, init_tp_group
from breakgraph.engine.graphs.key import StepKey
from breakgraph.engine.tp import teardown
from breakgraph.engine.tp.trace import StepTrace
from breakgraph.engine.tp.wire import (
    CODEC,
    ExitNow,
    StepMessage,
    Stop,
    TableWrites,
    WorkerFailed,
    WorkerSetup,
    WorkerSlots,
    WorkerUp,
    broadcast_inputs,
    recv,
)
from breakgraph.engine.tp.worker import worker_main
from breakgraph.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

_JOIN_S = 10.0  # how long shutdown waits for a worker before terminating it
_ABORT_S = 10.0  # how long a dead worker's group abort may take before rank 0 exits


def _i32(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)


def free_port() -> int:
    """A TCP port free on this host now (the TP group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TPWorkerError(RuntimeError):
    """A TP worker failed or exited; ``error``: what it said (``Type: message``), if it did."""

    def __init__(self, text: str, rank: int, error: str = ""):
        super().__init__(text)
        self.rank = rank
        self.error = error

    @property
    def out_of_memory(self) -> bool:
        return self.error.startswith("OutOfMemoryError")


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
        self._trace = StepTrace(0, ("send",)) if envs.TP_TRACE.get() else None
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
        # the watchdog (started by attach) stops when told so, by shutdown or the finalizer
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
        """The KV slots of every rank's pool: the fewest that any rank's free memory allows;
        the workers are told it."""
        reports = self._await_all(WorkerSlots, "model load")
        num_slots = min([num_slots, *(r.num_slots for r in reports)])
        self._send(WorkerSetup(num_slots))
        return num_slots

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
                msg = recv(conn)
        if msg is None:
            proc.join(2.0)
            raise TPWorkerError(
                f"TP worker rank {rank} exited (exit code {proc.exitcode}) during {stage}", rank
            )
        if isinstance(msg, WorkerFailed):
            raise TPWorkerError(
                f"TP worker rank {rank} failed during {stage}: {msg.error}", rank, msg.error
            )
        if not isinstance(msg, kind):
            raise RuntimeError(f"TP worker rank {rank} sent {msg!r} during {stage}")
        return msg

    def attach(self, req_pool) -> None:
        """Log ``req_pool``'s writes from now on (they go out with each step); start the
        watchdog (the group is up: from now on a dead worker aborts it)."""
        self.req_pool = req_pool
        req_pool.write_log = []
        self._watchdog = threading.Thread(
            target=_watch_workers, args=(self.procs, self._watch_stop_r, self.group),
            daemon=True, name="breakgraph-tp-watchdog",
        )  # fmt: skip
        self._watchdog.start()

    @contextlib.contextmanager
    def step(self, batch: ForwardBatch, key: StepKey, rows=None, targets=None, top_k: int = 0):
        """Send the step and its key to the workers and broadcast its tensors; the body runs
        rank 0's forward. A collective failing because a worker died raises a RuntimeError
        naming it."""
        self.check_workers()
        rows_w, cols_w, slots_w = self.req_pool.drain_writes() or (None, None, None)
        msg = StepMessage(
            mode=batch.mode.value,
            # a device step's slots are gathered from the table on each rank
            out_cache_loc=_i32(batch.out_cache_loc_cpu if batch.device_base is None else []),
            req_pool_indices=_i32(batch.req_pool_indices_cpu),
            prefix_lens=_i32(batch.prefix_lens_cpu),
            extend_lens=_i32(batch.extend_lens_cpu),
            key=key,
            write_rows=rows_w,
            write_cols=cols_w,
            write_slots=slots_w,
            prompt_rows=-1 if rows is None else rows.shape[0],
            top_k=top_k,
            all_rows=batch.logits_rows.shape[0] != batch.batch_size,
            device_base=batch.device_base is not None,
        )
        msg.sent_at = time.perf_counter()
        self._send(msg)
        if self._trace is not None:
            self._trace.add(msg.sent_at, time.perf_counter())
        try:
            broadcast_inputs(self.group, batch.input_ids, rows, targets, batch.device_base)
            yield
        except Exception as e:
            self._raise_dead(e, wait_s=2.0)
            raise RuntimeError(f"tensor-parallel step failed: {e}") from e

    def send_op(self, op) -> None:
        """Send the workers a rank op (engine/rank_ops.py) with the request-table writes made
        since the last message; rank 0 does the op next."""
        self.check_workers()
        writes = self.req_pool.drain_writes()
        op.writes = None if writes is None else TableWrites(*writes)
        self._send(op)

    def check_workers(self) -> None:
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns, strict=True), start=1):
            if proc.exitcode is not None:
                said = _last_word(conn)
                raise TPWorkerError(
                    f"TP worker rank {rank} exited (exit code {proc.exitcode})"
                    f"{': ' + said if said else ''}: the engine cannot run further steps; "
                    "restart it",
                    rank, said,
                )  # fmt: skip

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
        data = CODEC.encode(obj)
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
        and this process must end through ``teardown.exit_if_stuck`` (its finalizers would
        tear down)."""
        if self._trace is not None and self._trace.samples["send"]:
            logger.warning("%s", self._trace.report())
            self._trace.samples["send"].clear()
        _signal_stop(self._watch_stop)  # the workers exit now: not a failure
        if self._watchdog is not None:
            self._watchdog.join(_JOIN_S)
        stop = CODEC.encode(Stop() if leave_group else ExitNow())
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send_bytes(stop)
        group, self.group = self.group, None
        if not leave_group:
            if group is not None:
                teardown.mark_skipped()
            self._finalizer()  # reaps the workers (they exit at once)
            return
        paired = all(p.exitcode is None for p in self.procs)  # else no peer to pair with
        if group is not None and paired:
            teardown.leave_group(group, _JOIN_S)
        self._finalizer()
        if group is not None and not paired:
            teardown.leave_group(group, _JOIN_S)


def _last_word(conn) -> str:
    """What the dead worker behind ``conn`` said failed (``Type: message``), else ''."""
    with contextlib.suppress(EOFError, OSError, ValueError):
        while conn.poll(0):
            msg = recv(conn)
            if isinstance(msg, WorkerFailed):
                return msg.error
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
    teardown.exit_now(1)


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
            conn.send_bytes(CODEC.encode(Stop()))
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
