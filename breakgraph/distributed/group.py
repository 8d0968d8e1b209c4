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
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from breakgraph.common import envs

logger = logging.getLogger(__name__)

# The largest all-reduce the one-shot path takes (on unless --disable-custom-all-reduce).
# Measured on two H200s (`breakgraph bench allreduce`, both paths replayed from CUDA
# graphs): one-shot takes 0.63x NCCL's time at 8-64 KB, 0.68x at 512 KB, 0.72x at 1 MB, 0.83x
# at 4 MB; larger messages (long prefills) go to NCCL, whose ring bandwidth wins as the size
# grows and ranks add (not measured past 4 MB).
ONE_SHOT_MAX_BYTES = 4 << 20
# The one-shot kernel that stages its input into the symmetric buffer itself (torch >= 2.8's
# ``one_shot_all_reduce_copy_out``) instead of a copy in front of it, for messages up to
# FUSED_COPY_MAX_BYTES: one launch per all-reduce instead of two (a TP2 decode step of
# Llama-3.1-8B makes 64). On two H200s (`breakgraph bench allreduce`, 2026-12-01),
# µs per op fused / copy in front: 6.57 / 7.56 at 8 KB, 6.98 / 7.94 at 64 KB, 11.19 / 10.96 at
# 512 KB, 35.3 / 32.9 at 4 MB (the copy engine stages a large message faster than the kernel).
FUSED_COPY_MAX_BYTES = 256 << 10


def reduce_in_norms() -> bool:
    """BREAKGRAPH_AR_NORM=1: the Llama family's o and down projections hand their partial
    sums to the norm after them, which all-reduces them (``TPGroup.all_reduce_add_rms_norm``;
    on CUDA one kernel, set up with the one-shot path). Off by default: that kernel has not
    yet run on two GPUs."""
    return envs.AR_NORM.get()


