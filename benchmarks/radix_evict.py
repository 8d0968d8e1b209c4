"""Host time of a prefix-cache eviction under a full KV pool (issue 14), on the CPU.

Once a server has run a while, the radix tree holds every finished request's KV and the pool
is full: each new prompt's allocation evicts, and so does a decode step whenever its new
slots run out. The tree here: one shared 512-token system prompt and N cached --turn-token
conversations under it, the pool exactly full. Each step: a new conversation of --new
tokens after the system prompt (evicting the least recently used turns it needs room for)
and its insert. Timed per step, best of --reps rounds of --steps steps: ``RadixCache``
(eviction pops a heap of candidates it keeps, one free for all it evicts) against an inline
copy of the former eviction (a walk of the whole tree and a heap of every unlocked leaf per
call, a free per leaf), in the same run.
Usage: python benchmarks/radix_evict.py [--leaves 1000 4000 16000] [--turn 256] [--new 256 4096]
       [--steps 100] [--reps 3]"""

from __future__ import annotations

import argparse
import heapq
import time

import numpy as np
import torch

from breakgraph.cache import RadixCache, SlotAllocator

SYSTEM = 512


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
            parent = self._detach_leaf(leaf)
            if parent is not None:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed


def conversation(system: np.ndarray, i: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """The system prompt and the i-th conversation's n ids (its first id unique)."""
    turn = rng.integers(0, 150_000, n, dtype=np.int32)
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


def per_step_us(cls, leaves: int, turn: int, new: int, steps: int, reps: int) -> float:
    rng = np.random.default_rng(0)
    tree = cls(SlotAllocator(SYSTEM + leaves * turn + 1))
    system = rng.integers(0, 150_000, SYSTEM, dtype=np.int32)
    for i in range(leaves):
        step(tree, conversation(system, i, turn, rng))
    assert tree.allocator.available == 0
    keys = [conversation(system, leaves + i, new, rng) for i in range(steps * reps)]
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
    ap.add_argument("--turn", type=int, default=256, help="ids per cached conversation")
    ap.add_argument("--new", type=int, nargs="+", default=[256, 4096], help="ids per new one")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    print(
        f"{'cached':>7} {'new ids':>8} {'walk us/step':>13} {'heap us/step':>13} {'walk/heap':>10}"
    )
    for n in args.leaves:
        for new in args.new:
            steps = max(1, min(args.steps, n * args.turn // new // args.reps))  # within the tree
            walk = per_step_us(WalkEvict, n, args.turn, new, steps, args.reps)
            heap = per_step_us(RadixCache, n, args.turn, new, steps, args.reps)
            print(f"{n:>7} {new:>8} {walk:>13.1f} {heap:>13.1f} {walk / heap:>9.2f}x", flush=True)


if __name__ == "__main__":
    main()
