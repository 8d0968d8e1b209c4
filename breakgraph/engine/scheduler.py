"""Continuous batching: prefill (chunked) first, otherwise decode every running request.

KV ownership: a request's ``kv_slots[:cached_len]`` belong to the radix tree (locked
through ``last_node``), the rest to the request. When slots run short, unlocked tree
leaves are evicted; if decode still cannot proceed, the newest running request is
retracted (its KV cached in the tree, unlocked) and re-queued at the front.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from breakgraph.cache.kv_pool import SlotAllocator
from breakgraph.cache.radix_cache import RadixCache
from breakgraph.cache.req_to_token import ReqToTokenPool
from breakgraph.engine.request import Req, ReqStatus
from breakgraph.engine.sampler import sample
from breakgraph.forward_batch import ForwardBatch, ForwardMode, upload_many

logger = logging.getLogger(__name__)

_EMPTY = torch.empty(0, dtype=torch.int64)


@dataclass
class StepOutput:
    """What one step produced for one request."""

    rid: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finished: bool = False
    finish_reason: dict | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class SchedulerConfig:
    chunked_prefill_size: int
    max_running_requests: int
    max_context_len: int
    eos_token_ids: set[int]
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.001
    reserve_cap_tokens: int = 4096  # a request reserves at most this many future decode tokens
    enable_mixed_chunk: bool = False  # running requests decode inside prefill steps


class Scheduler:
    def __init__(
        self,
        forward: Callable[[ForwardBatch], torch.Tensor],
        allocator: SlotAllocator,
        req_pool: ReqToTokenPool,
        tree: RadixCache,
        config: SchedulerConfig,
        device: torch.device,
        stop_text: Callable[[list[int]], str] | None = None,
    ):
        self.forward = forward
        self.allocator = allocator
        self.req_pool = req_pool
        self.tree = tree
        self.cfg = config
        self.device = device
        self.stop_text = stop_text  # decodes ids to text for stop strings (None: no tokenizer)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self.reqs: dict[str, Req] = {}
        self.new_token_ratio = config.init_new_token_ratio
        self.num_retractions = 0
        self.last_step_tokens = 0

    # ---- queue management ----
    def add(self, req: Req) -> None:
        if req.rid in self.reqs:
            raise ValueError(f"request id {req.rid!r} is already in use")
        self.reqs[req.rid] = req
        self.waiting.append(req)

    def abort(self, rid: str) -> StepOutput | None:
        """Abort a request wherever it is; its KV slots are freed at once."""
        req = self.reqs.get(rid)
        if req is None:
            return None
        if req.status is ReqStatus.WAITING and req in self.waiting:
            self.waiting.remove(req)
        if req is self.chunked:
            self.chunked = None
        if req in self.running:
            self.running.remove(req)
        return self._finish(req, {"type": "abort", "message": "aborted"})

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked)

    def kv_tokens_used(self) -> int:
        """Slots held by requests or locked in the tree (evictable tree slots count as free)."""
        return self.allocator.capacity - self.allocator.available - self.tree.evictable_size

    # ---- one step ----
    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """Schedule, launch (no host sync until here), then read the sampled ids back."""
        outputs: list[StepOutput] = []
        scheduled = self.schedule(outputs)
        if scheduled is None:
            self.last_step_tokens = 0
            return outputs
        reqs, batch = scheduled
        self.last_step_tokens = batch.num_tokens
        done, ids, logprobs = self.launch(reqs, batch)
        if not done:
            return outputs
        ids_list = ids.tolist()  # the step's one host sync
        lp_list = logprobs.tolist() if logprobs is not None else [None] * len(done)
        for req, tok, lp in zip(done, ids_list, lp_list, strict=True):
            outputs.append(self._append_token(req, tok, lp))
        return outputs

    def schedule(self, outputs: list[StepOutput]) -> tuple[list[Req], ForwardBatch] | None:
        """Pick the next batch (prefill first, else decode) and upload its metadata."""
        reqs, batch = self._schedule_prefill(outputs)
        if batch is None:
            reqs, batch = self._schedule_decode(outputs)
        return None if batch is None else (reqs, batch)

    def launch(self, reqs: list[Req], batch: ForwardBatch):
        """Forward and sample on the device; returns (requests sampled, ids, logprobs)."""
        logits = self.forward(batch)
        done = [r for r in reqs if r is not self.chunked]
        if not done:
            return done, None, None
        if len(done) != len(reqs):
            rows = [i for i, r in enumerate(reqs) if r is not self.chunked]
            logits = logits[upload_many([rows], torch.int64, logits.device)[0]]
        want_logprob = any(r.return_logprob for r in done)
        ids, logprobs = sample(
            logits, [r.sampling for r in done], [r.generator for r in done], want_logprob
        )
        return done, ids, logprobs

    def _append_token(self, req: Req, tok: int, lp: float | None) -> StepOutput:
        req.output_ids.append(tok)
        if lp is not None:
            req.output_logprobs.append(lp)
        out = StepOutput(rid=req.rid, token_ids=[tok], logprobs=[] if lp is None else [lp])
        reason = self._check_finish(req, tok)
        if reason is not None:
            if req.decoding:
                self.running.remove(req)
            fin = self._finish(req, reason)
            fin.token_ids, fin.logprobs = out.token_ids, out.logprobs
            return fin
        if not req.decoding:  # its prefill just completed
            self.running.append(req)
            req.decoding = True
        self._fill_meta(out, req)
        return out

    def _check_finish(self, req: Req, tok: int) -> dict | None:
        sp = req.sampling
        if tok in sp.stop_token_ids or (not sp.ignore_eos and tok in self.cfg.eos_token_ids):
            return {"type": "stop", "matched": tok}
        if len(req.output_ids) >= sp.max_new_tokens:
            return {"type": "length", "length": sp.max_new_tokens}
        if req.fill_len >= self.cfg.max_context_len:
            return {"type": "length", "length": len(req.output_ids)}
        if sp.stop and self.stop_text is not None:
            longest = max(len(s) for s in sp.stop)
            tail = self.stop_text(req.output_ids[-(longest + 8) :])
            for s in sp.stop:
                if s in tail:
                    return {"type": "stop", "matched": s}
        return None

    def _fill_meta(self, out: StepOutput, req: Req) -> StepOutput:
        out.prompt_tokens = len(req.input_ids)
        out.completion_tokens = len(req.output_ids)
        out.cached_tokens = req.prefix_hit_tokens
        return out

    def _finish(self, req: Req, reason: dict) -> StepOutput:
        self._release(req)
        req.decoding = False
        req.status = ReqStatus.FINISHED
        req.finish_reason = reason
        self.reqs.pop(req.rid, None)
        return self._fill_meta(StepOutput(rid=req.rid, finished=True, finish_reason=reason), req)

    def _release(self, req: Req) -> None:
        """Hand the request's KV to the tree (unlocked) and free its table row."""
        if req.req_pool_idx is None:
            return
        n = req.kv_len
        self.tree.cache_tokens(
            req.fill_ids[:n], req.kv_slots, req.cached_len, req.last_node, keep_locked=False
        )
        self.req_pool.free(req.req_pool_idx)
        req.req_pool_idx, req.cached_len, req.last_node = None, 0, None
        req.set_kv(_EMPTY)

    # ---- memory ----
    def _available(self) -> int:
        return self.allocator.available + self.tree.evictable_size

    def _alloc(self, n: int) -> torch.Tensor | None:
        if self.allocator.available < n:
            self.tree.evict(n - self.allocator.available)
        return self.allocator.alloc(n)

    def _reserved_decode_tokens(self, reqs: list[Req]) -> int:
        cap = self.cfg.reserve_cap_tokens
        total = sum(min(r.sampling.max_new_tokens - len(r.output_ids), cap) for r in reqs)
        return int(total * self.new_token_ratio)

    def _write_table(self, rows: list[int], cols: list[int], slots: torch.Tensor) -> None:
        """req_to_token[rows, cols] = slots, in one upload and one kernel."""
        r, c = upload_many([rows, cols], torch.int64, self.device)
        vals = slots.to(torch.int32)
        if self.device.type == "cuda":
            vals = vals.pin_memory()
        self.req_pool.table.index_put_((r, c), vals.to(self.device, non_blocking=True))

    # ---- prefill ----
    def _admit(self, req: Req) -> bool:
        """Give a waiting request a table row and its cached prefix."""
        idx = self.req_pool.alloc()
        if idx is None:
            return False
        req.req_pool_idx = idx
        fill = req.fill_ids
        m = self.tree.match_prefix(fill[:-1])
        self.tree.lock(m.node)
        req.last_node, req.cached_len = m.node, m.prefix_len
        req.set_kv(m.slots)
        if req.num_retractions == 0:
            req.prefix_hit_tokens = m.prefix_len
        if m.prefix_len:
            self._write_table([idx] * m.prefix_len, list(range(m.prefix_len)), m.slots)
        return True

    def _unadmit(self, req: Req) -> None:
        self.tree.unlock(req.last_node)
        self.req_pool.free(req.req_pool_idx)
        req.req_pool_idx, req.cached_len, req.last_node = None, 0, None
        req.set_kv(_EMPTY)

    def _prefill_candidates(self, chunked: Req | None):
        """The chunked request, then the head of the queue, one at a time: each waiting
        candidate is either taken off the queue's head by the loop or ends it (O(admitted))."""
        if chunked is not None:
            yield chunked
        while self.waiting:
            yield self.waiting[0]

    def _schedule_prefill(self, outputs: list[StepOutput]):
        mixed = self.cfg.enable_mixed_chunk and bool(self.running)
        # a mixed step keeps one row per running request inside the chunk (and its bucket)
        budget = self.cfg.chunked_prefill_size - (len(self.running) if mixed else 0)
        reqs: list[Req] = []
        extends: list[int] = []
        prefixes: list[int] = []
        new_slots: list[torch.Tensor] = []
        candidates = self._prefill_candidates(self.chunked)
        self.chunked = None
        reserve = self._reserved_decode_tokens(self.running)
        for req in candidates:
            if budget <= 0:
                break
            if req.status is ReqStatus.WAITING:
                if len(self.running) + len(reqs) >= self.cfg.max_running_requests:
                    break
                if req.sampling.max_new_tokens == 0:
                    self.waiting.popleft()
                    outputs.append(self._finish(req, {"type": "length", "length": 0}))
                    continue
                if not self._admit(req):
                    break
            remaining = req.fill_len - req.kv_len
            extend = min(remaining, budget)
            available = self._available()
            # a new request leaves room for the running ones' future decode tokens, unless
            # nothing else is in flight (then it must make progress, in chunks if need be)
            limit = available - (reserve if req.status is ReqStatus.WAITING else 0)
            if extend > limit:
                extend = max(0, limit) if (reqs or self.running) else min(extend, available)
            slots = self._alloc(extend) if extend > 0 else None
            if slots is None:
                if req.status is ReqStatus.WAITING:
                    self._unadmit(req)
                else:  # a chunked request that cannot continue now stays chunked
                    self.chunked = req
                break
            if req.status is ReqStatus.WAITING:
                self.waiting.popleft()
                req.status = ReqStatus.RUNNING  # in flight; joins `running` after its last chunk
                reserve += self._reserved_decode_tokens([req])
            reqs.append(req)
            extends.append(extend)
            prefixes.append(req.kv_len)
            new_slots.append(slots)
            budget -= extend
            if extend < remaining:  # this request continues next step: it is the chunked one
                break
        if not reqs:
            return [], None
        prefill_reqs = list(reqs)
        if mixed and self._available() >= len(self.running):
            slots = self._alloc(len(self.running))
            for req, slot in zip(self.running, slots.split(1), strict=True):
                reqs.append(req)
                extends.append(1)
                prefixes.append(req.kv_len)
                new_slots.append(slot)

        input_ids: list[int] = []
        rows: list[int] = []
        cols: list[int] = []
        for req, ext, pre, slots in zip(reqs, extends, prefixes, new_slots, strict=True):
            input_ids.extend(req.fill_ids[pre : pre + ext])
            rows.extend([req.req_pool_idx] * ext)
            cols.extend(range(pre, pre + ext))
            req.append_kv(slots)
            if req.kv_len < req.fill_len:
                self.chunked = req
        all_slots = torch.cat(new_slots)
        self._write_table(rows, cols, all_slots)
        batch = ForwardBatch.build(
            ForwardMode.EXTEND,
            input_ids,
            all_slots.tolist(),
            [r.req_pool_idx for r in reqs],
            prefixes,
            extends,
            self.device,
        )
        self._cache_prefill(prefill_reqs)
        return reqs, batch

    def _cache_prefill(self, reqs: list[Req]) -> None:
        """Insert what each request's prefill computed so concurrent requests can reuse it.

        Done right after scheduling: the KV is written by this step's forward before any
        later step reads it.
        """
        if self.tree.disable:
            return
        for req in reqs:
            n = req.kv_len
            owned_from = req.cached_len
            node, slots = self.tree.cache_tokens(
                req.fill_ids[:n], req.kv_slots, owned_from, req.last_node, keep_locked=True
            )
            changed = (slots[owned_from:n] != req.kv_slots[owned_from:n]).nonzero().flatten()
            if changed.numel():
                cols = (changed + owned_from).tolist()
                self._write_table([req.req_pool_idx] * len(cols), cols, slots[cols])
            req.set_kv(slots)
            req.cached_len, req.last_node = n, node

    # ---- decode ----
    def _schedule_decode(self, outputs: list[StepOutput]):
        if not self.running:
            return [], None
        while self._available() < len(self.running):
            if len(self.running) == 1 and self.chunked is None:
                # one request that cannot grow: nothing else holds KV, so finish it
                req = self.running.pop()
                logger.warning("KV pool exhausted by one request %s; finishing it", req.rid)
                outputs.append(self._finish(req, {"type": "length", "length": len(req.output_ids)}))
                return [], None
            self._retract(self.running.pop())
        if not self.running:
            return [], None
        reqs = list(self.running)
        slots = self._alloc(len(reqs))
        assert slots is not None  # _available() covered it
        prefixes = [r.kv_len for r in reqs]
        self._write_table([r.req_pool_idx for r in reqs], prefixes, slots)
        for req, slot in zip(reqs, slots.split(1), strict=True):
            req.append_kv(slot)
        self.new_token_ratio = max(
            self.cfg.min_new_token_ratio, self.new_token_ratio - self.cfg.new_token_ratio_decay
        )
        batch = ForwardBatch.build(
            ForwardMode.DECODE,
            [r.output_ids[-1] for r in reqs],
            slots.tolist(),
            [r.req_pool_idx for r in reqs],
            prefixes,
            [1] * len(reqs),
            self.device,
        )
        return reqs, batch

    def _retract(self, req: Req) -> None:
        self._release(req)
        req.decoding = False
        req.status = ReqStatus.WAITING
        req.num_retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(req)
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.2)
        logger.info("KV pool short: retracted %s (%d tokens)", req.rid, len(req.fill_ids))
