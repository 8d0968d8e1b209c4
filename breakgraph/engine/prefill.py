"""Prefill: the waiting queue, admission (table row, cached prefix), chunking, and the
extend batch.

A batch takes the chunked request first (the one whose prompt did not fit last step),
then requests from the head of the queue, in order, while the budgets allow:

- ``--chunked-prefill-size``: new tokens in the batch; the request that overflows it is
  cut into a chunk and continues first next step (it is then the ``chunked`` request);
- ``--max-prefill-tokens`` (SGLang's meaning): new tokens in the batch; a request that
  would overflow it waits to lead the next batch, and the batch's first request is
  admitted whatever its size (bounded by the chunk size alone);
- ``--max-running-requests``, and KV room: a new request leaves room for the running
  ones' future decode tokens (see decode.py) unless nothing else is in flight.

A waiting request whose prompt equals one that this batch computes (the samples of an
``n > 1`` request, or a repeated prompt) ends the batch: next step it finds that prompt in
the radix tree and computes only its last token, so n samples cost one prompt prefill.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

from breakgraph.engine.config import SchedulerConfig
from breakgraph.engine.request import Req, ReqStatus
from breakgraph.forward_batch import ForwardBatch, ForwardMode, token_positions

if TYPE_CHECKING:
    from breakgraph.engine.cache_manager import CacheManager
    from breakgraph.engine.decode import DecodeManager


class PrefillManager:
    def __init__(
        self,
        cache: CacheManager,
        decode: DecodeManager,
        cfg: SchedulerConfig,
        device: torch.device,
        has_room: Callable[[Req], bool] = lambda req: True,
        on_admit: Callable[[Req], None] = lambda req: None,
    ):
        """``has_room(req)``: room for the request beside its KV (a penalty-pool row);
        ``on_admit(req)``: what it takes once admitted."""
        self.cache = cache
        self.decode = decode
        self.cfg = cfg
        self.device = device
        self.waiting: deque[Req] = deque()
        self.chunked: Req | None = None  # mid-prefill: continues first next step
        # the last batch's prefill requests, whose computed tokens go into the prefix tree
        # once the step is launched (cache_computed)
        self.uncached: list[Req] = []
        self.has_room = has_room
        self.on_admit = on_admit

    # ---- queue ----
    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def requeue(self, req: Req) -> None:
        """A retracted request goes back to the front."""
        self.waiting.appendleft(req)

    def remove(self, req: Req) -> None:
        """Take a request out wherever it is here (waiting or chunked)."""
        if req.status is ReqStatus.WAITING and req in self.waiting:
            self.waiting.remove(req)
        if req is self.chunked:
            self.chunked = None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or self.chunked is not None

    @property
    def num_in_prefill(self) -> int:
        """Requests between admission and their last prefill chunk (0 or 1)."""
        return int(self.chunked is not None and not self.chunked.decoding)

    def _candidates(self, chunked: Req | None) -> Iterator[Req]:
        """The chunked request, then the head of the queue, one at a time: each waiting
        candidate is either taken off the queue's head by the loop or ends it (O(admitted))."""
        if chunked is not None:
            yield chunked
        while self.waiting:
            yield self.waiting[0]

    # ---- one batch ----
    def schedule_batch(self, finished: list[Req]) -> tuple[list[Req], ForwardBatch] | None:
        """Admit and chunk requests into one extend batch (None: nothing to prefill).

        Waiting requests that need no forward (``max_new_tokens`` 0) leave the queue into
        ``finished``. With mixed chunks (the default) the running requests decode one token
        each inside the batch, after the prefill rows.
        """
        if not self.has_work:
            return None
        cfg, running = self.cfg, self.decode.stepping()
        mixed = cfg.enable_mixed_chunk and bool(running)
        # a mixed step keeps one row per running request inside the chunk (and its bucket)
        mixed_rows = len(running) if mixed else 0
        budget = cfg.chunked_prefill_size - mixed_rows
        input_left = None if cfg.max_prefill_tokens is None else cfg.max_prefill_tokens - mixed_rows
        reqs: list[Req] = []
        computing = _PromptIndex()  # the prompts of reqs, by content
        extends: list[int] = []
        prefixes: list[int] = []
        new_slots: list[torch.Tensor] = []
        candidates = self._candidates(self.chunked)
        self.chunked = None
        reserve = self.decode.reserved_tokens(running)
        for req in candidates:
            if budget <= 0:
                break
            waiting = req.status is ReqStatus.WAITING
            if waiting:
                if len(running) + len(reqs) >= cfg.max_running_requests:
                    break
                if computing.computes(req) or not self.has_room(req):
                    break
                if req.sampling.max_new_tokens == 0 and req.prompt_rows_from is None:
                    finished.append(self.waiting.popleft())
                    continue
                if not self.cache.admit(req):
                    break
            remaining = req.fill_len - req.kv_len
            extend = min(remaining, budget - req.recompute)
            if reqs and input_left is not None and extend > input_left:
                extend = 0  # over --max-prefill-tokens: it leads the next batch instead
            extend = self._fit_kv(extend, reserve if waiting else 0, alone=not (reqs or running))
            slots = self.cache.alloc(extend) if extend > 0 else None
            if slots is None:
                if waiting:
                    self.cache.unadmit(req)
                else:  # a chunked request that cannot continue now stays chunked
                    self.chunked = req
                break
            if waiting:
                self.waiting.popleft()
                self.on_admit(req)
                req.status = ReqStatus.RUNNING  # in flight; starts decoding after its last chunk
                reserve += self.decode.reserved_tokens([req])
            reqs.append(req)
            computing.add(req)
            extends.append(extend)
            prefixes.append(req.kv_len)
            new_slots.append(slots)
            budget -= extend + req.recompute
            if input_left is not None:
                input_left -= extend
            if extend < remaining:  # this request continues next step: it is the chunked one
                break
        if not reqs:
            return None
        prefill_reqs = list(reqs)
        if mixed and self.cache.available >= len(running):
            slots = self.cache.alloc(len(running))
            for req, slot in zip(running, slots.split(1), strict=True):
                reqs.append(req)
                extends.append(1)
                prefixes.append(req.kv_len)
                new_slots.append(slot)
        batch = self._build(reqs, extends, prefixes, new_slots)
        self.uncached = prefill_reqs
        return reqs, batch

    def cache_computed(self) -> None:
        """Insert the last batch's prefill tokens into the prefix tree.

        The scheduler calls this right after launching the batch, so the radix insert runs
        while the GPU computes (a cold prompt's TTFT no longer waits for it) and before the
        next batch is scheduled: a later request still finds these tokens. Before the
        launch, nothing reads the tree's view of them."""
        reqs, self.uncached = self.uncached, []
        if reqs:
            self.cache.cache_prefill(reqs)

    def _fit_kv(self, extend: int, reserve: int, alone: bool) -> int:
        """Cut ``extend`` to the KV room left after ``reserve`` slots.

        A request alone in flight must make progress: it may use the reserve (in chunks if
        need be); otherwise it gets what is left, possibly nothing.
        """
        available = self.cache.available
        limit = available - reserve
        if extend > limit:
            extend = min(extend, available) if alone else max(0, limit)
        return extend

    def _build(
        self,
        reqs: list[Req],
        extends: list[int],
        prefixes: list[int],
        new_slots: list[torch.Tensor],
    ) -> ForwardBatch:
        """Give each request its new slots, write them to the table, upload the batch.

        A request's recomputed rows (``Req.recompute``, before its cached prefix's end) run
        with KV slot 0, so nothing is stored for them; the table keeps the tree's slots."""
        parts: list[np.ndarray] = []  # int32 views of the prompts: one copy into the upload
        recomputed: list[tuple[int, int, torch.Tensor]] = []  # (row, first column, slots)
        for i, (req, ext, pre, slots) in enumerate(
            zip(reqs, extends, prefixes, new_slots, strict=True)
        ):
            if req.decoding:  # a mixed step's decode row: its last token (maybe a placeholder)
                parts.append(np.array([req.next_input_id], dtype=np.int32))
            else:
                r, req.recompute = req.recompute, 0
                if r:
                    recomputed.append((req.req_pool_idx, pre - r, req.kv_slots[pre - r : pre]))
                    extends[i], prefixes[i] = ext + r, pre - r
                    new_slots[i] = torch.cat([torch.zeros(r, dtype=slots.dtype), slots])
                parts.append(req.fill_prefix(pre + ext, pre - r))
            req.append_kv(slots)
            if not req.decoding and req.kv_len < req.fill_len:
                self.chunked = req
        all_slots = new_slots[0] if len(new_slots) == 1 else torch.cat(new_slots)
        input_ids = parts[0] if len(parts) == 1 else np.concatenate(parts)
        req_pool = self.cache.req_pool
        batch = extend_batch(
            input_ids, all_slots, [r.req_pool_idx for r in reqs], prefixes, extends, req_pool,
            self.device,
        )  # fmt: skip
        for row, col, slots in recomputed:  # the tree's slots again where slot 0 went up
            req_pool.write(row, col, slots)
        return batch


