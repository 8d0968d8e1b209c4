"""Host time of a prefix-cache eviction under a full KV pool (issue 14), on the CPU.

Once a server has run a while, the radix tree holds every finished request's KV and the pool
is full: each new prompt's allocation evicts, and so does a decode step whenever its new
slots run out. The tree here: one shared 512-token system prompt and N cached 256-token
conversations under it, the pool exactly full. Each step: a new conversation's 256 slots
(evicting the least recently used one) and its insert. Timed per step, best of --reps
rounds of --steps steps: ``RadixCache`` (eviction pops a heap of candidates it keeps) against
an inline copy of the former eviction (a walk of the whole tree and a heap of every unlocked
leaf, per call), in the same run.
Usage: python benchmarks/radix_evict.py [--leaves 1000 4000 16000] [--steps 200] [--reps 5]"""

from __future__ import annotations

import argparse
import heapq
import time

import numpy as np
import torch

from breakgraph.cache import RadixCache, SlotAllocator

SYSTEM, TURN = 512, 256


class WalkEvict(RadixCache):
    """The former eviction: every call walks the tree for its unlocked leaves."""

    def _push_leaf(self, node) -> None:  # no candidate heap to keep
        pass

    def evict(self, num_tokens: int) -> int:
        if self.disable or num_tokens <= 0:
            return 0
        heap = [(n.last_access, n.id, n) for n in self._evictable_leaves()]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            self.allocator.free(leaf.value)
            freed += len(leaf.key)
            self._evictable_size -= len(leaf.key)
            parent = leaf.parent
            del parent.children[int(leaf.key[0])]
            leaf.parent = None
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed


def full_tree(cls: type[RadixCache], leaves: int, rng: np.random.Generator) -> RadixCache:
    alloc = SlotAllocator(SYSTEM + leaves * TURN + 1)
    tree = cls(alloc)
    system = rng.integers(0, 150_000, SYSTEM, dtype=np.int32)
    tree.system = system
    for i in range(leaves):
        step(tree, conversation(system, i, rng))
    assert alloc.available == 0
    return tree


def conversation(system: np.ndarray, i: int, rng: np.random.Generator) -> np.ndarray:
    """The system prompt and the i-th conversation's turn (first id unique: no shared ids)."""
    turn = rng.integers(0, 150_000, TURN, dtype=np.int32)
    turn[0] = i
    return np.concatenate([system, turn])


def step(tree: RadixCache, key: np.ndarray) -> None:
    """One new conversation: match, lock, allocate (evicting), insert, unlock."""
    m = tree.match_prefix(key)
    tree.lock(m.node)
    need = len(key) - m.prefix_len
    if tree.allocator.available < need:
        tree.evict(need - tree.allocator.available)
    present = tree.insert(key, torch.cat([m.slots, tree.allocator.alloc(need)]))
    assert present == m.prefix_len
    tree.unlock(m.node)


def per_step_us(cls: type[RadixCache], leaves: int, steps: int, reps: int) -> float:
    rng = np.random.default_rng(0)
    tree = full_tree(cls, leaves, rng)
    keys = [conversation(tree.system, leaves + i, rng) for i in range(steps * reps)]
    best = float("inf")
    for r in range(reps):
        t0 = time.perf_counter()
        for key in keys[r * steps : (r + 1) * steps]:
            step(tree, key)
        best = min(best, (time.perf_counter() - t0) / steps * 1e6)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--leaves", type=int, nargs="+", default=[1000, 4000, 16000])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    print(f"{'cached turns':>12} {'walk us/step':>13} {'heap us/step':>13} {'walk/heap':>10}")
    for n in args.leaves:
        walk = per_step_us(WalkEvict, n, args.steps, args.reps)
        heap = per_step_us(RadixCache, n, args.steps, args.reps)
        print(f"{n:>12} {walk:>13.1f} {heap:>13.1f} {walk / heap:>9.2f}x", flush=True)


if __name__ == "__main__":
    main()
