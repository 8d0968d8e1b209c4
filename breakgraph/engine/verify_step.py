"""A speculative verify step's record (``Verify``: its requests, drafts, rows and read-back
handles), its batch (``build_verify``), the counts of verify steps (``SpecStats``) and the
draft length the flags ask for (``draft_tokens``); engine/speculative.py runs them."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from breakgraph.common import envs
from breakgraph.engine.prefill import extend_batch
from breakgraph.engine.request import Req
from breakgraph.engine.spec_chain import Carry
from breakgraph.forward_batch import ForwardBatch


@dataclass
class Verify:
    """A verify step's requests, their drafts and each request's first row; once sampled,
    the read-back handles of every row's choice and acceptance."""

    reqs: list[Req]
    drafts: list[np.ndarray]
    starts: list[int]
    rows: int
    prefixes: list[int] = field(default_factory=list)  # each request's KV length before
    choice: int | None = None
    accept: int | None = None
    draft_ids: int | None = None  # a draft model's drafts, read back with the step
    logprobs: tuple[int, int | None, int | None, int] | None = None  # handles, top-k
    saved: bool = False  # the model's per-request state was kept before it (rank_ops.py)
    hidden: torch.Tensor | None = None  # its streams, for NEXTN's MTP (engine/mtp.py)
    fixed: list[int] | None = None  # draft tokens each request keeps (synthetic acceptance)
    # verify steps back to back (spec_chain.py): what it leaves the next on the device; the
    # step it was chained to (its prefixes are known once that one is read back) and the
    # rows it may write past each request's prefix
    carry: Carry | None = None
    chained_to: Verify | None = None
    extent: list[int] | None = None

    def layout(self) -> tuple[np.ndarray, np.ndarray]:
        """Each row's request and its offset among that request's rows (int64 [rows]): offset
        0 holds the request's last token, offset j its draft token j - 1. Array ops, no
        Python per row (a verify batch has 1 + k rows per request)."""
        first = np.zeros(self.rows, dtype=np.int64)
        first[self.starts] = 1
        owner = np.cumsum(first) - 1
        return owner, np.arange(self.rows) - np.asarray(self.starts)[owner]

    def next_drafts(self, flat: np.ndarray, offset: np.ndarray) -> np.ndarray:
        """Each row's draft token that follows it (-1 after a request's last row), from the
        drafts concatenated (``flat``) and ``layout``'s offsets."""
        nxt = np.full(self.rows, -1, dtype=np.int64)
        nxt[np.flatnonzero(offset) - 1] = flat
        return nxt


@dataclass
class SpecStats:
    """Verify steps, drafted and accepted draft tokens (the mean accepted length per step
    and request is ``1 + accepted / verified``)."""

    steps: int = 0
    verified: int = 0  # request-steps
    drafted: int = 0
    accepted: int = 0

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + self.accepted / self.verified if self.verified else 0.0

    def totals(self) -> dict[str, int | float]:
        """As the scheduler's live stats name them (/metrics, /get_server_info)."""
        return {
            "spec_verify_steps": self.steps,
            "spec_draft_tokens": self.drafted,
            "spec_accepted_tokens": self.accepted,
            "spec_accept_length": self.mean_accepted_length,
        }


def build_verify(
    reqs: list[Req], drafts: list[np.ndarray], slots: torch.Tensor, req_pool, device
) -> tuple[Verify, ForwardBatch]:
    """The verify batch of ``reqs`` (every one with its last token on the host): rows
    ``[last, *draft]`` at positions ``kv_len ..``, the new slots appended to each request,
    the logits of every row."""
    ext = [1 + len(d) for d in drafts]
    prefixes = [r.kv_len for r in reqs]
    ends = np.cumsum(ext).tolist()
    starts = [e - n for e, n in zip(ends, ext, strict=True)]
    at = ends[-1]
    first = np.zeros(at, dtype=bool)
    first[starts] = True
    ids = np.empty(at, dtype=np.int32)
    ids[first] = [r.output_ids[-1] for r in reqs]
    ids[~first] = np.concatenate(drafts)
    host = slots.numpy()  # a view: each request's slice without a tensor of its own
    for req, s, e in zip(reqs, starts, ends, strict=True):
        req.append_kv(host[s:e])
    table_rows = [r.req_pool_idx for r in reqs]
    batch = verify_rows_batch(ids, slots, table_rows, prefixes, ext, req_pool, device)
    return Verify(reqs, drafts, starts, at), batch


def verify_rows_batch(ids, slots, table_rows, prefixes, ext, req_pool, device) -> ForwardBatch:
    """``extend_batch``'s step (its arguments) as a verify step runs it: every row's logits,
    each row a decode row of its request (``ForwardBatch.as_decode_rows``)."""
    batch = extend_batch(ids, slots, table_rows, prefixes, ext, req_pool, device)
    batch.logits_rows = torch.arange(len(ids), dtype=torch.int64, device=batch.input_ids.device)
    batch.decode_rows = True
    return batch


def draft_tokens(args, model) -> int:
    """The draft length the scheduler uses (0: speculation off); one line naming what does
    not support it yet."""
    algorithm = args.speculative_algorithm
    synthetic = args.bench_synthetic_accept_length
    if synthetic is not None and not (algorithm and envs.BENCH.get()):
        raise ValueError(
            "--bench-synthetic-accept-length is a benchmark aid (its outputs are not the "
            "model's): it needs --speculative-algorithm and BREAKGRAPH_BENCH=1"
        )
    if not algorithm:
        return 0
    why = None
    if algorithm == "NEXTN" and getattr(model, "mtp", None) is None:
        why = f"for {type(model).__name__} (it has no MTP layers: STANDALONE or NGRAM)"
    elif algorithm == "STANDALONE" and not args.speculative_draft_model_path:
        why = "without --speculative-draft-model-path (the draft model)"
    if why:
        raise ValueError(f"--speculative-algorithm {algorithm} is not supported {why}")
    if algorithm in ("STANDALONE", "NEXTN") and args.speculative_num_steps:
        return args.speculative_num_steps
    return args.speculative_num_draft_tokens
