"""Decode: the running requests, one new token each per step, and retraction when the KV
pool cannot give every one of them a slot.

``new_token_ratio`` estimates the share of a request's remaining ``max_new_tokens`` it
will still decode: prefill admission reserves that much room for the running requests.
It decays step by step and jumps up on each retraction (SGLang's policy).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from breakgraph.engine.config import SchedulerConfig
from breakgraph.engine.request import Req, ReqStatus
from breakgraph.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from breakgraph.engine.cache_manager import CacheManager

logger = logging.getLogger(__name__)


class DecodeManager:
    def __init__(self, cache: CacheManager, cfg: SchedulerConfig, device: torch.device):
        self.cache = cache
        self.cfg = cfg
        self.device = device
        self.running: list[Req] = []  # in admission order: retraction takes the newest
        self.new_token_ratio = cfg.init_new_token_ratio
        self.num_retractions = 0

    def add(self, req: Req) -> None:
        """A request whose prefill completed starts decoding."""
        self.running.append(req)
        req.decoding = True

    def remove(self, req: Req) -> None:
        if req.decoding:
            self.running.remove(req)
            req.decoding = False

    def needs_step(self, req: Req) -> bool:
        """False for a request whose token still on the device (overlap scheduling) ends it
        by length: it waits for that token's read-back instead of decoding one more."""
        if not req.num_pending:
            return True
        return (
            req.num_generated < req.sampling.max_new_tokens
            and req.fill_len + req.num_pending < self.cfg.max_context_len
        )

    def stepping(self) -> list[Req]:
        """The running requests the next decode step feeds, in admission order."""
        return [r for r in self.running if self.needs_step(r)]

    def reserved_tokens(self, reqs: list[Req]) -> int:
        """KV room to keep for ``reqs``' future decode tokens."""
        cap = self.cfg.reserve_cap_tokens
        total = sum(min(r.sampling.max_new_tokens - len(r.output_ids), cap) for r in reqs)
        return int(total * self.new_token_ratio)

    def make_room(self, others_hold_kv: bool) -> tuple[list[Req], Req | None]:
        """Retract the newest running requests until each remaining one gets a slot.

        Returns (retracted, exhausted): the retracted requests, released and ready to be
        re-queued in this order; and a lone request that cannot grow while nothing else
        holds KV (``others_hold_kv`` False), taken out of ``running`` to be finished.
        """
        retracted: list[Req] = []
        # called with no step in flight: every running request steps
        while self.cache.available < len(self.running):
            if len(self.running) == 1 and not others_hold_kv:
                req = self.running.pop()
                logger.warning("KV pool exhausted by one request %s; finishing it", req.rid)
                return retracted, req
            retracted.append(self._retract(self.running.pop()))
        return retracted, None

    def _retract(self, req: Req) -> Req:
        """Cache the request's KV in the tree (unlocked) and send it back to waiting."""
        self.cache.release(req)
        req.decoding = False
        req.status = ReqStatus.WAITING
        req.num_retractions += 1
        self.num_retractions += 1
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.2)
        logger.info("KV pool short: retracted %s (%d tokens)", req.rid, req.fill_len)
        return req

    def schedule_batch(self, reqs: list[Req]) -> tuple[list[Req], ForwardBatch] | None:
        """One token for every running request that needs one; call ``make_room`` first.

        A token still on the device goes in as a placeholder id (``Req.next_input_id``) that
        the launch resolves from the previous step's sampled ids. ``reqs``: ``stepping()``."""
        if not reqs:
            return None
        slots = self.cache.alloc(len(reqs))
        assert slots is not None  # make_room() left room
        rows = [r.req_pool_idx for r in reqs]
        prefixes = [r.kv_len for r in reqs]
        for req, slot in zip(reqs, slots.tolist(), strict=True):
            req.append_kv_slot(slot)
        self.new_token_ratio = max(
            self.cfg.min_new_token_ratio, self.new_token_ratio - self.cfg.new_token_ratio_decay
        )
        req_pool = self.cache.req_pool
        batch = ForwardBatch.build(
            ForwardMode.DECODE,
            [r.next_input_id for r in reqs],
            slots,
            rows,
            prefixes,
            [1] * len(reqs),
            self.device,
            table_width=req_pool.max_context_len,
        )
        # the table's new column from the batch's own upload (TP ranks likewise, unlogged)
        req_pool.write_batch(batch)
        return reqs, batch
