"""The request -> token table: row ``r`` lists the KV slot of each token of request ``r``.

The attention kernels read it on the device; the scheduler writes it from the host
without ever waiting for the device.
"""

from __future__ import annotations

import torch

from breakgraph.forward_batch import upload_many


class ReqToTokenPool:
    """``table[max_reqs, max_context_len]`` int32 on ``device`` and a free list of its rows."""

    def __init__(self, max_reqs: int, max_context_len: int, device: torch.device | str) -> None:
        self.max_reqs = max_reqs
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.table = torch.zeros((max_reqs, max_context_len), dtype=torch.int32, device=self.device)
        self.clear()

    @property
    def available(self) -> int:
        return len(self._free)

    def clear(self) -> None:
        """All rows free again (the table contents are left as they are)."""
        # pop() from the end hands out row 0 first
        self._free: list[int] = list(range(self.max_reqs - 1, -1, -1))
        self._in_use = [False] * self.max_reqs

    def alloc(self) -> int | None:
        """A free row index, or None when all rows are taken."""
        if not self._free:
            return None
        idx = self._free.pop()
        self._in_use[idx] = True
        return idx

    def free(self, idx: int) -> None:
        if not self._in_use[idx]:
            raise RuntimeError(f"req_to_token row {idx} freed but not allocated")
        self._in_use[idx] = False
        self._free.append(idx)

    def write(self, idx: int, start: int, slots: torch.Tensor) -> None:
        """``table[idx, start:start+len(slots)] = slots`` (slots: host int tensor).

        On CUDA the values go through a pinned staging tensor and a non-blocking copy,
        so the host never waits for queued device work. The caching host allocator keeps
        the staging block alive until the copy has run.
        """
        n = slots.numel()
        if n == 0:
            return
        if start < 0 or start + n > self.max_context_len:
            raise ValueError(
                f"write of {n} slots at {start} exceeds max_context_len {self.max_context_len}"
            )
        dst = self.table[idx, start : start + n]
        if self.device.type == "cuda":
            host = torch.empty(n, dtype=torch.int32, pin_memory=True)
            host.copy_(slots.reshape(-1))
            dst.copy_(host, non_blocking=True)
        else:
            dst.copy_(slots.reshape(-1))

    def write_many(self, rows: list[int], cols: list[int], slots: torch.Tensor) -> None:
        """``table[rows[i], cols[i]] = slots[i]`` for all ``i`` (slots: host int tensor).

        One upload of the indices, one of the values (pinned, non-blocking on CUDA) and
        one scatter kernel, whatever the number of rows: a step's table writes in one go.
        """
        if not rows:
            return
        r, c = upload_many([rows, cols], torch.int64, self.device)
        vals = slots.reshape(-1).to(torch.int32)
        if self.device.type == "cuda":
            vals = vals.pin_memory()
        self.table.index_put_((r, c), vals.to(self.device, non_blocking=True))
