"""NEXTN speculative decoding: the target's own multi-token prediction (MTP) layers draft
(``--speculative-algorithm NEXTN``; DeepSeek V4's, models/deepseek_v4_mtp.py).

MTP row q reads the target's streams at position q and the token at q + 1, and predicts the
token at q + 2; its KV (one sliding-window layer) lives in a pool of its own indexed by the
target's slots and request table, as a draft model's does (engine/draft.py). So the MTP
always lags the target by one row: a step's last row per request waits for the token
sampled from it. That row's streams wait in ``backlog`` (one row per request table row,
``Req.mtp_pos`` its position):

- a target step that is not a verify step (``mirror``): MTP rows from the backlog's position
  (when it is the row before the step's first) to the step's second-to-last row, their next
  tokens the step's own input ids (on the device, so overlap scheduling stays); the last
  row's streams into the backlog;
- a verify step's drafts (``propose``): the first draft step is the backlog row with the
  request's last token, each further one the MTP's own output streams with the draft token
  before (their KV is rewritten once the target has verified them);
- after acceptance (``accepted``): MTP rows over the kept draft tokens with the verify
  step's streams, and the streams of the last kept row into the backlog.

The MTP's drafts are greedy (a point mass: speculative.verify_sample stays lossless at any
temperature). On CUDA its draft steps (one row per request) replay decode graphs of their own
(engine/graphs/mtp.py); the rows a mirror or an acceptance makes ready, whose logits nobody
reads, run eagerly without the LM head.
"""

from __future__ import annotations

import numpy as np
import torch

from breakgraph.cache.kv_pool import KVPool
from breakgraph.engine.graphs.base import GraphTarget
from breakgraph.engine.graphs.mtp import MtpGraphs
from breakgraph.engine.prefill import extend_batch
from breakgraph.engine.tp import wire
from breakgraph.forward_batch import (
    ForwardBatch,
    ForwardContext,
    ForwardMode,
    forward_context,
    token_positions,
    upload_many,
)


