"""Radix prefix cache: matches, ownership on insert, locks, LRU eviction, no slot leak."""

import heapq
import random
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from breakgraph.cache import RadixCache, SlotAllocator


def _cache(num_slots: int = 64, disable: bool = False) -> tuple[SlotAllocator, RadixCache]:
    alloc = SlotAllocator(num_slots, debug=True)
    return alloc, RadixCache(alloc, disable=disable)


def _insert_fresh(alloc: SlotAllocator, cache: RadixCache, key: list[int]) -> torch.Tensor:
    """Insert ``key`` with freshly allocated slots, freeing the duplicates; return the slots."""
    slots = alloc.alloc(len(key))
    present = cache.insert(key, slots)
    alloc.free(slots[:present])
    return slots


def _nodes(cache: RadixCache) -> list:
    out, stack = [], list(cache.root.children.values())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


def _lru_victims(cache: RadixCache, n: int) -> set[int]:
    """The ids of the nodes ``evict(n)`` frees, found the slow way: every unlocked leaf in
    a heap by (last access, id), a parent joining it once its last child is popped."""
    left = {id(node): len(node.children) for node in _nodes(cache)}
    heap = [(x.last_access, x.id, x) for x in _nodes(cache) if not x.children and not x.lock_ref]
    heapq.heapify(heap)
    victims, freed = set(), 0
    while freed < n and heap:
        _, _, leaf = heapq.heappop(heap)
        victims.add(leaf.id)
        freed += len(leaf.key)
        parent = leaf.parent
        if parent is not cache.root:
            left[id(parent)] -= 1
            if not left[id(parent)] and not parent.lock_ref:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
    return victims


def _contents(cache: RadixCache) -> dict[tuple[int, ...], int]:
    """Every cached prefix and the slot of its last token."""
    out, stack = {}, [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            p = prefix
            for tok, slot in zip(child.key.tolist(), child.value.tolist(), strict=True):
                p = (*p, tok)
                out[p] = slot
            stack.append((child, p))
    return out


def test_match_on_empty_tree():
    _, cache = _cache()
    for key in ([], [1, 2, 3]):
        m = cache.match_prefix(key)
        assert m.slots.numel() == 0 and m.slots.dtype == torch.int64
        assert m.node is cache.root


def test_insert_then_match_full_and_partial():
    alloc, cache = _cache()
    slots = alloc.alloc(5)
    assert cache.insert([1, 2, 3, 4, 5], slots) == 0
    assert cache.total_size() == 5 == cache.evictable_size
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).slots.tolist() == slots.tolist()

    m = cache.match_prefix([1, 2, 3, 9])  # ends inside the node: split
    assert m.slots.tolist() == slots[:3].tolist()
    assert m.node.key.tolist() == [1, 2, 3] and m.node.parent is cache.root
    assert cache.match_prefix([1, 2, 3, 4, 5]).slots.tolist() == slots.tolist()
    assert cache.match_prefix([2]).slots.numel() == 0
    assert cache.total_size() == 5
    expected = slots.tolist()
    slots.zero_()  # the caller may reuse its array: the tree holds its own copy
    assert cache.match_prefix([1, 2, 3, 4, 5]).slots.tolist() == expected
    cache.check_invariants()


def test_overlapping_insert_keeps_original_slots():
    alloc, cache = _cache()
    a = alloc.alloc(4)
    cache.insert([1, 2, 3, 4], a)
    b = alloc.alloc(5)
    assert cache.insert([1, 2, 3, 7, 8], b) == 3
    alloc.free(b[:3])  # the caller owned all of b: [0, 3) were duplicates
    assert cache.match_prefix([1, 2, 3, 7, 8]).slots.tolist() == a[:3].tolist() + b[3:].tolist()
    assert cache.match_prefix([1, 2, 3, 4]).slots.tolist() == a.tolist()
    _insert_fresh(alloc, cache, [1, 2])  # wholly present: returns 2, the caller frees both
    assert cache.total_size() == 6
    alloc.check_no_leak(6)
    cache.check_invariants()


def test_lock_protects_from_eviction():
    alloc, cache = _cache()
    _insert_fresh(alloc, cache, [1, 2, 3])
    m = cache.match_prefix([1, 2, 3])
    cache.lock(m.node)
    assert cache.protected_size == 3 and cache.evictable_size == 0
    assert cache.evict(100) == 0
    assert cache.match_prefix([1, 2, 3]).prefix_len == 3
    cache.unlock(m.node)
    assert cache.evict(100) == 3
    assert cache.total_size() == 0 and alloc.available == alloc.capacity