class OneShotAllReduce:
    """All-reduce over symmetric memory (PyTorch's ``torch.distributed._symmetric_memory``):
    one kernel in which every rank reads every peer's buffer over NVLink and sums in rank
    order (the same result on every rank), between two barriers on signal pads (the second:
    no rank refills its buffer while a peer still reads it). For decode's small messages,
    where NCCL's latency, not bandwidth, paces a step: SGLang and vLLM ship such a "custom
    all-reduce" for the same reason. Captured in CUDA graphs like any kernel (the barriers
    reset their own flags). Float32 and bfloat16, contiguous, up to ``max_bytes``; NVLink
    multicast is not used."""

    def __init__(
        self,
        device: torch.device,
        max_bytes: int = ONE_SHOT_MAX_BYTES,
        fused_copy: bool = True,
    ):
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = dist.group.WORLD.group_name
        self.max_bytes = max_bytes
        # the op stages the input itself where this torch has it (every rank alike: one torch)
        self.fused_copy = fused_copy and hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out")
        # torch before 2.13 wants the group registered (cached by name: a name reused by a
        # later engine's group must not find the store of an earlier one); 2.13 needs nothing
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:
            getattr(symm_mem, "_group_name_to_store", {}).pop(self.group_name, None)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                enable(self.group_name)
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, dist.group.WORLD)  # collective: every rank, once
        self.device = device
        self.norm: _AddRmsNormBuffers | None = None  # enable_add_rms_norm() sets it up

    def enable_add_rms_norm(self) -> None:
        """Set up the fused all-reduce + residual add + RMSNorm (a collective: every rank)."""
        import torch.distributed._symmetric_memory as symm_mem

        self.norm = _AddRmsNormBuffers(symm_mem, self.device)

    def fits(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return (
            x.dtype in (torch.bfloat16, torch.float32)
            and x.is_contiguous()
            and 0 < nbytes <= self.max_bytes
            and nbytes % 16 == 0  # the kernel's widest vector: every rank takes the same path
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks (``fits(x)``): a new tensor with the fused copy,
        else ``x`` summed in place."""
        flat = x.view(-1)
        nbytes = flat.numel() * flat.element_size()
        staged = self.buffer[:nbytes].view(flat.dtype)
        if self.fused_copy and nbytes <= FUSED_COPY_MAX_BYTES:
            # the output apart from the input: the kernel copies, then sums
            out = torch.empty_like(flat)
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(
                staged, flat, "sum", self.group_name, out
            )
            return out.view_as(x)
        staged.copy_(flat)
        torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, flat)
        return x


class _AddRmsNormBuffers:
    """What ``kernels/allreduce_norm.py`` reads: a symmetric buffer per rank holding the
    flags (int32 [NORM_MAX_ROWS, world], zeroed) and two slots of ``NORM_SLOT_BYTES`` for
    the rows, every rank's pointers to them, and this rank's epoch per row. The first call
    must follow a collective after this (the flags are zeroed on every rank)."""

    def __init__(self, symm_mem, device: torch.device):
        world = dist.get_world_size()
        self.rank, self.world = dist.get_rank(), world
        flag_bytes = -(-NORM_MAX_ROWS * world * 4 // 256) * 256
        buf = symm_mem.empty(flag_bytes + 2 * NORM_SLOT_BYTES, dtype=torch.uint8, device=device)
        buf[:flag_bytes].zero_()
        handle = symm_mem.rendezvous(buf, dist.group.WORLD)  # collective: every rank, once
        self.buffer = buf
        bases = [int(p) for p in handle.buffer_ptrs]
        self.flags = torch.tensor(bases, dtype=torch.int64, device=device)
        self.rows = torch.tensor([b + flag_bytes for b in bases], dtype=torch.int64, device=device)
        self.epochs = torch.zeros(NORM_MAX_ROWS, dtype=torch.int32, device=device)

    def fits(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        return (
            x.dim() == 2
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and residual.dtype == x.dtype
            and residual.shape == x.shape
            and x.is_contiguous()
            and residual.is_contiguous()
            and 0 < x.shape[0] <= NORM_MAX_ROWS
            and x.numel() * x.element_size() <= NORM_SLOT_BYTES
        )

    def __call__(self, x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
        from breakgraph.kernels.allreduce_norm import all_reduce_add_rms_norm_triton

        slot = NORM_SLOT_BYTES // x.element_size()
        return all_reduce_add_rms_norm_triton(
            x, residual, weight, eps, self.rows, self.flags, self.epochs, slot,
            self.rank, self.world,
        )  # fmt: skip


# The fused all-reduce + residual add + RMSNorm (kernels/allreduce_norm.py): rows per call
# (one program each, every one of them resident with its peers': decode's batches) and the
# bytes of one call's rows
NORM_MAX_ROWS = 128
NORM_SLOT_BYTES = 1 << 20


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    device: torch.device = torch.device("cpu")
    # the one-shot path for small all-reduces (CUDA), else None: the collective
    one_shot: OneShotAllReduce | None = field(default=None, compare=False, repr=False)

    @property
    def is_parallel(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks: ``x`` summed in place, or a new tensor (the one-shot path); use
        the returned tensor."""
        if self.size > 1:
            if self.one_shot is not None and self.one_shot.fits(x):
                return self.one_shot(x)
            dist.all_reduce(x)
        return x

    def all_reduce_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``fused_add_rms_norm(all_reduce(x), residual, weight, eps)``: one kernel where the
        one-shot path holds the rows (kernels/allreduce_norm.py), else those two steps."""
        norm = getattr(self.one_shot, "norm", None)
        if self.size > 1 and norm is not None and norm.fits(x, residual):
            return norm(x, residual, weight, eps)
        from breakgraph.kernels import ops

        return ops.fused_add_rms_norm(self.all_reduce(x), residual, weight, eps)

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
    timeout_s: float | None = None,
    custom_all_reduce: bool = False,
) -> TPGroup:
    """Join the group of ``size`` ranks at ``init_method`` (tcp://host:port or file://path);
    ``custom_all_reduce``: small all-reduces take ``OneShotAllReduce`` (CUDA; every rank must
    ask alike).

    A collective that waits longer than ``timeout_s`` (default ``BREAKGRAPH_TP_TIMEOUT_S``,
    300) raises instead of hanging (gloo honours it; NCCL through its watchdog, set below to
    abort the communicator). Generous: a rank's first step may JIT-compile kernels while the
    others wait. A dead peer is noticed at once (gloo: the closed connection; NCCL: rank 0's
    watchdog on the workers' processes)."""
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
        timeout=datetime.timedelta(
            seconds=envs.TP_TIMEOUT_S.get() if timeout_s is None else timeout_s
        ),
        **kw,
    )
    logger.info("TP rank %d/%d joined (%s on %s)", rank, size, backend, device)
    global _GROUPS_JOINED
    _GROUPS_JOINED += 1
    use = custom_all_reduce and device.type == "cuda"  # gloo on the CPU: the collective
    one_shot = _one_shot_all_reduce(rank, size, device, _GROUPS_JOINED == 1) if use else None
    return TPGroup(rank, size, device, one_shot)


# TP groups this process has joined. Only its first takes the one-shot path: PyTorch's
# symmetric memory keeps per-group-name state that a later group (same name: the default
# group's) inherits, and on two H200s a second engine's one-shot group in one process hung
# (tests, benches of several models; a server's process has one engine).
_GROUPS_JOINED = 0


def _one_shot_all_reduce(
    rank: int, size: int, device: torch.device, first_group: bool = True
) -> OneShotAllReduce | None:
    """Every rank's one-shot all-reduce, checked on a known sum, or None on every rank (one
    line why). The ranks agree (over the group's collective) before setting it up (its
    rendezvous is a collective), after, and again after the check, since a rank that takes
    the path waits at a barrier that a rank on the collective never reaches."""
    one_shot, why = None, "needs CUDA"
    if device.type == "cuda" and not _agree(first_group, device):
        why = "not this process's first TP group" if not first_group else "another rank's is not"
    elif device.type == "cuda":
        try:
            one_shot = OneShotAllReduce(device)
        except Exception as e:  # noqa: BLE001 - symmetric memory unavailable here
            why = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    if _agree(one_shot is not None, device):
        x = torch.full((4096,), float(rank + 1), dtype=torch.float32, device=device)
        if not torch.equal(one_shot(x), torch.full_like(x, size * (size + 1) / 2)):
            one_shot, why = None, "its self-check summed wrong"
        if _agree(one_shot is not None, device):
            logger.info(
                "TP rank %d: one-shot all-reduce for messages up to %d bytes",
                rank, one_shot.max_bytes,
            )  # fmt: skip
            if reduce_in_norms():
                _enable_add_rms_norm(one_shot, rank, device)
            return one_shot
        if one_shot is not None:
            why = "another rank's self-check summed wrong"
    elif one_shot is not None:
        why = "another rank could not set it up"
    logger.warning("TP rank %d: custom all-reduce off, all-reduces go to NCCL (%s)", rank, why)
    return None


def _enable_add_rms_norm(one_shot: OneShotAllReduce, rank: int, device: torch.device) -> None:
    """The fused all-reduce + norm on every rank, or on none (one line why): a rank taking it
    waits on a flag that a rank on the unfused path never sets."""
    why = ""
    try:
        one_shot.enable_add_rms_norm()
    except Exception as e:  # noqa: BLE001 - an older torch, no symmetric memory left
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    if not _agree(one_shot.norm is not None, device):
        one_shot.norm = None
        logger.warning(
            "TP rank %d: fused all-reduce + norm off (%s)", rank, why or "another rank's is"
        )


def _agree(ok: bool, device: torch.device) -> bool:
    """True if ``ok`` on every rank (a collective on CUDA; the CPU ranks are all alike)."""
    flag = torch.tensor([ok], dtype=torch.int32, device=device)
    if device.type == "cuda":
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


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