class MtpDrafter:
    """The MTP layers' runner over their own KV pool and the target's request table."""

    def __init__(self, mtp, kv_pool: KVPool, req_pool, target_runner, device: torch.device):
        self.mtp = mtp
        self.kv_pool = kv_pool
        self.req_pool = req_pool
        self.target = target_runner  # its ``hidden``: the last forward's streams per row
        target_runner.keep_hidden = True
        self.device = device
        dtype = kv_pool.dtype
        rows = req_pool.table.shape[0]
        self.backlog = torch.zeros(rows, mtp.stream_width, dtype=dtype, device=device)
        self.graphs: MtpGraphs | None = None
        self.send = None  # rank 0 of a TP group: its TPDriver's send_op (attach_tp)

    def attach_tp(self, driver) -> None:
        """Rank 0 of a TP group: every MTP op goes to the workers first (rank_ops.py)."""
        self.send = driver.send_op

    @torch.inference_mode()
    def capture_graphs(self, pad_req_idx: int, max_bs: int) -> None:
        """The draft steps' decode graphs, up to ``max_bs`` rows, over the target's padding
        row of the request table."""
        target = GraphTarget(
            self.mtp, self.kv_pool, self.req_pool.table, pad_req_idx,
            torch.cuda.graph_pool_handle(),
        )  # fmt: skip
        self.graphs = MtpGraphs(target, max_bs, self.mtp.stream_width, self.backlog.dtype)
        self.graphs.capture()

    @torch.inference_mode()
    def _forward(self, batch: ForwardBatch, streams: torch.Tensor, step: int, logits=True):
        """-> (output streams, logits or None) of the MTP layer ``step`` over ``batch``: a
        draft step (``logits``) of the layer the graphs hold replays them."""
        graphs = self.graphs
        decode = batch.mode is ForwardMode.DECODE
        if logits and decode and graphs is not None and step % len(self.mtp.layers) == 0:
            out_logits, out = graphs.replay_streams(batch, streams)
            return out, out_logits
        ctx = ForwardContext(batch=batch, kv_pool=self.kv_pool, req_to_token=self.req_pool.table)
        with forward_context(ctx):
            out = self.mtp(batch.input_ids, batch.positions, streams, step)
        return out, self.mtp.compute_logits(out, step) if logits else None

    def _rows(self, parts: list[tuple], hidden: torch.Tensor, ids) -> None:
        """MTP rows per request and the last rows' streams into the backlog.

        ``parts``: per request (request, first position, whether the first row's streams wait
        in the backlog, the first of its rows of ``hidden`` with the others', how many, the
        row of ``hidden`` the backlog keeps and its position). The rows' next tokens: ``ids``,
        host token ids, or a device tensor of the step's input ids, of which each row's next
        row is the token. Their KV is written, their logits are not computed."""
        n = len(parts)
        if not n:
            return
        backlog = np.fromiter((p[2] for p in parts), dtype=np.int64, count=n)
        row0 = np.fromiter((p[3] for p in parts), dtype=np.int64, count=n)
        m = np.fromiter((p[4] for p in parts), dtype=np.int64, count=n)
        ext = backlog + m
        at = np.cumsum(ext) - ext
        tab = np.fromiter((p[0].req_pool_idx for p in parts), dtype=np.int64, count=n)
        on_device = isinstance(ids, torch.Tensor)
        with_backlog = backlog.astype(bool)
        live = ext > 0
        slots = [
            parts[i][0].kv_slots[parts[i][1] : parts[i][1] + ext[i]] for i in np.flatnonzero(live)
        ]
        i32 = np.int32
        plan = wire.MtpRows(
            slots=torch.cat(slots).numpy().astype(i32) if slots else np.zeros(0, i32),
            table_rows=tab[live].astype(i32),
            prefixes=np.fromiter((p[1] for p in parts), dtype=i32, count=n)[live],
            extends=ext[live].astype(i32),
            ids=None if on_device else np.asarray(ids, dtype=i32),
            idx=token_positions(row0 + 1 - backlog, ext).astype(i32) if on_device else None,
            dst=token_positions(at + backlog, m).astype(i32),
            src=token_positions(row0, m).astype(i32),
            backlog_dst=at[with_backlog].astype(i32),
            backlog_src=tab[with_backlog].astype(i32),
            keep=tab.astype(i32),
            keep_src=np.fromiter((p[5] for p in parts), dtype=i32, count=n),
        )
        if self.send is not None:
            self.send(plan)
        self.run_rows(plan, hidden, ids if on_device else None)
        for req, *_, pos in parts:
            req.mtp_pos = pos

    def run_rows(self, plan: wire.MtpRows, hidden: torch.Tensor, step_ids) -> None:
        """This rank's MTP rows of ``plan`` (see ``wire.MtpRows``): its streams from
        ``hidden`` (the last target forward's) and the backlog; ``step_ids``: that step's
        input ids, where the plan's next tokens are theirs."""
        d, s, bd, bs, kt, ks, idx = upload_many(
            [plan.dst, plan.src, plan.backlog_dst, plan.backlog_src, plan.keep, plan.keep_src,
             plan.idx if plan.ids is None else []],
            torch.int64, self.device,
        )  # fmt: skip
        if len(plan.slots):
            host = np.zeros(len(plan.slots), np.int32) if plan.ids is None else plan.ids
            slots = torch.from_numpy(plan.slots.astype(np.int64))
            batch = extend_batch(
                host, slots, plan.table_rows.tolist(), plan.prefixes.tolist(),
                plan.extends.tolist(), self.req_pool, self.device,
            )  # fmt: skip
            if plan.ids is None:
                batch.input_ids = step_ids[idx]
            streams = hidden.new_empty((len(plan.slots), hidden.shape[1]))
            streams[d] = hidden[s]
            streams[bd] = self.backlog[bs]
            self._forward(batch, streams, 0, logits=False)
        self.backlog[kt] = hidden[ks]  # after the gather above, in stream order

    def mirror(self, batch: ForwardBatch, reqs) -> None:
        """The MTP rows a target step (not a verify step) makes ready: from the backlog's row
        where it is the one before the step's first, to the step's second-to-last row; the
        last rows into the backlog."""
        parts, start = [], 0
        for req, p, e in zip(reqs, batch.prefix_lens_cpu, batch.extend_lens_cpu, strict=True):
            backlog = p >= 1 and req.mtp_pos == p - 1
            parts.append((req, p - backlog, backlog, start, e - 1, start + e - 1, p + e - 1))
            start += e
        self._rows(parts, self.target.hidden, batch.input_ids)

    def hold(self, verify) -> None:
        """A verify step's streams, kept with it until its acceptance (``accepted``)."""
        verify.hidden = self.target.hidden

    def accepted(self, verify, kept: list[int | None]) -> None:
        """After a verify step: MTP rows over each request's kept draft tokens (``kept[i]``
        of them; None: finished) with the step's streams, and its last kept row's streams
        into the backlog. Before any other target forward (its streams are a graph's
        output)."""
        parts, ids = [], []
        for req, n, start, p in zip(verify.reqs, kept, verify.starts, verify.prefixes,
                                    strict=True):  # fmt: skip
            if n is not None:
                parts.append((req, p, False, start, n, start + n, p + n))
                ids.append(req.fill_prefix(p + 1 + n, p + 1))
        hidden, verify.hidden = verify.hidden, None
        self._rows(parts, hidden, np.concatenate(ids) if ids else None)

    def propose(self, reqs, lens: list[int], prefixes: list[int]) -> torch.Tensor:
        """Drafts [len(reqs), max(lens)] int64 on the device: request i's first ``lens[i]``
        tokens, the first from its backlog row (position ``prefixes[i] - 1``) and its last
        token, each next from the MTP's output streams and the draft token before. No host
        sync."""
        slots = [
            r.kv_slots[p - 1 : p - 1 + n] for r, n, p in zip(reqs, lens, prefixes, strict=True)
        ]
        i32 = np.int32
        plan = wire.MtpPropose(
            table_rows=np.fromiter((r.req_pool_idx for r in reqs), dtype=i32, count=len(reqs)),
            prefixes=np.asarray(prefixes, dtype=i32),
            lens=np.asarray(lens, dtype=i32),
            first_ids=np.fromiter((r.output_ids[-1] for r in reqs), dtype=i32, count=len(reqs)),
            slots=torch.cat(slots).numpy().astype(i32),
        )
        if self.send is not None:
            self.send(plan)
        return self.run_propose(plan)

    def run_propose(self, plan: wire.MtpPropose) -> torch.Tensor:
        """This rank's drafts of ``plan`` (see ``wire.MtpPropose``)."""
        lens, prefixes = plan.lens.tolist(), plan.prefixes.tolist()
        n, k = len(lens), max(lens)
        first = np.cumsum(lens) - lens  # each request's first slot in ``plan.slots``
        drafts = torch.zeros(n, k, dtype=torch.int64, device=self.device)
        live = [i for i in range(n) if lens[i] > 0]
        (tab,) = upload_many([plan.table_rows[live]], torch.int64, self.device)
        streams, keep = self.backlog[tab], list(range(len(live)))
        for j in range(k):
            if j:
                keep = [m for m, i in enumerate(live) if lens[i] > j]
                live = [live[m] for m in keep]
            at = [prefixes[i] - 1 + j for i in live]  # the row of the token before the draft
            ids = plan.first_ids[live] if j == 0 else np.zeros(len(live), np.int32)
            batch = ForwardBatch.build(
                ForwardMode.DECODE, ids, plan.slots[first[live] + j], plan.table_rows[live],
                at, [1] * len(live), self.device,
            )  # fmt: skip
            idx, rows = upload_many([live, keep], torch.int64, self.device)
            if j:
                batch.input_ids = drafts[idx, j - 1]
                streams = streams[rows]
            streams, logits = self._forward(batch, streams, j)
            drafts[idx, j] = logits.argmax(dim=-1)
        return drafts
