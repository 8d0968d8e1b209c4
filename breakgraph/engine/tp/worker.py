"""A TP worker rank: build the rank (engine/rank.py, as rank 0 does), then run rank 0's steps
through the keys rank 0 sends, until it says stop, closes its pipe or dies."""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import time

import numpy as np
import torch

from breakgraph.common import envs
from breakgraph.distributed import TPGroup, destroy_tp_group, init_tp_group
from breakgraph.engine import rank_ops
from breakgraph.engine.memory import MemoryPlanError
from breakgraph.engine.rank import Rank, build_rank, claim_device, rank_device
from breakgraph.engine.rank_ops import StateRewind
from breakgraph.engine.spec_chain import device_batch
from breakgraph.engine.tp import teardown, wire
from breakgraph.engine.tp.trace import StepTrace
from breakgraph.forward_batch import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)

_POLL_S = 1.0  # how often an idle worker checks that rank 0 is alive


class _ParentGone(Exception):
    pass


class _StopNow(Exception):
    """Rank 0 failed to start and stops the workers before they built their rank."""


def _recv(conn, parent_pid: int, spin_s: float = 0.0):
    """The next message from rank 0, polling without a sleep for ``spin_s`` first. After a
    step the next one usually comes within a step's time, and a blocked process's wake-up
    (tens of µs to more on an idle core) is on every step's critical path (rank 0's first
    all-reduce waits for the worker's launch): spinning costs one busy core per worker."""
    if spin_s > 0:
        deadline = time.perf_counter() + spin_s
        while time.perf_counter() < deadline:
            if conn.poll(0):
                return wire.recv(conn)
    while not conn.poll(_POLL_S):
        if os.getppid() != parent_pid:
            raise _ParentGone
    return wire.recv(conn)


def worker_main(args, rank: int, size: int, init_method: str, conn, parent_pid: int) -> None:
    """A worker rank's process: build this rank's shard, KV pool and runner, then serve."""
    logging.basicConfig(level=logging.WARNING, format=f"[tp{rank}] %(levelname)s %(message)s")
    # Ctrl-C reaches the whole process group: rank 0 stops the workers (or they see it gone)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # a stuck rank: `kill -USR1 <pid>` prints every thread's stack to its stderr
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    group = None
    try:
        device = rank_device(torch.device(args.resolved_device()), rank)
        claim_device(device)
        torch.manual_seed(args.seed)
        wire.send(conn, wire.WorkerUp())
        group = init_tp_group(
            rank, size, init_method, device, custom_all_reduce=not args.disable_custom_all_reduce
        )

        def agree(num_slots: int) -> int:
            wire.send(conn, wire.WorkerSlots(num_slots))
            setup = _recv(conn, parent_pid)
            if isinstance(setup, wire.Stop):
                raise _StopNow
            return setup.num_slots

        _serve(build_rank(args, device, group, agree), group, conn, parent_pid)
    except (EOFError, _ParentGone, ConnectionError):
        logger.warning("TP worker rank %d: rank 0 is gone, exiting", rank)
    except _StopNow:
        pass
    except Exception as e:
        if isinstance(e, (MemoryPlanError, torch.OutOfMemoryError)):  # one line, as rank 0's
            first = (str(e).splitlines() or [""])[0]
            logger.error("TP worker rank %d failed: %s: %s", rank, type(e).__name__, first)
        else:
            logger.exception("TP worker rank %d failed", rank)
        with contextlib.suppress(Exception):
            wire.send(conn, wire.WorkerFailed(f"{type(e).__name__}: {e}"))
        os._exit(1)  # no teardown that could block on the group
    finally:
        if group is not None:
            with contextlib.suppress(Exception):
                destroy_tp_group(group)


def _serve(rank: Rank, group: TPGroup, conn, parent_pid: int) -> None:
    trace = StepTrace(group.rank, ("pipe", "build", "launch")) if envs.TP_TRACE.get() else None
    # the CPU's ranks share its cores: no spinning there
    spin_s = envs.TP_SPIN_MS.get() / 1e3 if rank.device.type == "cuda" else 0.0
    rewind = StateRewind(rank.kv_pool, rank.req_pool)
    step_ids = None  # the last step's input ids (NEXTN's MTP rows read them)
    while not isinstance(msg := _recv(conn, parent_pid, spin_s), wire.Stop):
        if isinstance(msg, wire.ExitNow):
            if trace is not None:
                logger.warning("%s", trace.report())
            teardown.exit_now(0)  # no teardown: rank 0 skips its own too (ExitNow)
        if isinstance(msg, wire.RANK_OPS):
            with torch.inference_mode():
                rank_ops.apply(msg, rank, rewind, step_ids)
            continue
        step_ids = run_step(msg, rank, group, trace)
    if trace is not None:
        logger.warning("%s", trace.report())


def run_step(
    msg: wire.StepMessage, rank: Rank, group: TPGroup, trace: StepTrace | None = None
) -> torch.Tensor:
    """Run rank 0's step here, through rank 0's key -> its input ids (rank 0's)."""
    received = time.perf_counter()
    req_pool, device = rank.req_pool, rank.device
    if msg.table_writes is not None:
        req_pool.apply_writes(*msg.table_writes)
    if msg.device_base:
        return _run_device_step(msg, rank, group)
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
    if msg.all_rows:  # the LM head's gather is collective: rank 0's rows exactly
        batch.logits_rows = torch.arange(n, dtype=torch.int64, device=device)
    if decode:  # rank 0's scheduler wrote its own copy likewise
        req_pool.write_batch(batch)
    with torch.inference_mode():
        if msg.prompt_rows < 0:
            built = time.perf_counter()
            wire.broadcast_inputs(group, batch.input_ids)
            rank.runner.execute(msg.key, batch)
            if trace is not None:
                trace.add(msg.sent_at, received, built, time.perf_counter())
            return batch.input_ids
        rows = torch.empty(msg.prompt_rows, dtype=torch.int64, device=device)
        targets = torch.empty(msg.prompt_rows, dtype=torch.int64, device=device)
        wire.broadcast_inputs(group, batch.input_ids, rows, targets)
        rank.runner.execute_prompt(batch, rows, targets, msg.top_k)
    return batch.input_ids


def _run_device_step(msg: wire.StepMessage, rank: Rank, group: TPGroup) -> torch.Tensor:
    """A step whose positions rank 0 broadcasts as a base per request (a verify step chained
    to the one in flight: engine/spec_chain.py), rebuilt from it on this rank's table."""
    device, n = rank.device, int(msg.extend_lens.sum())
    input_ids = torch.empty(n, dtype=torch.int64, device=device)
    base = torch.empty(len(msg.req_pool_indices), dtype=torch.int64, device=device)
    with torch.inference_mode():
        wire.broadcast_inputs(group, input_ids, base=base)
        batch = device_batch(
            ForwardMode(msg.mode), rank.req_pool.table, msg.req_pool_indices.tolist(), base,
            msg.extend_lens.tolist(), msg.prefix_lens.tolist(), input_ids, msg.all_rows,
        )  # fmt: skip
        rank.runner.execute(msg.key, batch)
    return input_ids
