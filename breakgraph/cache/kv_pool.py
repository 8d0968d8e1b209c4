"""The paged KV store (one slot = one token's k and v in every KV layer) and its slot allocator.

Slot 0 is reserved: padding rows of a step write their KV there, so it is never handed
out and never holds real KV.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

PADDING_SLOT = 0


class KVPool:
    """Per-KV-layer k and v buffers of shape ``[num_slots, num_kv_heads, head_dim]``, zeroed.

    A KV layer is a layer that stores KV. Most models store KV in every layer, all of one
    shape (the ``num_layers, num_kv_heads, head_dim`` constructor); a model whose late layers
    reuse earlier layers' KV (Gemma 4) stores fewer, of per-layer shapes: ``from_shapes``
    with the model's ``kv_cache_shapes()``. ``from_model`` also takes what a model adds
    (DeepSeek V4): K and V in one buffer (``kv_k_is_v``), named per-slot buffers beside the
    KV (``kv_slot_shapes()``, in ``slot_buffers``) and named per-request float32 state
    (``request_state_shapes()``, in ``request_states``, allocated by ``add_request_states``
    once the number of request rows is known).
    """

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if num_slots < 2:
            raise ValueError(f"num_slots must be >= 2 (slot 0 is reserved), got {num_slots}")
        self.num_slots = num_slots
        self.dtype = dtype
        self.device = torch.device(device)
        self.k_is_v = False
        self.slot_buffers: dict[str, torch.Tensor] = {}
        self.request_states: dict[str, torch.Tensor] = {}
        self._allocate([(num_kv_heads, head_dim)] * num_layers)

    @classmethod
    def from_shapes(
        cls,
        num_slots: int,
        shapes: Sequence[tuple[int, int]],
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> KVPool:
        """One buffer pair per KV layer, of ``shapes[i] = (num_kv_heads, head_dim)``."""
        pool = cls(num_slots, 0, 0, 0, dtype, device)
        pool._allocate(shapes)
        return pool

    @classmethod
    def from_model(
        cls, num_slots: int, model, dtype: torch.dtype, device: torch.device | str
    ) -> KVPool:
        """The pool ``model`` needs: its KV layers, and what it stores beside them."""
        pool = cls(num_slots, 0, 0, 0, dtype, device)
        pool.k_is_v = bool(getattr(model, "kv_k_is_v", False))
        pool._allocate(model.kv_cache_shapes())
        for name, shape in cls.model_slot_shapes(model).items():
            pool.slot_buffers[name] = torch.zeros(
                (num_slots, *shape), dtype=dtype, device=pool.device
            )
        return pool

    @staticmethod
    def model_slot_shapes(model) -> dict[str, tuple[int, ...]]:
        fn = getattr(model, "kv_slot_shapes", None)
        return fn() if fn is not None else {}

    @classmethod
    def model_slot_bytes(cls, model, dtype: torch.dtype) -> int:
        """Bytes one token slot takes in ``from_model``'s pool (to size it from a budget)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        kv = cls.slot_bytes(model.kv_cache_shapes(), dtype)
        if getattr(model, "kv_k_is_v", False):
            kv //= 2
        extra = sum(math.prod(s) for s in cls.model_slot_shapes(model).values()) * itemsize
        return kv + extra

    def add_request_states(self, num_rows: int, model) -> None:
        """Zeroed float32 ``[num_rows, *shape]`` per-request state the model names."""
        fn = getattr(model, "request_state_shapes", None)
        for name, shape in (fn() if fn is not None else {}).items():
            self.request_states[name] = torch.zeros(
                (num_rows, *shape), dtype=torch.float32, device=self.device
            )

    def _allocate(self, shapes: Sequence[tuple[int, int]]) -> None:
        self.layer_shapes: list[tuple[int, int]] = [tuple(s) for s in shapes]
        self.num_layers = len(self.layer_shapes)
        uniform = len(set(self.layer_shapes)) == 1
        # uniform pools keep their scalar shape; per-layer ones have none
        self.num_kv_heads, self.head_dim = self.layer_shapes[0] if uniform else (None, None)
        self.k_buffers: list[torch.Tensor] = [
            torch.zeros((self.num_slots, h, d), dtype=self.dtype, device=self.device)
            for h, d in self.layer_shapes
        ]
        self.v_buffers: list[torch.Tensor] = (
            self.k_buffers
            if self.k_is_v
            else [
                torch.zeros((self.num_slots, h, d), dtype=self.dtype, device=self.device)
                for h, d in self.layer_shapes
            ]
        )

    @property
    def size_bytes(self) -> int:
        """Bytes held by the KV buffers (a K = V buffer once), the per-slot buffers and the
        per-request state."""
        bufs = self.k_buffers + ([] if self.k_is_v else self.v_buffers)
        bufs += [*self.slot_buffers.values(), *self.request_states.values()]
        return sum(b.numel() * b.element_size() for b in bufs)

    @classmethod
    def bytes_per_slot(
        cls, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one token's k and v take over all layers (to size the pool from a budget)."""
        return cls.slot_bytes([(num_kv_heads, head_dim)] * num_layers, dtype)

    @staticmethod
    def slot_bytes(shapes: Sequence[tuple[int, int]], dtype: torch.dtype) -> int:
        """Bytes one token's k and v take over KV layers of ``shapes``."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * sum(h * d for h, d in shapes) * itemsize


class SlotAllocator:
    """Hands out KV slots ``1 .. num_slots-1`` as CPU int64 tensors; all or nothing.

    The free list is a ring buffer in one int64 tensor: ``alloc`` takes from its head,
    ``free`` appends at its tail, each a slice copy of the slots moved, so allocating or
    freeing thousands of slots costs microseconds whatever the pool size. With
    ``debug=True`` an in-use bitmap also catches double frees, frees of never-allocated
    slots and of slot 0 (at an O(num_slots) cost per call).
    """

    def __init__(self, num_slots: int, debug: bool = False) -> None:
        if num_slots < 2:
            raise ValueError(f"num_slots must be >= 2 (slot 0 is reserved), got {num_slots}")
        self.num_slots = num_slots
        self.debug = debug
        self.clear()

    @property
    def capacity(self) -> int:
        """Slots that can ever be handed out (slot 0 excluded)."""
        return self.num_slots - 1

    @property
    def available(self) -> int:
        return self._count

    def clear(self) -> None:
        """Forget every allocation: all slots free again."""
        self._ring = torch.arange(1, self.num_slots, dtype=torch.int64)
        self._head = 0  # ring[head : head + count] (mod capacity) are the free slots
        self._count = self.capacity
        self._in_use = torch.zeros(self.num_slots, dtype=torch.bool) if self.debug else None

    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` distinct free slots, or None (and nothing taken) if fewer than ``n`` are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        if n > self._count:
            return None
        cap, start = self.capacity, self._head
        end = start + n
        if end <= cap:
            slots = self._ring[start:end].clone()
        else:
            slots = torch.cat([self._ring[start:], self._ring[: end - cap]])
        self._head = end % cap
        self._count -= n
        if self._in_use is not None:
            if self._in_use[slots].any():
                raise RuntimeError("allocator handed out a slot that is in use")
            self._in_use[slots] = True
        return slots

    def free(self, slots: torch.Tensor) -> None:
        """Return slots (a 1-D int tensor) to the free list."""
        n = slots.numel()
        if n == 0:
            return
        if self._count + n > self.capacity:
            raise RuntimeError(f"freeing {n} slots but only {self.capacity - self._count} in use")
        slots = slots.to(device="cpu", dtype=torch.int64).reshape(-1)
        if self._in_use is not None:
            if (slots == PADDING_SLOT).any():
                raise RuntimeError("freeing the reserved padding slot 0")
            if torch.unique(slots).numel() != n:
                raise RuntimeError("the same slot freed twice in one call")
            if not self._in_use[slots].all():
                raise RuntimeError("freeing a slot that is not allocated (double free?)")
            self._in_use[slots] = False
        cap = self.capacity
        tail = (self._head + self._count) % cap
        first = min(n, cap - tail)
        self._ring[tail : tail + first] = slots[:first]
        self._ring[: n - first] = slots[first:]
        self._count += n

    def _free_slots(self) -> torch.Tensor:
        end = self._head + self._count
        if end <= self.capacity:
            return self._ring[self._head : end]
        return torch.cat([self._ring[self._head :], self._ring[: end - self.capacity]])

    def check_no_leak(self, expected_in_use: int) -> None:
        """Raise if the number of slots in use differs from ``expected_in_use`` (debug aid)."""
        in_use = self.capacity - self.available
        if in_use != expected_in_use:
            raise RuntimeError(f"slot leak: {in_use} slots in use, expected {expected_in_use}")
        free = self._free_slots()
        if torch.unique(free).numel() != free.numel():
            raise RuntimeError("free list holds a slot twice")
        if (free == PADDING_SLOT).any():
            raise RuntimeError("free list holds the reserved padding slot 0")
        if self._in_use is not None and int(self._in_use.sum()) != expected_in_use:
            raise RuntimeError("in-use bitmap disagrees with the free list")
