"""Host time vs GPU time of each step, and the wall-clock stamps of a request's timeline.

The GPU time of a step is the forward between two CUDA events; they are read one step late
with ``query()`` first, so timing never adds a host sync. On the CPU only host time exists.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass
class StepTiming:
    """The last step's host times, and the GPU time of the latest step whose events resolved."""

    step_ms: float = 0.0  # host wall time of the whole step (schedule, launch, read-back)
    forward_ms: float = 0.0  # host time inside the forward call (launches only, on CUDA)
    gpu_ms: float | None = None  # GPU time of the forward of an earlier step, resolved now
    gpu_step_ms: float | None = None  # that earlier step's host wall time


class StepTimer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.last = StepTiming()
        self._events = (
            [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
             for _ in range(2)] if self.cuda else []
        )  # fmt: skip
        self._slot = 0
        self._pending: tuple[int, float] | None = None  # (event pair, its step's wall ms)
        self._recorded = False
        self._step_start = self._fwd_start = 0.0
        self.step_started_at = 0.0  # wall clock (time.time) at the start of this step

    def step_begin(self) -> None:
        self._step_start = time.perf_counter()
        self.step_started_at = time.time()
        self._recorded = False
        self.last = StepTiming()

    def stamp_first_forward(self, reqs, start: float, end: float) -> None:
        """Stamp the requests of a step whose first forward it is (their timeline)."""
        scheduled_at = self.step_started_at or start  # 0 when launched outside step()
        for r in reqs:
            if r.scheduled_at is None:
                r.scheduled_at, r.forward_start_at, r.forward_end_at = scheduled_at, start, end

    def forward_begin(self) -> float:
        """Before the forward; returns the wall-clock stamp for request timelines."""
        if self.cuda:
            self._events[self._slot][0].record()
        self._fwd_start = time.perf_counter()
        return time.time()

    def forward_end(self) -> float:
        self.last.forward_ms = (time.perf_counter() - self._fwd_start) * 1000.0
        if self.cuda:
            self._events[self._slot][1].record()
            self._recorded = True
        return time.time()

    def step_end(self) -> StepTiming:
        last = self.last
        last.step_ms = (time.perf_counter() - self._step_start) * 1000.0
        if self._pending is not None:  # the previous step's events: done by now, read w/o sync
            slot, wall_ms = self._pending
            start, end = self._events[slot]
            if end.query():
                last.gpu_ms, last.gpu_step_ms = start.elapsed_time(end), wall_ms
                self._pending = None
        if self._recorded:
            # a still-unread pair is dropped: its slot is about to be reused
            self._pending = (self._slot, last.step_ms)
            self._slot ^= 1
        return last
