"""The paged KV store (one slot = one token's k and v in every layer) and its slot allocator.

Slot 0 is reserved: padding rows of a step write their KV there, so it is never handed
out and never holds real KV.
"""

from __future__ import annotations

import torch

PADDING_SLOT = 0


class KVPool:
    """Per-layer k and v buffers of shape ``[num_slots, num_kv_heads, head_dim]``, zeroed."""

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
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_slots, num_kv_heads, head_dim)
        self.k_buffers: list[torch.Tensor] = [
            torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)
        ]
        self.v_buffers: list[torch.Tensor] = [
            torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)
        ]

    @property
    def size_bytes(self) -> int:
        """Bytes held by all k and v buffers."""
        return sum(b.numel() * b.element_size() for b in self.k_buffers + self.v_buffers)

    @classmethod
    def bytes_per_slot(
        cls, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one token's k and v take over all layers (to size the pool from a budget)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * itemsize


class SlotAllocator:
    """Hands out KV slots ``1 .. num_slots-1`` as CPU int64 tensors; all or nothing.

    The free list is one int64 tensor, so allocating or freeing thousands of slots is a
    couple of tensor ops. With ``debug=True`` an in-use bitmap catches double frees,
    frees of never-allocated slots and of slot 0 (at an O(num_slots) cost per call).
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
        return self._free.numel()

    def clear(self) -> None:
        """Forget every allocation: all slots free again."""
        self._free = torch.arange(1, self.num_slots, dtype=torch.int64)
        self._in_use = torch.zeros(self.num_slots, dtype=torch.bool) if self.debug else None

    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` distinct free slots, or None (and nothing taken) if fewer than ``n`` are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        if n > self._free.numel():
            return None
        slots = self._free[:n].clone()
        self._free = self._free[n:]
        if self._in_use is not None:
            if self._in_use[slots].any():
                raise RuntimeError("allocator handed out a slot that is in use")
            self._in_use[slots] = True
        return slots

    def free(self, slots: torch.Tensor) -> None:
        """Return slots (a 1-D int tensor) to the free list."""
        if slots.numel() == 0:
            return
        slots = slots.to(device="cpu", dtype=torch.int64).reshape(-1)
        if self._in_use is not None:
            if (slots == PADDING_SLOT).any():
                raise RuntimeError("freeing the reserved padding slot 0")
            if torch.unique(slots).numel() != slots.numel():
                raise RuntimeError("the same slot freed twice in one call")
            if not self._in_use[slots].all():
                raise RuntimeError("freeing a slot that is not allocated (double free?)")
            self._in_use[slots] = False
        self._free = torch.cat([self._free, slots])

    def check_no_leak(self, expected_in_use: int) -> None:
        """Raise if the number of slots in use differs from ``expected_in_use`` (debug aid)."""
        in_use = self.capacity - self.available
        if in_use != expected_in_use:
            raise RuntimeError(f"slot leak: {in_use} slots in use, expected {expected_in_use}")
        if torch.unique(self._free).numel() != self._free.numel():
            raise RuntimeError("free list holds a slot twice")
        if (self._free == PADDING_SLOT).any():
            raise RuntimeError("free list holds the reserved padding slot 0")
        if self._in_use is not None and int(self._in_use.sum()) != expected_in_use:
            raise RuntimeError("in-use bitmap disagrees with the free list")
