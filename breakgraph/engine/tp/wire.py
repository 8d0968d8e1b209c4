"""What rank 0 and the TP workers send each other: the per-step message in a fixed binary
layout, the startup and shutdown messages, and the step's tensors over the TP group."""

from __future__ import annotations

import pickle
import struct
from dataclasses import dataclass

import numpy as np
import torch

from breakgraph.distributed import TPGroup
from breakgraph.engine.graphs.key import BANKS, StepKey
from breakgraph.forward_batch import ForwardMode


@dataclass
class StepMessage:
    """One step as rank 0 sends it: everything but the input ids (broadcast as a tensor)."""

    mode: str  # ForwardMode value
    out_cache_loc: np.ndarray  # int32 [T]
    req_pool_indices: np.ndarray  # int32 [B]
    prefix_lens: np.ndarray  # int32 [B]
    extend_lens: np.ndarray  # int32 [B]
    table_writes: tuple[np.ndarray, np.ndarray, np.ndarray] | None  # (rows, cols, slots)
    key: StepKey  # the graph rank 0's dispatcher chose: every rank replays the same
    prompt_rows: int = -1  # forward_prompt: rows (and targets) broadcast after the ids; -1: none
    top_k: int = 0
    sent_at: float = 0.0  # rank 0's time.perf_counter() at sending (CLOCK_MONOTONIC: host-wide)


_MODES = tuple(m.value for m in ForwardMode)  # by index on the wire
# a step on the wire: b"S", mode, bank, tokens, requests, table writes (-1: none), prompt
# rows, top_k, bucket, last piece's bucket, tail bucket, sent_at; then int32 slots [T],
# rows, prefix and extend lengths [B] each, and the table writes' rows, columns, slots [W]
_STEP = struct.Struct("<cBBiiiiiiiid")


def _step_bytes(msg: StepMessage) -> bytes:
    """``msg`` in a fixed binary layout: no pickling on the step's path (pickle and unpickle
    of a decode step: ~50 µs on a 2-core CPU; this: a few)."""
    writes, key = msg.table_writes, msg.key
    arrays = [msg.out_cache_loc, msg.req_pool_indices, msg.prefix_lens, msg.extend_lens]
    if writes is not None:
        arrays += list(writes)
    head = _STEP.pack(
        b"S", _MODES.index(msg.mode), BANKS.index(key.bank), len(msg.out_cache_loc),
        len(msg.req_pool_indices), -1 if writes is None else len(writes[0]), msg.prompt_rows,
        msg.top_k, key.size, key.rest, key.tail, msg.sent_at,
    )  # fmt: skip
    return b"".join([head, *(np.asarray(a, dtype=np.int32).tobytes() for a in arrays)])


def _step_from_bytes(data: bytes) -> StepMessage:
    _, mode, bank, t, b, w, prompt_rows, top_k, size, rest, tail, sent_at = _STEP.unpack_from(data)
    flat = np.frombuffer(data, dtype=np.int32, offset=_STEP.size)
    at = t + 3 * b
    writes = None if w < 0 else (flat[at : at + w], flat[at + w : at + 2 * w], flat[at + 2 * w :])
    key = StepKey(BANKS[bank], size, rest=rest, tail=tail)
    return StepMessage(
        _MODES[mode], flat[:t], flat[t : t + b], flat[t + b : t + 2 * b],
        flat[t + 2 * b : at], writes, key, prompt_rows, top_k, sent_at,
    )  # fmt: skip


def to_wire(obj) -> bytes:
    """What rank 0 sends a worker: a step in its binary layout, anything else pickled (the
    few startup and shutdown messages below, between processes of one host)."""
    if isinstance(obj, StepMessage):
        return _step_bytes(obj)
    return b"P" + pickle.dumps(obj)


def from_wire(data: bytes):
    return _step_from_bytes(data) if data[:1] == b"S" else pickle.loads(data[1:])


@dataclass
class ExitNow:
    """Rank 0's process exits next: exit at once, without tearing the group down (NCCL's
    teardown waits for every peer's, and on two H200s it did not return in 10 s)."""


@dataclass
class WorkerSetup:
    """What rank 0 decides once and every worker must agree on."""

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


def broadcast_inputs(group: TPGroup, input_ids, rows=None, targets=None) -> None:
    """Rank 0's step tensors into the workers' buffers of the same shapes (int64)."""
    for t in (input_ids, rows, targets):
        if t is not None:
            if group.rank == 0 and (t.dtype != torch.int64 or not t.is_contiguous()):
                t = t.to(torch.int64).contiguous()  # a copy to send; rank 0 keeps its own
            group.broadcast(t, src=0)
