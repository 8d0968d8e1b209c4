"""Logprobs of chosen tokens and the top-k, for prompt rows (a chunked LM head) and sampled
tokens, and the step's one read-back that carries them to the host.

A prompt's rows go through the LM head a chunk of rows at a time, so a long prompt never
holds more than ``MAX_LOGIT_FLOATS`` logits at once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

MAX_LOGIT_FLOATS = 1 << 26  # 256 MiB of float32 logits per chunk of prompt rows


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """logits [R, V] -> (logprob of targets [R] (or of several per row: [R, m] -> [R, m]),
    top-k logprobs [R, k], their ids [R, k]); ``MAX_LOGIT_FLOATS`` logits at a time (a
    large decode batch's rows: the float32 copy and the log-sum-exp's temporaries)."""
    rows = max(1, MAX_LOGIT_FLOATS // max(logits.shape[-1], 1))
    if logits.shape[0] > rows:
        return _cat(
            [
                token_logprobs(logits[i : i + rows], targets[i : i + rows], top_k)
                for i in range(0, logits.shape[0], rows)
            ],
            top_k,
        )
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    chosen = logits.gather(1, targets.view(targets.shape[0], -1)) - lse
    if targets.dim() == 1:
        chosen = chosen.squeeze(1)
    if top_k <= 0:
        return chosen, None, None
    values, ids = logits.topk(min(top_k, logits.shape[-1]), dim=-1)
    return chosen, values - lse, ids


def chunked_row_logprobs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    vocab_size: int,
    top_k: int,
    max_floats: int = MAX_LOGIT_FLOATS,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``token_logprobs`` of hidden rows [R, H] through the LM head, a chunk of rows at a time
    (the chunk count is known on the host: no sync)."""
    if hidden.shape[0] == 0:
        empty = torch.empty(0, device=hidden.device)
        if top_k <= 0:
            return empty, None, None
        return empty, empty.view(0, top_k), empty.view(0, top_k).long()
    rows = max(1, max_floats // max(vocab_size, 1))
    parts = [
        token_logprobs(compute_logits(hidden[i : i + rows]), targets[i : i + rows], top_k)
        for i in range(0, hidden.shape[0], rows)
    ]
    return _cat(parts, top_k)


def _cat(parts: list[tuple], top_k: int):
    """``token_logprobs``' results of consecutive chunks of rows, as one."""
    chosen = torch.cat([p[0] for p in parts])
    if top_k <= 0:
        return chosen, None, None
    return chosen, torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts])


class ReadBack:
    """Device tensors gathered for the step's one host read: each added tensor comes back as
    a flat list of Python numbers, in order. Several tensors go as one float64 copy (it
    carries ids exactly); the common step, ids alone, skips the conversion and the cat.

    ``start`` queues the copy to pinned host memory behind the step's kernels and records an
    event; ``fetch`` waits for that event only, not for the stream, so a later step may
    already be queued behind it (overlap scheduling)."""

    def __init__(self):
        self._parts: list[torch.Tensor] = []
        self._sizes: list[int] = []
        self._host: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None

    def add(self, t: torch.Tensor) -> int:
        """Queue ``t``; returns its handle for ``get``."""
        flat = t.reshape(-1)
        self._parts.append(flat)
        self._sizes.append(flat.numel())
        return len(self._parts) - 1

    def start(self) -> None:
        """Queue the device-to-host copy (no sync)."""
        if not self._parts or self._host is not None:
            return
        if len(self._parts) == 1:  # most steps: the sampled ids alone, read as they are
            packed = self._parts[0]
        else:
            packed = torch.cat([p.to(torch.float64) for p in self._parts])
        if packed.device.type != "cuda":
            self._host = packed
            return
        self._host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        self._host.copy_(packed, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def fetch(self) -> list[list[float]]:
        """Wait for the copy (``start`` if not yet started): every queued tensor as a list."""
        if not self._parts:
            return []
        self.start()
        if self._event is not None:
            self._event.synchronize()
        values = self._host.tolist()
        if len(self._parts) == 1:
            return [values]
        out, at = [], 0
        for n in self._sizes:
            out.append(values[at : at + n])
            at += n
        return out
