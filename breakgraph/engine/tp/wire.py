"""What rank 0 and the TP workers send each other over their pipes: one msgpack protocol
(common/codec.py, the codec the API and engine processes speak), each step's metadata as
packed int32 arrays; and the step's tensors over the TP group."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from breakgraph.common.codec import PACKED_INT32, Codec
from breakgraph.distributed import TPGroup
from breakgraph.engine.graphs.key import StepKey


@dataclass
class StepMessage:
    """One step as rank 0 sends it: everything but the input ids (broadcast as a tensor)."""

    mode: str  # ForwardMode value
    out_cache_loc: np.ndarray = field(metadata=PACKED_INT32)  # [T] (none with device_base)
    req_pool_indices: np.ndarray = field(metadata=PACKED_INT32)  # [B]
    prefix_lens: np.ndarray = field(metadata=PACKED_INT32)  # [B]
    extend_lens: np.ndarray = field(metadata=PACKED_INT32)  # [B]
    key: StepKey  # the graph rank 0's dispatcher chose: every rank replays the same
    # the request-table writes made since the last step: rows, columns, slots [W] (None: none)
    write_rows: np.ndarray | None = field(default=None, metadata=PACKED_INT32)
    write_cols: np.ndarray | None = field(default=None, metadata=PACKED_INT32)
    write_slots: np.ndarray | None = field(default=None, metadata=PACKED_INT32)
    prompt_rows: int = -1  # forward_prompt: rows (and targets) broadcast after the ids; -1: none
    top_k: int = 0
    all_rows: bool = False  # logits of every row (a speculative verify step), not each last
    # the rows' positions are a broadcast base per request plus their offsets (a verify step
    # chained to the one in flight: engine/spec_chain.py); the lengths above are bounds
    device_base: bool = False
    sent_at: float = 0.0  # rank 0's time.perf_counter() at sending (CLOCK_MONOTONIC: host-wide)

    @property
    def table_writes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        if self.write_rows is None:
            return None
        return self.write_rows, self.write_cols, self.write_slots


@dataclass
class TableWrites:
    """Request-table writes rank 0 made since its last message (rows, columns, slots)."""

    rows: np.ndarray = field(metadata=PACKED_INT32)
    cols: np.ndarray = field(metadata=PACKED_INT32)
    slots: np.ndarray = field(metadata=PACKED_INT32)


# device work every rank does beside the steps (engine/rank_ops.py): rank 0 sends each op
# before it does it, so every rank's collectives and buffers see the same order
@dataclass
class SaveStates:
    """Keep the model's per-request state of these request-table rows (a verify step's)."""

    rows: np.ndarray = field(metadata=PACKED_INT32)
    writes: TableWrites | None = None


@dataclass
class RestoreStates:
    """Put the kept state back: row ``rows[i]`` takes the kept row ``pick[i]``."""

    pick: np.ndarray = field(metadata=PACKED_INT32)
    rows: np.ndarray = field(metadata=PACKED_INT32)
    writes: TableWrites | None = None


@dataclass
class MtpRows:
    """NEXTN: an extend step of the MTP layer that writes its KV (engine/mtp.py ``_rows``).
    Its batch: ``slots`` [N], and per live request its table row, prefix and rows; the next
    tokens ``ids`` [N] (None: the last target step's input ids at ``idx``); its streams: row
    ``dst`` takes the last target forward's row ``src``, row ``backlog_dst`` the backlog's row
    ``backlog_src``; then the backlog's rows ``keep`` take the forward's rows ``keep_src``."""

    slots: np.ndarray = field(metadata=PACKED_INT32)
    table_rows: np.ndarray = field(metadata=PACKED_INT32)
    prefixes: np.ndarray = field(metadata=PACKED_INT32)
    extends: np.ndarray = field(metadata=PACKED_INT32)
    ids: np.ndarray | None = field(metadata=PACKED_INT32)
    idx: np.ndarray | None = field(metadata=PACKED_INT32)
    dst: np.ndarray = field(metadata=PACKED_INT32)
    src: np.ndarray = field(metadata=PACKED_INT32)
    backlog_dst: np.ndarray = field(metadata=PACKED_INT32)
    backlog_src: np.ndarray = field(metadata=PACKED_INT32)
    keep: np.ndarray = field(metadata=PACKED_INT32)
    keep_src: np.ndarray = field(metadata=PACKED_INT32)
    writes: TableWrites | None = None


@dataclass
class MtpPropose:
    """NEXTN: a verify step's drafts (engine/mtp.py ``propose``): request i drafts ``lens[i]``
    tokens from its backlog row (table row ``table_rows[i]``, position ``prefixes[i] - 1``)
    and its last token ``first_ids[i]``; ``slots``: its draft steps' slots, request after
    request. Every rank computes the same drafts (the LM head's logits are all-gathered)."""

    table_rows: np.ndarray = field(metadata=PACKED_INT32)
    prefixes: np.ndarray = field(metadata=PACKED_INT32)
    lens: np.ndarray = field(metadata=PACKED_INT32)
    first_ids: np.ndarray = field(metadata=PACKED_INT32)
    slots: np.ndarray = field(metadata=PACKED_INT32)
    writes: TableWrites | None = None


RANK_OPS = (SaveStates, RestoreStates, MtpRows, MtpPropose)


@dataclass
class Stop:
    """Rank 0 stops the workers: each tears the group down and exits."""


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


CODEC = Codec(
    [StepMessage, *RANK_OPS, Stop, ExitNow, WorkerSetup, WorkerUp, WorkerSlots, WorkerFailed]
)


def send(conn, msg) -> None:
    conn.send_bytes(CODEC.encode(msg))


def recv(conn):
    return CODEC.decode(conn.recv_bytes())


def broadcast_inputs(group: TPGroup, input_ids, rows=None, targets=None, base=None) -> None:
    """Rank 0's step tensors into the workers' buffers of the same shapes (int64)."""
    for t in (input_ids, rows, targets, base):
        if t is not None:
            if group.rank == 0 and (t.dtype != torch.int64 or not t.is_contiguous()):
                t = t.to(torch.int64).contiguous()  # a copy to send; rank 0 keeps its own
            group.broadcast(t, src=0)
