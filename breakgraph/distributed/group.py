"""The TP group: one torch.distributed process group over the ranks of one engine.

NCCL on CUDA (a rank's device is ``cuda:{rank}``), gloo on the CPU. Layers take the group
that is current while they are built (``tp_group_scope``), so engines of different TP sizes
can live in one process (one of them TP > 1 at a time: torch.distributed has one default
group per process).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# a collective that waits longer than this raises instead of hanging (gloo honours it; NCCL
# through its watchdog, set to abort the communicator: see init_tp_group). Generous: a rank's
# first step may JIT-compile kernels while the others wait. A dead peer is noticed at once
# (gloo: the closed connection; NCCL: rank 0's watchdog on the workers' processes).
DEFAULT_TIMEOUT_S = float(os.environ.get("BREAKGRAPH_TP_TIMEOUT_S", 300))


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_parallel(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dim, in rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        # one collective into one buffer [size, *x.shape], then one copy to rank-major columns
        flat = x.reshape(-1)
        out = torch.empty(self.size * flat.numel(), dtype=x.dtype, device=x.device)
        _all_gather_single(out, flat)
        out = out.view(self.size, *x.shape).movedim(0, -2)
        return out.reshape(*x.shape[:-1], self.size * x.shape[-1])

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``x`` of rank ``src`` into ``x`` of every rank, in place (x contiguous)."""
        if self.size > 1:
            dist.broadcast(x, src)
        return x


# torch 2.13 renames all_gather_into_tensor (deprecated there) to all_gather_single
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_SINGLE = TPGroup()
_CURRENT: TPGroup = _SINGLE


def get_tp_group() -> TPGroup:
    """The group layers built now shard over (size 1 outside ``tp_group_scope``)."""
    return _CURRENT


@contextlib.contextmanager
def tp_group_scope(group: TPGroup | None):
    global _CURRENT
    prev, _CURRENT = _CURRENT, group or _SINGLE
    try:
        yield _CURRENT
    finally:
        _CURRENT = prev


def init_tp_group(
    rank: int,
    size: int,
    init_method: str,
    device: torch.device | str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> TPGroup:
    """Join the group of ``size`` ranks at ``init_method`` (tcp://host:port or file://path)."""
    device = torch.device(device)
    if size == 1:
        return TPGroup(0, 1, device)
    if dist.is_initialized():
        raise RuntimeError(
            "a TP process group already exists in this process: shut its engine down first"
        )
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl":
        # on a collective's error or timeout NCCL's watchdog aborts the communicator, so the
        # wait raises in Python (the server answers 503 and exits): torch's default (3) would
        # kill the process instead. A value set by the user stays.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    if backend == "gloo" and sys.platform == "linux":
        # every rank is on this host: gloo's default (the hostname's address) may not resolve
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    kw = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **kw,
    )
    logger.info("TP rank %d/%d joined (%s on %s)", rank, size, backend, device)
    return TPGroup(rank, size, device)


def destroy_tp_group(group: TPGroup) -> None:
    """Leave the group. NCCL's communicators are aborted, not finalized: finalizing waits for
    every peer's teardown and in-flight work (on two H200s it outwaited the 10 s shutdown
    allowance with every rank at its stop, and the process then died in C++ at exit); an abort
    is local and frees the same. gloo's teardown is local already."""
    if group.size > 1 and dist.is_initialized() and not abort_tp_group(group):
        dist.destroy_process_group()


def abort_tp_group(group: TPGroup) -> bool:
    """Abort the group's communicators, from any thread: NCCL collectives waiting for a peer
    that will never come (kernels queued on the device included) fail now instead of at the
    timeout. Only NCCL needs it: gloo fails a collective at once when a peer's connection
    closes. True if aborted."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if group.size == 1 or group.device.type != "cuda" or abort is None or not dist.is_initialized():
        return False
    try:
        abort()
    except Exception as e:  # noqa: BLE001 - best effort: the timeout still ends the wait
        logger.warning("aborting the TP group failed: %s", e)
        return False
    return True
