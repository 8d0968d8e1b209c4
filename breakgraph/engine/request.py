"""A request's state inside the engine (its sampling parameters: common/sampling_params.py)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

# re-exported: engine code imports SamplingParams from here
from breakgraph.common.sampling_params import SamplingParams

__all__ = ["Req", "ReqStatus", "SamplingParams"]


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)  # slots: the scheduler reads a few fields per request per step
class Req:
    rid: str
    # the prompt, int32 and read-only (the engine's copy of the message's packed ids): a 64K
    # prompt reaches the radix tree and the step's upload without a Python int per id
    input_ids: np.ndarray
    sampling: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1  # first prompt position with a logprob (-1: none)
    top_logprobs_num: int = 0  # top-k logprobs per position (with return_logprob)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)  # from logprob_start_len
    input_top_logprobs: list[list[list] | None] = field(default_factory=list)
    penalty_row: int | None = None  # its row of the PenaltyPool (None: no penalties)
    grammar: Any = None  # its RequestGrammar (engine/grammar/; None: unconstrained)
    status: ReqStatus = ReqStatus.WAITING
    finish_reason: dict[str, Any] | None = None
    # KV state: slots of the tokens of fill_ids whose KV is computed, in order
    req_pool_idx: int | None = None
    kv_len: int = 0  # tokens of fill_ids whose KV is computed; their slots: kv_slots
    _kv_buf: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    # a numpy view of _kv_buf while the request owns it (None while it holds set_kv's
    # tensor, which it never writes): decode's one-slot append is a numpy store
    _kv_np: np.ndarray | None = None
    cached_len: int = 0  # leading kv_slots owned by the radix tree (locked via last_node)
    # tokens before kv_len its next prefill chunk computes again, storing no KV (KV slot 0
    # in the step): the rows that rebuild a model's per-request state over a cached prefix
    recompute: int = 0
    last_node: Any = None
    prefix_hit_tokens: int = 0  # cached tokens reused at (first) admission, for meta_info
    generator: torch.Generator | None = None
    decoding: bool = False  # in the scheduler's running (decode) list
    # overlap scheduling: tokens sampled on the device, not yet read back (0 or 1 when a step
    # is scheduled), and the row of the newest one in its step's sampled ids
    num_pending: int = 0
    pending_row: int = 0
    num_retractions: int = 0
    # speculative decoding with a draft model: the position whose draft KV is not yet
    # written (-1: none; engine/draft.py)
    draft_hole: int = -1
    # NEXTN: the position whose target streams wait in the MTP's backlog (-1: none;
    # engine/mtp.py)
    mtp_pos: int = -1
    # NGRAM: the index of its tokens' n-grams (engine/ngram.py; built at its first draft)
    ngram: Any = None
    # timeline, wall clock (time.time: comparable with the API process's stamps)
    received_at: float = field(default_factory=time.time)
    scheduled_at: float | None = None  # first scheduled
    forward_start_at: float | None = None  # host side, its first forward
    forward_end_at: float | None = None
    first_token_at: float | None = None  # its first token read back on the host

    @property
    def prompt_rows_from(self) -> int | None:
        """First prompt row whose logits the request still needs (None: none).

        Row q's logits give the logprob of prompt token q + 1; position 0 has none."""
        if not self.return_logprob or self.logprob_start_len < 0 or self.num_generated:
            return None
        return max(self.logprob_start_len - 1, 0)

    @property
    def fill_ids(self) -> np.ndarray:
        """All tokens that will have KV: the prompt and the output so far (int32)."""
        return self.fill_prefix(self.fill_len)

    def fill_prefix(self, n: int, start: int = 0) -> np.ndarray:
        """``fill_ids[start:n]`` (int32) without building ``fill_ids``: within the prompt a
        view of it, past it a copy of the part taken."""
        k = len(self.input_ids)
        if n <= k:
            return self.input_ids[start:n]
        out = np.asarray(self.output_ids[max(start - k, 0) : n - k], dtype=np.int32)
        return np.concatenate((self.input_ids[start:], out)) if start < k else out

    def fill_tokens(self) -> FillTokens:
        """``fill_ids`` as an n-gram lookup reads it, without building it."""
        return FillTokens(self)

    @property
    def fill_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def num_generated(self) -> int:
        """Output tokens sampled so far, those still on the device included."""
        return len(self.output_ids) + self.num_pending

    @property
    def next_input_id(self) -> int:
        """The token a decode row feeds: the last output, or ``-(row + 1)`` naming the row
        of the previous step's sampled ids that holds it when it is still on the device."""
        return -(self.pending_row + 1) if self.num_pending else self.output_ids[-1]

    @property
    def kv_slots(self) -> torch.Tensor:
        return self._kv_buf[: self.kv_len]

    def set_kv(self, slots: torch.Tensor) -> None:
        self._kv_buf, self.kv_len, self._kv_np = slots, slots.numel(), None

    def append_kv(self, slots: torch.Tensor | np.ndarray) -> None:
        """Amortized O(1) per token: the buffer grows by doubling. ``slots``: a host tensor,
        or an array (a step's slices of one array cost no tensor each)."""
        src = slots if isinstance(slots, np.ndarray) else slots.numpy()
        n = self.kv_len + len(src)
        self._own_kv(n)
        self._kv_np[self.kv_len : n] = src
        self.kv_len = n

    def append_kv_slot(self, slot: int) -> None:
        """Decode's one slot, in a fraction of a tensor store's host time (a decode step
        makes one per request)."""
        n = self.kv_len
        if self._kv_np is None or n == len(self._kv_np):
            self._own_kv(n + 1)
        self._kv_np[n] = slot
        self.kv_len = n + 1

    def truncate_kv(self, n: int) -> torch.Tensor:
        """Keep the first ``n`` slots; return the others (a copy: the caller frees them)."""
        dropped = self._kv_buf[n : self.kv_len].clone()
        self.kv_len = n
        return dropped

    def _own_kv(self, n: int) -> None:
        """Room for ``n`` slots in a buffer of the request's own (set_kv's is borrowed)."""
        if self._kv_np is not None and n <= len(self._kv_np):
            return
        buf = torch.empty(max(2 * n, 64), dtype=torch.int64)
        if self.kv_len:
            buf[: self.kv_len] = self._kv_buf[: self.kv_len]
        self._kv_buf, self._kv_np = buf, buf.numpy()

    @property
    def finished(self) -> bool:
        return self.status is ReqStatus.FINISHED