def test_a_hot_prefix_keeps_one_eviction_entry():
    """Requests that match, lock and release the same cached prompt over and over leave its
    node one entry in the eviction heap (no growth with the traffic), and it is still
    evicted, least recently used first."""
    alloc, cache = _cache()
    _insert_fresh(alloc, cache, [1, 2, 3])
    _insert_fresh(alloc, cache, [7, 8])
    for _ in range(1000):
        m = cache.match_prefix([1, 2, 3])
        cache.lock(m.node)
        cache.unlock(m.node)
    assert len(cache._leaf_heap) == 2
    cache.check_invariants()
    assert cache.evict(1) == 2  # [7, 8]: [1, 2, 3] was touched since
    assert cache.evict(1) == 3 and cache.total_size() == 0
    cache.check_invariants()


def test_lock_survives_split():
    alloc, cache = _cache()
    _insert_fresh(alloc, cache, [1, 2, 3, 4, 5])
    node = cache.match_prefix([1, 2, 3, 4, 5]).node
    cache.lock(node)
    cache.match_prefix([1, 2, 9])  # splits the locked node
    assert cache.protected_size == 5
    assert cache.evict(100) == 0
    cache.unlock(node)
    assert cache.protected_size == 0 and cache.evictable_size == 5
    cache.check_invariants()


def test_eviction_is_least_recently_used_first():
    alloc, cache = _cache()
    for key in ([1, 1], [2, 2], [3, 3]):
        _insert_fresh(alloc, cache, key)
    cache.match_prefix([1, 1])  # [2, 2] is now the oldest
    assert cache.evict(1) == 2
    assert cache.match_prefix([2, 2]).prefix_len == 0
    assert cache.match_prefix([3, 3]).prefix_len == 2
    assert cache.evict(1) == 2
    assert cache.match_prefix([1, 1]).prefix_len == 0  # refreshed after [3, 3]'s match


def test_parent_of_evicted_leaves_becomes_evictable():
    alloc, cache = _cache()
    _insert_fresh(alloc, cache, [1, 2, 3])
    _insert_fresh(alloc, cache, [1, 2, 4])
    held = cache.match_prefix([1, 2, 4]).node
    cache.lock(held)
    assert cache.evict(100) == 1  # only [3]; [1, 2] is locked through [4]
    cache.unlock(held)
    assert cache.evict(3) == 3  # [4] then its parent [1, 2], now a leaf
    assert cache.total_size() == 0 and alloc.available == alloc.capacity


def test_flush_refused_while_locked():
    alloc, cache = _cache()
    _insert_fresh(alloc, cache, [1, 2, 3])
    _insert_fresh(alloc, cache, [4, 5])
    node = cache.match_prefix([4, 5]).node
    cache.lock(node)
    assert not cache.flush()
    assert cache.total_size() == 5
    cache.unlock(node)
    assert cache.flush()
    assert cache.total_size() == 0 and alloc.available == alloc.capacity
    assert cache.match_prefix([1, 2, 3]).prefix_len == 0
    with pytest.raises(RuntimeError):
        cache.lock(node)  # detached by the flush


def test_cache_tokens_request_lifecycle():
    alloc, cache = _cache()
    prompt = [1, 2, 3, 4]
    # request A: miss, prefill in two chunks, finish
    m = cache.match_prefix(prompt)
    cache.lock(m.node)
    slots = alloc.alloc(len(prompt) + 2)  # prompt + two decoded tokens
    node, new = cache.cache_tokens(prompt[:2], slots[:2], 0, m.node, keep_locked=True)
    assert new.tolist() == slots[:2].tolist() and cache.protected_size == 2
    node, new = cache.cache_tokens(prompt, slots[:4], 2, node, keep_locked=True)
    assert cache.protected_size == 4
    tokens = prompt + [7, 8, 9]  # the last token has no KV
    node, new = cache.cache_tokens(tokens[:6], slots, 4, node, keep_locked=False)
    assert node is None and new.tolist() == slots.tolist()
    assert cache.protected_size == 0 and cache.total_size() == 6
    alloc.check_no_leak(6)

    # requests B and C share the prompt; C misses and allocates its own copy of it
    mb = cache.match_prefix(prompt)
    assert mb.slots.tolist() == slots[:4].tolist()
    cache.lock(mb.node)
    b = torch.cat([mb.slots, alloc.alloc(1)])
    c = alloc.alloc(5)
    cache.lock(cache.root)  # a miss locks the root: a no-op
    _, new_b = cache.cache_tokens(prompt + [5], b, 4, mb.node, keep_locked=False)
    _, new_c = cache.cache_tokens(prompt + [5], c, 0, cache.root, keep_locked=False)
    assert new_c.tolist() == new_b.tolist() == slots[:4].tolist() + b[4:].tolist()
    assert cache.protected_size == 0
    alloc.check_no_leak(cache.total_size())  # C's duplicates were freed
    cache.check_invariants()


