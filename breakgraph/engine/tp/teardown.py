"""How a rank leaves its TP group and how a process that cannot trust its collectives exits.

On CUDA (NCCL, graphs capturing the all-reduce) every rank tears the group down at once at
shutdown: NCCL's teardown waits for its peers, and a peer that never joins leaves the thread
in it stuck; such a process ends through ``exit_if_stuck``.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

from breakgraph.distributed import TPGroup, destroy_tp_group

logger = logging.getLogger(__name__)

# Set when a TP group's teardown did not return: the thread left in it makes the process die
# in C++ at interpreter exit ("terminate called without an active exception", SIGABRT) after
# its work is done; the engine process and the CLI end with os._exit instead (exit_if_stuck).
TEARDOWN_STUCK = False
# Set when rank 0 left its group up on purpose (``TPDriver.shutdown(leave_group=False)``):
# the process ends through exit_if_stuck likewise.
TEARDOWN_SKIPPED = False


def exit_now(code: int) -> None:
    """Exit at once, without finalizers, the logs and output flushed first."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def destroy_quietly(group: TPGroup) -> None:
    try:
        destroy_tp_group(group)
    except Exception as e:  # noqa: BLE001 - an aborted group may refuse its teardown
        logger.warning("TP group teardown failed: %s", e)


def leave_group(group: TPGroup, timeout_s: float) -> None:
    """Destroy the group, giving up (with a warning) if a peer never joins the teardown."""
    global TEARDOWN_STUCK
    t = threading.Thread(target=destroy_quietly, args=(group,), daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        TEARDOWN_STUCK = True
        logger.warning("TP group teardown did not finish in %.0f s: a worker is stuck", timeout_s)


def mark_skipped() -> None:
    """Rank 0 leaves its group to the OS (see TEARDOWN_SKIPPED)."""
    global TEARDOWN_SKIPPED
    TEARDOWN_SKIPPED = True


def exit_if_stuck(code: int) -> None:
    """End the process now with ``code`` if a TP group's teardown is stuck (see
    TEARDOWN_STUCK) or was skipped (TEARDOWN_SKIPPED): its finalizers would abort the process
    or wait on the group instead."""
    if TEARDOWN_STUCK:
        logger.warning("exiting without finalizers: a TP group's teardown is still running")
        exit_now(code)
    if TEARDOWN_SKIPPED:
        logger.info("exiting without finalizers: the TP group is left to the OS")
        exit_now(code)
