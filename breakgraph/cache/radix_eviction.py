"""LRU eviction for ``RadixCache``: a heap of candidate leaves, so that ``evict`` pops
instead of walking the tree (under a full KV pool every allocation evicts, and a walk of a
large tree costs milliseconds of host time: 1.5 ms against 44 µs per new prompt with 4,000
cached turns on an H200's host)."""

from __future__ import annotations

import heapq

import torch

from breakgraph.cache.kv_pool import SlotAllocator
from breakgraph.cache.radix_node import TreeNode


class LeafEviction:
    """The eviction half of ``RadixCache`` (its ``root``, ``allocator``, ``disable`` and
    ``_evictable_size``): the candidate heap, ``evict`` and the heap's invariants."""

    root: TreeNode
    allocator: SlotAllocator
    disable: bool
    _evictable_size: int

    def __init__(self) -> None:
        # eviction candidates, (last_access, id, node), at most one per node: a node gets one
        # when it becomes an unlocked leaf (inserted, unlocked, or left childless by an
        # eviction) and has none. An entry may go stale (its node was touched since, gained a
        # child or got locked): ``evict`` re-keys it or drops it as it pops it.
        self._leaf_heap: list[tuple[int, int, TreeNode]] = []

    def evict(self, num_tokens: int) -> int:
        """Free least-recently-used unlocked leaves until ``num_tokens`` slots are freed.

        Whole leaves are freed, so more than asked may be; fewer only when nothing
        evictable is left. Returns the number of slots freed.
        """
        if self.disable or num_tokens <= 0:
            return 0
        heap, freed, values = self._leaf_heap, 0, []
        while freed < num_tokens and self._evictable_size > 0:
            if not heap:  # only if a candidate was missed: find them the slow way
                self._rebuild_leaf_heap()
                if not heap:
                    break
            at, _, leaf = heapq.heappop(heap)
            if leaf.children or leaf.lock_ref:
                leaf.in_heap = False  # no longer a candidate: pushed again if that ends
                continue
            if at != leaf.last_access:  # touched since: its place is further back
                heapq.heappush(heap, (leaf.last_access, leaf.id, leaf))
                continue
            leaf.in_heap = False
            values.append(leaf.value)
            freed += len(leaf.key)
            parent = self._detach_leaf(leaf)
            if parent is not None:
                self._push_leaf(parent)
        if values:  # one free for every leaf: each call costs tens of µs
            self.allocator.free(values[0] if len(values) == 1 else torch.cat(values))
        return freed

    def _detach_leaf(self, leaf: TreeNode) -> TreeNode | None:
        """Take an evicted leaf out of the tree (its slots are the caller's to free); return
        its parent if that is now an unlocked leaf itself."""
        self._evictable_size -= len(leaf.key)
        parent = leaf.parent
        del parent.children[int(leaf.key[0])]
        leaf.parent = None
        if parent is not self.root and not parent.children and parent.lock_ref == 0:
            return parent
        return None

    def _push_leaf(self, node: TreeNode) -> None:
        """``node`` became an unlocked leaf: an eviction candidate (an entry it already has
        stays, ``evict`` re-keys it)."""
        if not node.in_heap:
            node.in_heap = True
            heapq.heappush(self._leaf_heap, (node.last_access, node.id, node))

    def _rebuild_leaf_heap(self) -> None:
        for _, _, node in self._leaf_heap:
            node.in_heap = False
        self._leaf_heap.clear()
        for node in self._evictable_leaves():
            self._push_leaf(node)

    def _evictable_leaves(self) -> list[TreeNode]:
        leaves, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root and node.lock_ref == 0:
                leaves.append(node)
        return leaves

    def _check_leaf_heap(self, nodes: list[TreeNode]) -> None:
        """Raise unless the heap holds one entry per node that has its flag set, each in the
        tree (``nodes``) and no later than its node's access time (``evict`` re-keys it),
        every unlocked leaf among them."""
        entries = {node.id: (at, node) for at, _, node in self._leaf_heap}
        if len(entries) != len(self._leaf_heap):
            raise RuntimeError("a node has two eviction entries")
        for node in nodes:
            entry = entries.pop(node.id, None)
            if node.in_heap != (entry is not None):
                raise RuntimeError(f"{node}'s eviction-entry flag is {node.in_heap}")
            if entry is not None and entry[0] > node.last_access:
                raise RuntimeError(f"{node}'s eviction entry is later than its last access")
            if not node.children and node is not self.root and not node.lock_ref and not entry:
                raise RuntimeError(f"{node} is an unlocked leaf without an eviction entry")
        if entries:
            raise RuntimeError(f"eviction entries of nodes not in the tree: {list(entries)}")