def test_cache_tokens_never_frees_the_trees_own_slots():
    alloc, cache = _cache()
    tree_slots = _insert_fresh(alloc, cache, [1, 2, 3])
    m = cache.match_prefix([1, 2, 3])
    cache.lock(m.node)
    slots = torch.cat([m.slots, alloc.alloc(2)])
    # owned_from=0 understates the tree's part: entries equal to the tree's are left alone
    cache.cache_tokens([1, 2, 3, 4, 5], slots, 0, m.node, keep_locked=False)
    assert cache.match_prefix([1, 2, 3, 4, 5]).slots.tolist() == slots.tolist()
    assert slots[:3].tolist() == tree_slots.tolist()
    alloc.check_no_leak(5)


def test_cache_tokens_rejects_unlocked_prefix():
    alloc, cache = _cache()
    slots = _insert_fresh(alloc, cache, [1, 2, 3])
    m = cache.match_prefix([1, 2, 3])
    cache.lock(m.node)
    cache.unlock(m.node)
    cache.evict(100)
    with pytest.raises(RuntimeError):
        cache.cache_tokens([1, 2, 3], slots, 3, cache.root, keep_locked=False)


def test_disabled_cache():
    alloc, cache = _cache(disable=True)
    slots = alloc.alloc(4)
    assert cache.insert([1, 2, 3, 4], slots) == 0
    m = cache.match_prefix([1, 2, 3, 4])
    assert m.prefix_len == 0 and m.node is cache.root
    cache.lock(m.node)
    node, same = cache.cache_tokens([1, 2], slots[:2], 0, m.node, keep_locked=True)
    assert node is cache.root and same.tolist() == slots[:2].tolist()
    assert alloc.available == alloc.capacity - 4
    cache.cache_tokens([1, 2, 3, 4], slots, 0, node, keep_locked=False)
    assert alloc.available == alloc.capacity
    assert cache.total_size() == 0 and cache.evict(10) == 0 and cache.flush()


@dataclass(eq=False)
class _Req:
    key: list[int]
    slots: torch.Tensor  # slots[:owned_from] belong to the tree, the rest to the request
    owned_from: int
    node: object


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_match_model_and_never_leak(seed):
    """500 random ops against a model: a dict prefix -> slot and lock counts per prefix."""
    rng = random.Random(seed)
    alloc, cache = _cache(num_slots=48)
    model: dict[tuple[int, ...], int] = {}
    locks: Counter[tuple[int, ...]] = Counter()
    reqs: list[_Req] = []

    def rand_key() -> list[int]:
        return [rng.randrange(3) for _ in range(rng.randint(1, 9))]

    def predicted_match(key: list[int]) -> list[int]:
        out = []
        for i in range(1, len(key) + 1):
            if tuple(key[:i]) not in model:
                break
            out.append(model[tuple(key[:i])])
        return out

    def lock_prefix(key: list[int], n: int, delta: int) -> None:
        for i in range(1, n + 1):
            locks[tuple(key[:i])] += delta

    def model_insert(key: list[int], slots: torch.Tensor) -> int:
        present = len(predicted_match(key))
        for i in range(present, len(key)):
            model[tuple(key[: i + 1])] = int(slots[i])
        return present

    def check_evict(n: int) -> None:
        before = dict(model)
        expected_victims, nodes = _lru_victims(cache, n), _nodes(cache)
        freed = cache.evict(n)
        # the same nodes as a walk of the whole tree finds (evict pops a heap it keeps)
        assert {x.id for x in nodes if x.parent is None} == expected_victims
        after = _contents(cache)
        removed = set(before) - set(after)
        assert all(after[p] == before[p] for p in after), "eviction changed surviving slots"
        assert all(locks[p] == 0 for p in removed), "a locked prefix was evicted"
        assert freed == len(removed)
        assert freed >= n or cache.evictable_size == 0
        model.clear()
        model.update(after)

    def alloc_or_evict(n: int) -> torch.Tensor | None:
        slots = alloc.alloc(n)
        if slots is None:
            check_evict(n - alloc.available)
            slots = alloc.alloc(n)
        return slots

    for _ in range(500):
        op = rng.choice(["admit", "admit", "chunk", "finish", "finish", "insert", "match", "evict"])
        if rng.random() < 0.01:
            op = "flush"

        if op == "admit" and len(reqs) < 4:
            key = rand_key()
            m = cache.match_prefix(key)
            assert m.slots.tolist() == predicted_match(key)
            cache.lock(m.node)
            lock_prefix(key, m.prefix_len, +1)
            rest = alloc_or_evict(len(key) - m.prefix_len)
            if rest is None:
                cache.unlock(m.node)
                lock_prefix(key, m.prefix_len, -1)
            else:
                reqs.append(_Req(key, torch.cat([m.slots, rest]), m.prefix_len, m.node))
        elif op in ("chunk", "finish") and reqs:
            req = reqs[rng.randrange(len(reqs))]
            n = rng.randint(req.owned_from, len(req.key))
            key = req.key[:n]
            expected_present = model_insert(key, req.slots[:n])
            expected_slots = predicted_match(key)
            keep = op == "chunk"
            node, new = cache.cache_tokens(key, req.slots[:n], req.owned_from, req.node, keep)
            assert new.tolist() == expected_slots
            assert expected_present >= req.owned_from
            if keep:
                lock_prefix(key, n, +1)
            lock_prefix(req.key, req.owned_from, -1)
            if keep:
                req.slots[:n] = new
                req.owned_from, req.node = n, node
            else:
                alloc.free(req.slots[n:])
                reqs.remove(req)
        elif op == "insert":
            key = rand_key()
            slots = alloc_or_evict(len(key))
            if slots is not None:
                expected = model_insert(key, slots)
                assert cache.insert(key, slots) == expected
                alloc.free(slots[:expected])
        elif op == "match":
            key = rand_key()
            assert cache.match_prefix(key).slots.tolist() == predicted_match(key)
        elif op == "evict":
            check_evict(rng.randint(0, 12))
        elif op == "flush":
            nothing_locked = all(c == 0 for c in locks.values())
            assert cache.flush() == nothing_locked
            if nothing_locked:
                model.clear()

        cache.check_invariants()
        assert _contents(cache) == model
        protected = sum(1 for p in model if locks[p] > 0)
        assert cache.protected_size == protected
        assert cache.evictable_size == len(model) - protected
        assert cache.evictable_size + cache.protected_size == cache.total_size() == len(model)
        held = sum(r.slots.numel() - r.owned_from for r in reqs)
        assert alloc.available + cache.total_size() + held == alloc.capacity
        alloc.check_no_leak(cache.total_size() + held)
        owned = list(model.values()) + [s for r in reqs for s in r.slots[r.owned_from :].tolist()]
        assert 0 not in owned and len(set(owned)) == len(owned)

    for req in reqs:
        cache.unlock(req.node)
        alloc.free(req.slots[req.owned_from :])
    assert cache.flush()
    alloc.check_no_leak(0)


