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
from breakgraph.forward_batch import (
    ForwardBatch,
    ForwardContext,
    ForwardMode,
    forward_context,
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
        """MTP rows of each request, ``parts`` of (request, first position, whether the first
        row's streams wait in the backlog, the rows of ``hidden`` with the others'), their
        next tokens ``ids`` (host array or device tensor, in row order): their KV written,
        their logits unused."""
        parts = [p for p in parts if p[2] or p[3]]
        if not parts:
            return
        ext = [int(b) + len(rows) for _, _, b, rows in parts]
        slots = torch.cat(
            [
                req.kv_slots[first : first + n]
                for (req, first, _, _), n in zip(parts, ext, strict=True)
            ]
        )
        host = ids if isinstance(ids, np.ndarray) else np.zeros(len(slots), np.int32)
        batch = extend_batch(
            host, slots, [req.req_pool_idx for req, *_ in parts], [p[1] for p in parts], ext,
            self.req_pool, self.device,
        )  # fmt: skip
        if not isinstance(ids, np.ndarray):
            batch.input_ids = ids
        dst, src, back_dst, back_src, at = [], [], [], [], 0
        for (req, _, backlog, rows), n in zip(parts, ext, strict=True):
            if backlog:
                back_dst.append(at)
                back_src.append(req.req_pool_idx)
            dst += range(at + int(backlog), at + n)
            src += rows
            at += n
        d, s, bd, bs = upload_many([dst, src, back_dst, back_src], torch.int64, self.device)
        streams = hidden.new_empty((at, hidden.shape[1]))
        streams[d] = hidden[s]
        streams[bd] = self.backlog[bs]
        self._forward(batch, streams, 0, logits=False)

    def _keep(self, reqs, rows: list[int], positions: list[int], hidden: torch.Tensor) -> None:
        """Each request's streams at ``rows`` of ``hidden`` (position ``positions``) into the
        backlog."""
        tab, src = upload_many([[r.req_pool_idx for r in reqs], rows], torch.int64, self.device)
        self.backlog[tab] = hidden[src]
        for req, pos in zip(reqs, positions, strict=True):
            req.mtp_pos = pos

    def mirror(self, batch: ForwardBatch, reqs) -> None:
        """The MTP rows a target step (not a verify step) makes ready: from the backlog's row
        where it is the one before the step's first, to the step's second-to-last row; the
        last rows into the backlog."""
        hidden = self.target.hidden
        parts, ids, last, last_pos, start = [], [], [], [], 0
        for req, p, e in zip(reqs, batch.prefix_lens_cpu, batch.extend_lens_cpu, strict=True):
            backlog = p >= 1 and req.mtp_pos == p - 1
            parts.append((req, p - int(backlog), backlog, range(start, start + e - 1)))
            ids += range(start + 1 - int(backlog), start + e)  # the next token of each row
            last.append(start + e - 1)
            last_pos.append(p + e - 1)
            start += e
        (idx,) = upload_many([ids], torch.int64, self.device)
        self._rows(parts, hidden, batch.input_ids[idx])
        self._keep(reqs, last, last_pos, hidden)

    def hold(self, verify) -> None:
        """A verify step's streams, kept with it until its acceptance (``accepted``)."""
        verify.hidden = self.target.hidden

    def accepted(self, verify, kept: list[int | None]) -> None:
        """After a verify step: MTP rows over each request's kept draft tokens (``kept[i]``
        of them; None: finished) with the step's streams, and its last kept row's streams
        into the backlog. Before any other target forward (its streams are a graph's
        output)."""
        parts, ids, reqs, last, last_pos = [], [], [], [], []
        for req, n, start, p in zip(verify.reqs, kept, verify.starts, verify.prefixes,
                                    strict=True):  # fmt: skip
            if n is None:
                continue
            parts.append((req, p, False, range(start, start + n)))
            ids += req.fill_prefix(p + 1 + n, p + 1).tolist()
            reqs.append(req)
            last.append(start + n)
            last_pos.append(p + n)
        hidden, verify.hidden = verify.hidden, None
        self._rows(parts, hidden, np.asarray(ids, dtype=np.int32))
        if reqs:
            self._keep(reqs, last, last_pos, hidden)

    def propose(self, reqs, lens: list[int], prefixes: list[int]) -> torch.Tensor:
        """Drafts [len(reqs), max(lens)] int64 on the device: request i's first ``lens[i]``
        tokens, the first from its backlog row (position ``prefixes[i] - 1``) and its last
        token, each next from the MTP's output streams and the draft token before. No host
        sync."""
        n, k = len(reqs), max(lens)
        drafts = torch.zeros(n, k, dtype=torch.int64, device=self.device)
        live = [i for i in range(n) if lens[i] > 0]
        (tab,) = upload_many([[reqs[i].req_pool_idx for i in live]], torch.int64, self.device)
        streams, keep = self.backlog[tab], list(range(len(live)))
        for j in range(k):
            if j:
                keep = [m for m, i in enumerate(live) if lens[i] > j]
                live = [live[m] for m in keep]
            at = [prefixes[i] - 1 + j for i in live]  # the row of the token before the draft
            ids = [reqs[i].output_ids[-1] for i in live] if j == 0 else [0] * len(live)
            batch = ForwardBatch.build(
                ForwardMode.DECODE, ids,
                torch.stack([reqs[i].kv_slots[a] for i, a in zip(live, at, strict=True)]),
                [reqs[i].req_pool_idx for i in live], at, [1] * len(live), self.device,
            )  # fmt: skip
            idx, rows = upload_many([live, keep], torch.int64, self.device)
            if j:
                batch.input_ids = drafts[idx, j - 1]
                streams = streams[rows]
            streams, logits = self._forward(batch, streams, j)
            drafts[idx, j] = logits.argmax(dim=-1)
        return drafts
