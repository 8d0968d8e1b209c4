"""The request -> token table: row ``r`` lists the KV slot of each token of request ``r``.

The attention kernels read it on the device; the scheduler writes it from the host
without ever waiting for the device.
"""

from __future__ import annotations

import numpy as np
import torch

from breakgraph.forward_batch import IntSeq, upload_many


class ReqToTokenPool:
    """``table[max_reqs, max_context_len]`` int32 on ``device`` and a free list of its rows."""

    def __init__(self, max_reqs: int, max_context_len: int, device: torch.device | str) -> None:
        self.max_reqs = max_reqs
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.table = torch.zeros((max_reqs, max_context_len), dtype=torch.int32, device=self.device)
        # TP rank 0 logs every write (host values) for the other ranks' copies of the table;
        # None: no log (TP 1)
        self.write_log: list[tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None
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
        if self.write_log is not None:
            cols = np.arange(start, start + n, dtype=np.int32)
            self._log(np.full(n, idx, dtype=np.int32), cols, slots)
        dst = self.table[idx, start : start + n]
        if self.device.type == "cuda":
            host = torch.empty(n, dtype=torch.int32, pin_memory=True)
            host.copy_(slots.reshape(-1))
            dst.copy_(host, non_blocking=True)
        else:
            dst.copy_(slots.reshape(-1))

    def write_many(self, rows: IntSeq, cols: IntSeq, slots: torch.Tensor) -> None:
        """``table[rows[i], cols[i]] = slots[i]`` for all ``i`` (slots: host int tensor).

        One upload of the indices, one of the values (pinned, non-blocking on CUDA) and
        one scatter kernel, whatever the number of rows: a step's table writes in one go.
        """
        if not len(rows):
            return
        if self.write_log is not None:
            self._log(np.asarray(rows, dtype=np.int32), np.asarray(cols, dtype=np.int32), slots)
        r, c = upload_many([rows, cols], torch.int64, self.device)
        vals = slots.reshape(-1).to(torch.int32)
        if self.device.type == "cuda":
            vals = vals.pin_memory()
        self.table.index_put_((r, c), vals.to(self.device, non_blocking=True))

    def write_batch(self, batch, log: tuple | None = None) -> None:
        """A step's table write from its own upload (``ForwardBatch.build(table_width=
        max_context_len)``: ``table_cells``, ``table_slots``): one kernel, no upload of its
        own. ``log``: the write as host ``(rows, cols, slots)`` for TP rank 0's log (decode's
        is not logged: every TP rank writes it from its own copy of the step)."""
        if log is not None and self.write_log is not None:
            self._log(
                np.asarray(log[0], dtype=np.int32), np.asarray(log[1], dtype=np.int32), log[2]
            )
        self.table.view(-1).index_copy_(0, batch.table_cells, batch.table_slots)

    def _log(self, rows: np.ndarray, cols: np.ndarray, slots: torch.Tensor) -> None:
        vals = slots.reshape(-1).to(torch.int32).numpy().copy()
        self.write_log.append((rows, cols, vals))

    def drain_writes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The writes logged since the last drain as (rows, cols, slots) int32, in order."""
        log = self.write_log
        if not log:
            return None
        self.write_log = []
        return tuple(np.concatenate(part) for part in zip(*log, strict=True))

    def apply_writes(self, rows: np.ndarray, cols: np.ndarray, slots: np.ndarray) -> None:
        """Replay writes drained from another rank's table: of several writes to one cell the
        last wins, as it did there (one scatter of duplicates would pick any)."""
        cells = rows.astype(np.int64) * self.max_context_len + cols
        _, last_rev = np.unique(cells[::-1], return_index=True)
        keep = len(cells) - 1 - last_rev
        self.write_many(rows[keep], cols[keep], torch.from_numpy(slots[keep]))
