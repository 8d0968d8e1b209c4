"""Device work every TP rank does beside the steps: speculative decoding's per-request state
rewind and NEXTN's MTP layers (engine/mtp.py). The steps themselves reach the workers as
``StepMessage``s (model_runner.py); these ops are the rank-local device work between them
that changes what a later step reads (the model's per-request state, the MTP's KV and
backlog). Rank 0 decides each op from its requests, sends it (engine/tp/wire.py: host
arrays only, with the request-table writes made since its last message), then does it; a
worker does the same on its own buffers when the message arrives (``apply``), in the order
rank 0 sent them, so the collectives inside an op (the MTP layer's all-reduces, the LM
head's all-gather) meet.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from breakgraph.engine.prefill import extend_batch
from breakgraph.engine.tp import wire
from breakgraph.forward_batch import upload_many

Send = Callable[[object], None]  # rank 0's TPDriver.send_op; None without workers


class StateRewind:
    """A model's per-request state (DeepSeek V4's open compressor windows) across a verify
    step, which advances it through every row: kept before the step (``save``); for the
    requests that rejected a draft token, put back and advanced over the rows they kept by a
    forward of those rows (``rewind``). Every rank keeps and restores its own copy."""

    def __init__(self, kv_pool, req_pool, send: Send | None = None):
        self.states: dict[str, torch.Tensor] = kv_pool.request_states
        self.req_pool = req_pool
        self.send = send
        self.device = kv_pool.device
        self.saved: dict[str, torch.Tensor] | None = None

    def __bool__(self) -> bool:
        return bool(self.states)

    def save(self, rows: list[int]) -> None:
        """Keep request-table ``rows``' state (a verify step's requests, before its forward)."""
        if self.send is not None:
            self.send(wire.SaveStates(np.asarray(rows, dtype=np.int32)))
        self.keep(rows)

    def restore(self, pick: list[int], rows: list[int]) -> None:
        """Row ``rows[i]`` takes the kept row ``pick[i]``."""
        if self.send is not None:
            self.send(wire.RestoreStates(*(np.asarray(a, dtype=np.int32) for a in (pick, rows))))
        self.put_back(pick, rows)

    def keep(self, rows) -> None:
        """This rank's part of ``save``."""
        (at,) = upload_many([rows], torch.int64, self.device)
        self.saved = {name: t[at] for name, t in self.states.items()}

    def put_back(self, pick, rows) -> None:
        """This rank's part of ``restore``."""
        pick_at, rows_at = upload_many([pick, rows], torch.int64, self.device)
        for name, state in self.states.items():
            state[rows_at] = self.saved[name][pick_at]

    def rewind(self, verify, rewind: list, forward) -> None:
        """Requests of ``verify`` that rejected a draft token, with the draft tokens each kept:
        their state back to before the step, then advanced over the rows they kept (their last
        token and accepted draft) by ``forward`` of those rows. It writes their KV again, the
        same values at the same slots; its logits are not used."""
        index = {id(r): i for i, r in enumerate(verify.reqs)}
        self.restore([index[id(req)] for req, _ in rewind], [req.req_pool_idx for req, _ in rewind])
        ids, slots, prefixes, ext = [], [], [], []
        for req, accepted in rewind:
            start = verify.prefixes[index[id(req)]]
            ids += [req.fill_prefix(start + 1, start).tolist()[0], *accepted]
            slots.append(req.kv_slots[start : start + 1 + len(accepted)])
            prefixes.append(start)
            ext.append(1 + len(accepted))
        batch = extend_batch(
            np.asarray(ids, dtype=np.int32), torch.cat(slots), [r.req_pool_idx for r, _ in rewind],
            prefixes, ext, self.req_pool, self.device,
        )  # fmt: skip
        forward(batch)


def apply(msg, rank, rewind: StateRewind, step_ids: torch.Tensor | None) -> None:
    """A worker's side of rank 0's op ``msg``: its table writes, then the same device work on
    this rank's buffers. ``step_ids``: the input ids of the last step it ran."""
    if msg.writes is not None:
        w = msg.writes
        rank.req_pool.apply_writes(w.rows, w.cols, w.slots)
    if isinstance(msg, wire.SaveStates):
        rewind.keep(msg.rows)
    elif isinstance(msg, wire.RestoreStates):
        rewind.put_back(msg.pick, msg.rows)
    elif isinstance(msg, wire.MtpRows):
        rank.drafter.run_rows(msg, rank.runner.hidden, step_ids)
    elif isinstance(msg, wire.MtpPropose):
        rank.drafter.run_propose(msg)
    else:
        raise TypeError(f"not a rank op: {type(msg).__name__}")
