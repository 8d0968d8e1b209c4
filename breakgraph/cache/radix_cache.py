"""Radix prefix cache: a radix tree over token ids whose values are KV slots.

Every non-root node holds a run of tokens (``key``) and the KV slots of those tokens
(``value``, CPU int64). The tree *owns* the slots in its nodes: it frees them through
the allocator on eviction and flush. A node locked by a running request (``lock_ref``
> 0, propagated to every ancestor) is never evicted.

Lifecycle the scheduler follows for one request::

    m = cache.match_prefix(prompt)           # longest cached prefix: m.slots, m.node
    cache.lock(m.node)                       # before anything that may evict
    rest = allocator.alloc(len(prompt) - len(m.slots))   # evict() and retry if None
    slots = torch.cat([m.slots, rest]); node, owned_from = m.node, len(m.slots)
    ... prefill (possibly chunked), decode ...
    # after a prefill chunk: cache what has KV, keep the request's prefix locked
    node, slots_prefix = cache.cache_tokens(tokens_with_kv, slots[:n_kv], owned_from,
                                            node, keep_locked=True)
    slots[:n_kv] = slots_prefix; owned_from = n_kv
    req_to_token.write(row, 0, slots_prefix)  # the freed duplicates may be reused at once
    # on finish: cache and drop the lock; the request holds no slot afterwards
    cache.cache_tokens(tokens_with_kv, slots[:n_kv], owned_from, node, keep_locked=False)
    allocator.free(slots[n_kv:])             # slots allocated but never written, if any

A request that matched its whole prompt still needs one token to compute logits, so
the scheduler usually matches ``prompt[:-1]``.

The node and the match record are in ``radix_node.py``; LRU eviction (``evict``, its heap
of candidate leaves) in ``radix_eviction.py``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from breakgraph.cache.kv_pool import SlotAllocator
from breakgraph.cache.radix_eviction import LeafEviction
from breakgraph.cache.radix_node import MatchResult, TreeNode

_EMPTY = torch.empty(0, dtype=torch.int64)
_NO_KEY = np.empty(0, dtype=np.int32)


def _as_key(key: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as an int32 array (an int32 array as it is: no copy)."""
    return np.asarray(key, dtype=np.int32)


def _common_prefix_len(node_key: np.ndarray, key: np.ndarray, start: int) -> int:
    """Length of the common prefix of ``node_key`` and ``key[start:]``: one vectorized
    compare (keys run to 64K+ tokens)."""
    n = min(len(node_key), len(key) - start)
    differ = np.flatnonzero(node_key[:n] != key[start : start + n])
    return int(differ[0]) if differ.size else n


