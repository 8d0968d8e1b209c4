"""Verify steps back to back under overlap scheduling: verify step k + 1 is scheduled and
launched while step k is still on the device, so the host's work between them (reading step
k back, its outputs, scheduling and launching k + 1) runs beside the GPU's.

What step k + 1 needs from step k stays on the device (``Carry``): each request's next
position (its prefix plus the tokens it keeps, which only the device knows yet), its last
token (the first row of step k + 1 and the draft model's input) and the token before it.
So step k + 1's rows are built on the device (``device_batch``): their positions from the
carried base, their KV slots gathered from the request table at those positions, their
lengths read by the attention kernels on the device; the host knows only upper bounds (the
lengths had every draft token of step k been kept), which is all a launch needs (graph
buckets and kernel grids are sized by the rows, which the host knows exactly).

KV slots: when step k + 1 is scheduled, each request's table already holds slots through
the end of step k's rows; it gets ``1 + k`` more, so the table covers every position step
k + 1 may write whatever step k keeps. Reading step k back, the host learns what it kept
and frees the slots past what step k + 1 may still write (``extent``); reading step k + 1
back (with nothing chained after it) it frees the rest, as an unchained verify step does.
A request that ends at step k (a stop token, a length) has its step k + 1 rows dropped, its
KV released at once (later steps are queued after step k + 1 on the stream).

Chained only where the host needs nothing of step k to build step k + 1: a draft model's
drafts (STANDALONE: they start from the carried token) or n-gram drafts looked up as if step
k keeps all of its own (NGRAM: ``NgramProposer.propose_after``), no grammar (its masks need the
tokens on the host), no model state beside the KV (DeepSeek V4's compressors read host
positions), no request waiting to prefill. Otherwise step k is read back first, as before.
Under TP rank 0 broadcasts a chained step's carried base with its input ids, and the workers
rebuild the step from it (``device_batch``, ``ForwardBatch.device_base``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from breakgraph.forward_batch import ForwardBatch, ForwardMode, upload_many


@dataclass
class Carry:
    """What a verify step leaves on the device for the next one, per request: its KV length
    once it keeps its tokens (the next step's first position), its last kept token and the
    token before it (device int64 [B])."""

    base: torch.Tensor
    last: torch.Tensor
    prev: torch.Tensor


def carry_of(
    accept: torch.Tensor,
    choice: torch.Tensor,
    input_ids: torch.Tensor,
    prefixes: torch.Tensor,
    req_of_row: torch.Tensor,
    starts: torch.Tensor,
    first: torch.Tensor,
    kept: torch.Tensor | None = None,
) -> Carry:
    """A verify step's carry from its acceptance on the device: request i keeps its draft
    tokens while its rows accept (``kept``: a benchmark's fixed count instead), then the
    choice of the row it stops at. Device ops, no sync."""
    if kept is None:
        leading = (emitted(accept, first) & accept).to(torch.int64)
        kept = torch.zeros_like(prefixes).index_add_(0, req_of_row, leading)
    at = starts + kept
    return Carry(prefixes + kept + 1, choice[at], input_ids[at])


def emitted(accept: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """Whether each verify row's token is emitted: every row of its request before it
    accepted its draft token (``first``: each row's request's first row; device ops)."""
    rejected = (~accept).to(torch.int32)
    before = rejected.cumsum(0) - rejected  # rejections before each row
    return before == before[first]


def device_batch(
    mode: ForwardMode,
    table: torch.Tensor,
    table_rows: list[int],
    base: torch.Tensor,
    extends: list[int],
    upper: list[int],
    input_ids: torch.Tensor,
    all_logits: bool,
) -> ForwardBatch:
    """A step of ``extends[i]`` rows for request i at positions ``base[i] ..`` (a device
    tensor, int64), their KV slots gathered from ``table`` (which must hold them already);
    ``upper``: a host bound of each ``base``. The logits of every row (``all_logits``) or
    of each request's last."""
    device = base.device
    ext = np.asarray(extends, dtype=np.int64)
    ends = np.cumsum(ext)
    starts = ends - ext
    owner = np.repeat(np.arange(len(ext)), ext)
    offset = np.arange(int(ends[-1]) if len(ext) else 0) - np.repeat(starts, ext)
    logits_rows = np.arange(len(owner)) if all_logits else ends - 1
    rows_np = np.asarray(table_rows, dtype=np.int64)
    i64 = upload_many([owner, offset, rows_np, np.repeat(rows_np, ext), logits_rows],
                      torch.int64, device)  # fmt: skip
    owner_t, offset_t, rows_t, row_of_token, logits_t = i64
    ext32, starts32 = upload_many([ext, starts], torch.int32, device)
    positions = base[owner_t] + offset_t
    seq = (base + ext32).to(torch.int32)
    up = np.asarray(upper, dtype=np.int64)
    return ForwardBatch(
        mode=mode,
        input_ids=input_ids,
        positions=positions,
        out_cache_loc=table[row_of_token, positions].to(torch.int64),
        req_pool_indices=rows_t,
        seq_lens=seq,
        prefix_lens=base.to(torch.int32),
        extend_lens=ext32,
        extend_start_loc=starts32,
        logits_rows=logits_t,
        seq_lens_cpu=(up + ext).tolist(),
        prefix_lens_cpu=up.tolist(),
        extend_lens_cpu=ext.tolist(),
        req_pool_indices_cpu=list(table_rows),
        device_base=base,
    )
