"""Prompt logprobs: which of a step's rows are prompt rows a request wants logprobs of, their
flat indices and targets for the forward, and their values back into each request."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from breakgraph.common.messages import TokenDelta
from breakgraph.engine.request import Req
from breakgraph.forward_batch import ForwardBatch, ForwardMode, upload_many


@dataclass
class PromptRows:
    """A request's prompt rows in this step: ``count`` rows from position ``first``."""

    req: Req
    first: int
    count: int
    row: int  # its first row in the step's flat rows


def req_k(req: Req) -> int:
    """Top-k a request wants for its prompt rows."""
    return req.top_logprobs_num if req.return_logprob else 0


def prompt_rows(reqs: list[Req], batch: ForwardBatch) -> list[PromptRows]:
    """The prompt rows this step computes that requests want logprobs of."""
    if batch.mode is ForwardMode.DECODE:  # prompt rows are only ever in extend steps
        return []
    out, start = [], 0
    for req, pre, ext in zip(reqs, batch.prefix_lens_cpu, batch.extend_lens_cpu, strict=True):
        first = req.prompt_rows_from
        if first is not None:
            lo, hi = max(pre, first), min(pre + ext, len(req.input_ids) - 1)
            if hi > lo or (req.logprob_start_len == 0 and not req.input_logprobs):
                out.append(PromptRows(req, lo, max(hi - lo, 0), start + lo - pre))
        start += ext
    return out


def prompt_plan(
    prompt: list[PromptRows], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Flat row indices, target ids and top-k of the step's prompt rows (one upload)."""
    rows, targets = [], []
    for p in prompt:
        rows.extend(range(p.row, p.row + p.count))
        targets.extend(p.req.input_ids[p.first + 1 : p.first + 1 + p.count])
    rows_t, targets_t = upload_many([rows, targets], torch.int64, device)
    return rows_t, targets_t, max(req_k(p.req) for p in prompt)


def take_prompt_logprobs(
    prompt: list[PromptRows],
    handles: tuple[int, int | None, int | None],
    k: int,
    values: list[list[float]],
    live: Callable[[Req], bool],
) -> None:
    """The step's read-back prompt logprobs (``values`` at ``handles``: logprobs, top-k
    values, top-k ids) appended to each request still ``live``."""
    lp_h, tv_h, ti_h = handles
    lps = values[lp_h]
    at = 0
    for p in prompt:
        req, n, want = p.req, p.count, req_k(p.req)
        if not live(req):  # aborted while in flight
            at += n
            continue
        if req.logprob_start_len == 0 and not req.input_logprobs:
            req.input_logprobs.append(None)  # the first prompt token has no logprob
            req.input_top_logprobs.append(None)
        req.input_logprobs.extend(lps[at : at + n])
        if want:
            tv, ti = values[tv_h], values[ti_h]
            req.input_top_logprobs.extend(
                [[tv[r * k + j], int(ti[r * k + j])] for j in range(want)]
                for r in range(at, at + n)
            )
        at += n


def attach_prompt(out: TokenDelta, req: Req) -> None:
    """A request's prompt logprobs travel once, with its first output."""
    if req.logprob_start_len >= 0 and req.return_logprob:
        out.input_logprobs = list(req.input_logprobs)
        out.input_top_logprobs = list(req.input_top_logprobs) if req.top_logprobs_num else []