def extend_batch(
    input_ids: np.ndarray,
    slots: torch.Tensor,
    table_rows: list[int],
    prefixes: list[int],
    extends: list[int],
    req_pool,
    device: torch.device,
) -> ForwardBatch:
    """An extend step's batch, uploaded, its new ``slots`` written into the request table
    from the batch's own upload (one kernel); TP rank 0 logs them as host rows, columns and
    slots for the workers."""
    pre = np.asarray(prefixes, dtype=np.int64)
    ext = np.asarray(extends, dtype=np.int64)
    cols = token_positions(pre, ext)
    batch = ForwardBatch.build(
        ForwardMode.EXTEND, input_ids, slots, table_rows, pre, ext, device,
        positions=cols, table_width=req_pool.max_context_len,
    )  # fmt: skip
    log = None
    if req_pool.write_log is not None:
        log = (np.repeat(np.asarray(table_rows, dtype=np.int64), ext), cols, slots)
    req_pool.write_batch(batch, log=log)
    return batch


class _PromptIndex:
    """The requests of a batch being built, by their prompts' content: whether one of them
    computes a request's prompt (which must then wait a step and hit the cache) is a dict
    lookup. Compared pairwise, 128 prompts of one length took 42 ms a step on the CPU box.
    A prompt is hashed only once the batch holds another of its length (a lone 64K prompt
    is not hashed at all), and at most once."""

    def __init__(self) -> None:
        self._unhashed: dict[int, list[Req]] = {}  # by prompt length
        self._hashed_lengths: set[int] = set()
        self._by_key: dict[tuple[int, int], list[Req]] = {}
        self._asked: tuple[Req | None, tuple[int, int]] = (None, (0, 0))  # the last lookup

    def _key(self, req: Req) -> tuple[int, int]:
        asked, key = self._asked
        if asked is not req:
            ids = np.asarray(req.input_ids, dtype=np.int32)  # an engine's prompt: no copy
            key = len(ids), hash(ids.tobytes())
        return key

    def _insert(self, req: Req) -> None:
        self._by_key.setdefault(self._key(req), []).append(req)

    def add(self, req: Req) -> None:
        n = len(req.input_ids)
        if n in self._hashed_lengths:
            self._insert(req)
        else:
            self._unhashed.setdefault(n, []).append(req)

    def computes(self, req: Req) -> bool:
        """Whether a request of the batch computes ``req``'s prompt (not a cache hit of it)."""
        n = len(req.input_ids)
        for m in self._unhashed.pop(n, ()):
            self._insert(m)
            self._hashed_lengths.add(n)
        if n not in self._hashed_lengths:
            return False
        key = self._key(req)
        self._asked = (req, key)  # the batch adds it next, if it fits
        same = self._by_key.get(key, ())
        return any(m.cached_len < n - 1 and np.array_equal(m.input_ids, req.input_ids)
                   for m in same)  # fmt: skip
