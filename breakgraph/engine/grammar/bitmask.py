"""Each step's token bitmask: one int32 row of ``ceil(vocab / 32)`` words per batch row (bit
``t % 32`` of word ``t // 32`` set: token ``t`` allowed), filled on the host by xgrammar from
each constrained request's matcher, uploaded with one non-blocking copy into a device buffer
that keeps its address, and applied to the logits before sampling by device ops (no host
sync, capture-safe). An unconstrained row is all ones: neutral.

The mask of a decode step depends on the token its request sampled one step earlier, which
overlap scheduling leaves on the device; the scheduler fills it once that token is read back,
while the GPU runs the step's forward (scheduler.py, docs/design.md).
"""

from __future__ import annotations

import torch

from breakgraph.engine.grammar.matcher import RequestGrammar

NEUTRAL = -1  # all 32 bits set: every token of the word allowed


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [B, V] float and bitmask [B, ceil(V / 32)] int32 -> logits, each token whose
    bit is clear set to -inf, in place. Device ops over [B, 32 W] int32: each word shifted by
    0..31, its low bit kept (int32 throughout: the CPU's uint8 kernels with a broadcast
    operand were 20x slower)."""
    rows, vocab = logits.shape
    bits = (bitmask[:, :, None] >> _shifts(logits.device)) & 1  # [B, W, 32]
    banned = bits.view(rows, -1)[:, :vocab] == 0
    return logits.masked_fill_(banned, float("-inf"))


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def _shifts(device: torch.device) -> torch.Tensor:
    shifts = _SHIFTS.get(device)
    if shifts is None:  # made on the device: a list copied up from pageable memory would sync
        shifts = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    return shifts


class GrammarMask:
    """The bitmask rows of a step, on the device; grows (by doubling) to the largest batch
    with a constrained row."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.device = device
        self.rows = torch.full((0, self.words), NEUTRAL, dtype=torch.int32, device=device)
        self._filler = None  # xgrammar's BatchGrammarMatcher: its threads fill many rows

    def apply(self, logits: torch.Tensor, grammars: list[RequestGrammar | None]) -> bool:
        """Mask ``logits`` [B, V] in place by each row's grammar (None: unconstrained, or a
        finished request whose row is dropped). False, and nothing done, if no row has one."""
        held = [i for i, g in enumerate(grammars) if g is not None and not g.terminated]
        if not held:
            return False
        n = len(grammars)
        host = torch.empty((n, self.words), dtype=torch.int32,
                           pin_memory=self.device.type == "cuda")  # fmt: skip
        free = sorted(set(range(n)) - set(held))
        if free:
            host[free] = NEUTRAL
        self._fill(host, [grammars[i].matcher for i in held], held)
        self.apply_host(logits, host)
        return True

    def host_rows(self, n: int) -> torch.Tensor:
        """``n`` neutral host rows (pinned on CUDA) for a caller that fills them itself."""
        pin = self.device.type == "cuda"
        return torch.full((n, self.words), NEUTRAL, dtype=torch.int32, pin_memory=pin)

    def apply_host(self, logits: torch.Tensor, host: torch.Tensor) -> None:
        """Upload the filled ``host`` rows (one non-blocking copy) and mask ``logits``."""
        rows = self._rows(host.shape[0])
        rows.copy_(host, non_blocking=True)
        if logits.device.type == "cpu":  # xgrammar's C++ kernel: ~5x the device ops there
            import xgrammar as xgr

            xgr.apply_token_bitmask_inplace(logits, rows)
        else:
            apply_token_bitmask(logits, rows)

    def _fill(self, host: torch.Tensor, matchers: list, indices: list[int]) -> None:
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(host, indices[0])
            return
        if self._filler is None:
            import xgrammar as xgr

            self._filler = xgr.BatchGrammarMatcher()
        self._filler.batch_fill_next_token_bitmask(matchers, host, indices)

    def _rows(self, n: int) -> torch.Tensor:
        """The device buffer's first ``n`` rows. A grown buffer replaces the old one: a step
        still queued that reads the old one is ordered before any reuse of its memory (one
        stream)."""
        if n > self.rows.shape[0]:
            size = max(n, 2 * self.rows.shape[0], 8)
            self.rows = torch.full((size, self.words), NEUTRAL, dtype=torch.int32,
                                   device=self.device)  # fmt: skip
        return self.rows[:n]