class FillTokens:
    """A request's ``fill_ids`` without building them (a copy of every output token, each
    step): its length, one token, a slice (``Req.fill_prefix``: a view within the prompt, a
    copy past it). What an n-gram lookup reads (engine/ngram.py), in time that does not grow
    with the request."""

    __slots__ = ("req",)

    def __init__(self, req: Req):
        self.req = req

    def __len__(self) -> int:
        return self.req.fill_len

    def tolist_from(self, start: int, stop: int | None = None) -> list[int]:
        """``fill_ids[start:stop].tolist()``, the output part without an array between."""
        req = self.req
        k = len(req.input_ids)
        if start >= k:
            return req.output_ids[start - k : None if stop is None else stop - k]
        if stop is not None and stop <= k:
            return req.input_ids[start:stop].tolist()
        return req.input_ids[start:].tolist() + req.output_ids[: None if stop is None else stop - k]

    def __getitem__(self, i):
        req = self.req
        if isinstance(i, slice):
            start, stop, step = i.indices(req.fill_len)
            if step != 1:
                raise ValueError("FillTokens slices take a step of 1")
            return req.fill_prefix(stop, min(start, stop))
        k = len(req.input_ids)
        if i < 0:
            i += req.fill_len
        return int(req.input_ids[i]) if i < k else req.output_ids[i - k]