class RadixCache(LeafEviction):
    """SGLang-style prefix cache. With ``disable=True`` nothing is ever cached."""

    def __init__(self, allocator: SlotAllocator, disable: bool = False) -> None:
        super().__init__()
        self.allocator = allocator
        self.disable = disable
        self._ids = itertools.count()
        self._clock = itertools.count(1)  # LRU time: a counter, so ties are deterministic
        # the root outlives flushes: requests that matched nothing hold it as their node
        self.root = TreeNode(next(self._ids), _NO_KEY, _EMPTY, None)
        self._evictable_size = 0
        self._protected_size = 0

    # ---- sizes ---------------------------------------------------------------------------

    @property
    def evictable_size(self) -> int:
        """Tokens in unlocked nodes (all of them can be evicted)."""
        return self._evictable_size

    @property
    def protected_size(self) -> int:
        """Tokens in locked nodes."""
        return self._protected_size

    def total_size(self) -> int:
        """Tokens (= slots) the tree owns."""
        return self._evictable_size + self._protected_size

    # ---- lookup and insertion ------------------------------------------------------------

    def match_prefix(self, key: Sequence[int] | np.ndarray) -> MatchResult:
        """Longest cached prefix of ``key``; refreshes LRU time along the path.

        If the match ends inside a node, the node is split so that ``node`` ends exactly
        at the prefix. The returned slots stay owned by the tree: lock ``node`` to keep
        them from being evicted.
        """
        if self.disable or not len(key):
            return MatchResult(_EMPTY, self.root)
        key = _as_key(key)
        now = next(self._clock)
        node, i, values = self.root, 0, []
        while i < len(key):
            child = node.children.get(int(key[i]))
            if child is None:
                break
            n = _common_prefix_len(child.key, key, i)
            ends_inside = n < len(child.key)
            if ends_inside:
                child = self._split(child, n)
            child.last_access = now
            values.append(child.value)
            node, i = child, i + n
            if ends_inside:
                break
        slots = torch.cat(values) if values else _EMPTY
        return MatchResult(slots, node)

    def insert(self, key: Sequence[int] | np.ndarray, slots: torch.Tensor) -> int:
        """Cache ``key`` with KV ``slots`` (same length); return how much of it was already cached.

        Ownership: let ``r`` be the return value. The tree keeps its own slots for
        ``key[:r]`` and takes ownership of ``slots[r:]`` (the caller must no longer free
        them). ``slots[:r]`` are, wherever they differ from the tree's, duplicates: the
        caller must free those it owns. A request owns its slots from its ``cached_len``
        (the prefix it got from the tree, still locked) onward, so it frees
        ``slots[cached_len:r]``. ``cache_tokens`` does exactly this.
        With ``disable=True`` nothing is stored, 0 is returned, the caller keeps all slots.
        """
        if self.disable:
            return 0
        present, _, _ = self._insert(key, slots)
        return present

    def _insert(
        self, key: Sequence[int] | np.ndarray, slots: torch.Tensor
    ) -> tuple[int, TreeNode, list[torch.Tensor]]:
        """Insert; return (already-present length, node ending at len(key), tree's values on the path)."""
        if len(key) != slots.numel():
            raise ValueError(f"key has {len(key)} tokens but {slots.numel()} slots were given")
        key = _as_key(key)
        slots = slots.to(device="cpu", dtype=torch.int64).reshape(-1)
        now = next(self._clock)
        node, i, values = self.root, 0, []
        while i < len(key):
            child = node.children.get(int(key[i]))
            if child is None:
                # the caller's arrays may be reused (and a key may view a whole message's
                # prompt): the tree keeps its own copies
                leaf = TreeNode(next(self._ids), key[i:].copy(), slots[i:].clone(), node)
                leaf.last_access = now
                node.children[int(key[i])] = leaf
                self._evictable_size += len(leaf.key)
                self._push_leaf(leaf)
                values.append(leaf.value)
                return i, leaf, values
            n = _common_prefix_len(child.key, key, i)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            values.append(child.value)
            node, i = child, i + n
        return i, node, values

    def cache_tokens(
        self,
        key: Sequence[int] | np.ndarray,
        slots: torch.Tensor,
        owned_from: int,
        old_node: TreeNode,
        keep_locked: bool,
    ) -> tuple[TreeNode | None, torch.Tensor]:
        """Cache a request's tokens that have KV and move its lock; return (node, new_slots).

        ``slots[:owned_from]`` are tree slots the request got from a match (kept alive by
        its lock on ``old_node``); ``slots[owned_from:]`` are its own. After the call the
        request owns nothing in ``slots``: the tree took the new tokens and the request's
        duplicates in ``[owned_from, already_present)`` were freed (entries equal to the
        tree's slot are the tree's own and are left alone). ``new_slots`` are the
        tree's slots for ``key`` (the request must use these from now on, and rewrite its
        req_to_token row with them: the freed duplicates may be handed out again at once).

        ``keep_locked=True`` (after a prefill chunk): the node ending at ``len(key)`` is
        locked, ``old_node`` unlocked, and that node is returned.
        ``keep_locked=False`` (on finish): ``old_node`` is unlocked, ``None`` is returned
        and ``new_slots`` may be evicted at any time, so the request must drop them.

        With ``disable=True``: keep_locked=False frees ``slots[owned_from:]``; keep_locked=True
        returns ``(root, slots)`` unchanged (locking the root is a no-op).
        """
        if self.disable:
            if keep_locked:
                return self.root, slots
            self.allocator.free(slots[owned_from:])
            return None, slots
        present, node, values = self._insert(key, slots)
        if present < owned_from:
            raise RuntimeError(
                f"only {present} of the {owned_from} tokens the request got from the tree are "
                "cached: its prefix was not locked, or key differs from the matched tokens"
            )
        new_slots = torch.cat(values) if values else _EMPTY
        # free the request's duplicates; equal entries already are the tree's own slots
        mine = slots[owned_from:present].to(device="cpu", dtype=torch.int64)
        differs = mine != new_slots[owned_from:present]
        self.allocator.free(mine if bool(differs.all()) else mine[differs])
        if keep_locked:
            self.lock(node)  # before unlocking old_node, so the shared path never flaps
            self.unlock(old_node)
            return node, new_slots
        self.unlock(old_node)
        return None, new_slots

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Split ``child`` after ``n`` tokens; return the new upper node.

        ``child`` keeps its identity as the lower part, so locks held on it stay valid;
        the upper node inherits its lock_ref (locks on child count for all ancestors).
        """
        parent = child.parent
        upper = TreeNode(next(self._ids), child.key[:n], child.value[:n], parent)
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        upper.children[int(child.key[n])] = child
        parent.children[int(child.key[0])] = upper
        child.key = child.key[n:]
        child.value = child.value[n:]
        child.parent = upper
        return upper

    # ---- locks ---------------------------------------------------------------------------

    def lock(self, node: TreeNode) -> None:
        """Protect ``node`` and its ancestors from eviction (counted; the root is a no-op)."""
        self._check_attached(node)
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable_size -= len(node.key)
                self._protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        """Undo one ``lock(node)``."""
        self._check_attached(node)
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"unlock of {node} that is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable_size += len(node.key)
                self._protected_size -= len(node.key)
                if not node.children:
                    self._push_leaf(node)
            node = node.parent

    def _check_attached(self, node: TreeNode) -> None:
        if node is not self.root and node.parent is None:
            raise RuntimeError(f"{node} is no longer in the tree (evicted or flushed)")

    # ---- flush (``evict`` is ``LeafEviction``'s) -----------------------------------------

    def flush(self) -> bool:
        """Free every slot the tree owns and empty it; refused (False) while anything is locked."""
        if self._protected_size > 0:
            return False
        nodes = [n for n in self._nodes() if n is not self.root]
        for node in nodes:
            node.parent = None  # any node a caller still holds is now detached
        if nodes:
            self.allocator.free(torch.cat([n.value for n in nodes]))
        self.root.children = {}
        self._evictable_size = 0
        self._leaf_heap.clear()
        return True

    # ---- debugging -----------------------------------------------------------------------

    def _nodes(self) -> list[TreeNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def check_invariants(self) -> None:
        """Recompute sizes and structure from scratch and raise if they disagree (tests, debug)."""
        evictable = protected = 0
        for node in self._nodes():
            for first, child in node.children.items():
                if child.parent is not node or not len(child.key) or child.key[0] != first:
                    raise RuntimeError(f"bad edge {node} -> {child}")
                if child.lock_ref > node.lock_ref and node is not self.root:
                    raise RuntimeError(f"{child} is locked more than its parent {node}")
            if node is self.root:
                continue
            if node.value.numel() != len(node.key):
                raise RuntimeError(f"{node}: {node.value.numel()} slots for {len(node.key)} tokens")
            if node.lock_ref > 0:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        if (evictable, protected) != (self._evictable_size, self._protected_size):
            raise RuntimeError(
                f"sizes drifted: evictable {self._evictable_size} (actual {evictable}), "
                f"protected {self._protected_size} (actual {protected})"
            )
        self._check_leaf_heap(self._nodes())

    def pretty(self, max_tokens: int = 8) -> str:
        """Indented dump: one line per node with its first tokens, length, locks, access time."""
        lines = [f"root  evictable={self._evictable_size} protected={self._protected_size}"]

        def visit(node: TreeNode, depth: int) -> None:
            for child in sorted(node.children.values(), key=lambda c: int(c.key[0])):
                head = child.key[:max_tokens].tolist()
                more = "..." if len(child.key) > max_tokens else ""
                lines.append(
                    f"{'  ' * depth}{head}{more} len={len(child.key)} "
                    f"lock={child.lock_ref} t={child.last_access}"
                )
                visit(child, depth + 1)

        visit(self.root, 1)
        return "\n".join(lines)