# ---- long keys (64K-token prompts): the common prefix is found by comparing slices ----
LONG = 65_536


@pytest.mark.parametrize(
    "diverge_at", [0, 1, 63, 64, 65, 1000, LONG // 2, LONG - 2, LONG - 1, None]
)
def test_long_key_divergence_at_any_offset(diverge_at):
    """A 64K key and a copy that differs at one position: the match stops exactly there, and
    inserting the copy shares exactly that prefix."""
    rng = random.Random(diverge_at)
    alloc, cache = _cache(num_slots=2 * LONG + 1)
    key = [rng.randrange(50_000) for _ in range(LONG)]
    other = list(key)
    if diverge_at is not None:
        other[diverge_at] += 1
    shared = LONG if diverge_at is None else diverge_at
    slots = _insert_fresh(alloc, cache, key)
    m = cache.match_prefix(other)
    assert m.prefix_len == shared
    assert m.slots.tolist() == slots[:shared].tolist()
    other_slots = alloc.alloc(LONG)
    assert cache.insert(other, other_slots) == shared
    alloc.free(other_slots[:shared])
    assert cache.match_prefix(other).slots.tolist() == (
        slots[:shared].tolist() + other_slots[shared:].tolist()
    )
    assert cache.match_prefix(key).slots.tolist() == slots.tolist()
    assert cache.total_size() == 2 * LONG - shared
    cache.check_invariants()


def test_common_prefix_len_matches_a_token_by_token_scan():
    """Against the plain definition, for keys of many lengths, starts and divergence points."""
    from breakgraph.cache.radix_cache import _common_prefix_len

    def reference(node_key: list[int], key: list[int], start: int) -> int:
        n = 0
        while n < len(node_key) and start + n < len(key) and node_key[n] == key[start + n]:
            n += 1
        return n

    rng = random.Random(0)
    for _ in range(2000):
        length = rng.choice([1, 2, 63, 64, 65, 127, 128, 129, 1000, 5000])
        node_key = [rng.randrange(4) for _ in range(length)]
        start = rng.randrange(0, 50)
        tail = list(node_key[: rng.randint(0, length)])
        if tail and rng.random() < 0.8:
            tail[rng.randrange(len(tail))] += 1  # one difference, anywhere
        key = [rng.randrange(4) for _ in range(start)] + tail + [9] * rng.randint(0, 3)
        got = _common_prefix_len(np.array(node_key, np.int32), np.array(key, np.int32), start)
        assert got == reference(node_key, key, start)
