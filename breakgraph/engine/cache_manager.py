"""KV ownership for the scheduler: slots (allocator), cached prefixes (radix tree) and
request table rows (req_to_token), behind one small interface.

A request's ``kv_slots[:cached_len]`` belong to the radix tree (locked through
``last_node``), the rest to the request. Slots in unlocked tree nodes count as available:
``alloc`` evicts them when the free list runs short.

A model whose layers carry per-request state besides KV (DeepSeek V4's compressors pool
windows of tokens) resumes a cached prefix only where that state can be rebuilt: at a
multiple of ``prefix_align`` tokens (no window open), and with its last
``prefix_recompute`` tokens computed again (``Req.recompute``; their KV is not stored).
The cost: a hit gives up to ``prefix_align - 1`` cached tokens, and computes
``prefix_recompute`` more.
"""

from __future__ import annotations

import torch

from breakgraph.cache.kv_pool import SlotAllocator
from breakgraph.cache.radix_cache import RadixCache
from breakgraph.cache.req_to_token import ReqToTokenPool
from breakgraph.engine.request import Req
from breakgraph.forward_batch import IntSeq

_EMPTY = torch.empty(0, dtype=torch.int64)


class CacheManager:
    def __init__(
        self,
        allocator: SlotAllocator,
        tree: RadixCache,
        req_pool: ReqToTokenPool,
        prefix_align: int = 1,
        prefix_recompute: int = 0,
    ):
        self.allocator = allocator
        self.tree = tree
        self.req_pool = req_pool
        self.prefix_align = prefix_align
        self.prefix_recompute = prefix_recompute

    # ---- sizes ----
    @property
    def available(self) -> int:
        """Slots an allocation can get: free ones plus evictable tree ones."""
        return self.allocator.available + self.tree.evictable_size

    @property
    def kv_tokens_total(self) -> int:
        return self.allocator.capacity

    @property
    def kv_tokens_cached(self) -> int:
        """Slots held only by the tree (evictable)."""
        return self.tree.evictable_size

    @property
    def kv_tokens_used(self) -> int:
        """Slots held by requests or locked in the tree (evictable tree slots count as free)."""
        return self.allocator.capacity - self.allocator.available - self.tree.evictable_size

    # ---- slots ----
    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` slots, evicting unlocked tree leaves first if need be; None if too few."""
        if self.allocator.available < n:
            self.tree.evict(n - self.allocator.available)
        return self.allocator.alloc(n)

    def write_table(self, rows: IntSeq, cols: IntSeq, slots: torch.Tensor) -> None:
        """``req_to_token[rows, cols] = slots``, in one upload and one kernel."""
        self.req_pool.write_many(rows, cols, slots)

    # ---- a request's lifetime ----
    def admit(self, req: Req) -> bool:
        """Give a waiting request a table row and its cached prefix (locked); False if no row."""
        idx = self.req_pool.alloc()
        if idx is None:
            return False
        req.req_pool_idx = idx
        req.draft_hole = req.mtp_pos = -1  # a drafter's per-request marks, of an old row
        # match all but the last token: the forward needs at least one to compute logits;
        # a request wanting prompt logprobs recomputes from its first logprob row
        limit = req.fill_len - 1
        if req.prompt_rows_from is not None:
            limit = min(limit, req.prompt_rows_from)
        m = self.tree.match_prefix(req.fill_prefix(limit))
        if self.prefix_align > 1 or self.prefix_recompute:
            n = m.prefix_len // self.prefix_align * self.prefix_align
            # prompt logprob rows are counted from the cached prefix: none recomputed
            if self.prefix_recompute and req.prompt_rows_from is not None:
                n = 0
            if n != m.prefix_len:
                m = self.tree.match_prefix(req.fill_prefix(n))  # splits the node at n
        req.recompute = min(self.prefix_recompute, m.prefix_len)
        self.tree.lock(m.node)
        req.last_node, req.cached_len = m.node, m.prefix_len
        req.set_kv(m.slots)
        if req.num_retractions == 0:
            req.prefix_hit_tokens = m.prefix_len
        if m.prefix_len:
            self.req_pool.write(idx, 0, m.slots)
        return True

    def unadmit(self, req: Req) -> None:
        """Undo ``admit`` for a request that got no slots after all."""
        self.tree.unlock(req.last_node)
        self._drop(req)

    def cache_prefill(self, reqs: list[Req]) -> None:
        """Insert what each request's prefill computed so concurrent requests can reuse it.

        Done right after the step is launched: the KV is written by this step's forward
        before any later step reads it. Where the tree already held a token, the request
        switches to the tree's slot (its own was freed; this step's forward still writes
        and reads it, and only a later step can reuse it), so its table row is rewritten
        there, in stream order after this step.
        """
        if self.tree.disable:
            return
        for req in reqs:
            n = req.kv_len
            owned_from = req.cached_len
            node, slots = self.tree.cache_tokens(
                req.fill_prefix(n), req.kv_slots, owned_from, req.last_node, keep_locked=True
            )
            changed = (slots[owned_from:n] != req.kv_slots[owned_from:n]).nonzero().flatten()
            if changed.numel():
                cols = (changed + owned_from).tolist()
                self.write_table([req.req_pool_idx] * len(cols), cols, slots[cols])
            req.set_kv(slots)
            req.cached_len, req.last_node = n, node

    def release(self, req: Req) -> None:
        """Hand the request's KV to the tree (unlocked) and free its table row.

        The tree takes the KV of the tokens before the last output (the last one's KV is
        never computed without overlap scheduling); KV written past it (by a step that ran
        while the request's end was still on the device) is freed, never cached."""
        if req.req_pool_idx is None:
            return
        n = min(req.kv_len, req.fill_len - (1 if req.output_ids else 0))
        slots = req.kv_slots
        if n < req.kv_len:
            self.allocator.free(slots[n:].clone())
        self.tree.cache_tokens(
            req.fill_prefix(n), slots[:n], req.cached_len, req.last_node, keep_locked=False
        )
        self._drop(req)

    def _drop(self, req: Req) -> None:
        self.req_pool.free(req.req_pool_idx)
        req.req_pool_idx, req.cached_len, req.last_node = None, 0, None
        req.set_kv(_EMPTY)
