"""The engine's torch profiler, started and stopped between steps (the server's
``/start_profile`` and ``/stop_profile``, SGLang's names): the host's ops and, on CUDA, every
kernel the steps launch (CUDA-graph replays included), written as one Chrome trace per
profile that ``chrome://tracing`` or Perfetto opens. Rank 0's only: under TP the workers run
the same kernels on their own GPUs."""

from __future__ import annotations

import os
import time

import torch


class EngineProfiler:
    """At most one profile at a time; ``start`` answers ``(ok, message, trace, conflict)`` with
    no trace, ``stop`` with the trace it wrote; ``conflict``: refused by the state (a start
    while one runs, a stop with none)."""

    def __init__(self) -> None:
        self._prof: torch.profiler.profile | None = None
        self._dir = ""
        self._started = 0.0

    @property
    def running(self) -> bool:
        return self._prof is not None

    def start(self, output_dir: str) -> tuple[bool, str, str, bool]:
        if self._prof is not None:
            return False, "a profile is already running: stop it first (/stop_profile)", "", True
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        prof = torch.profiler.profile(activities=activities)
        prof.start()
        self._prof, self._dir, self._started = prof, output_dir, time.time()
        kinds = " and ".join(a.name for a in activities)
        return True, f"profiling the engine's {kinds} activity until /stop_profile", "", False

    def stop(self) -> tuple[bool, str, str, bool]:
        """Stop and write the trace (gzipped JSON) under the start's folder."""
        if self._prof is None:
            return False, "no profile is running: start one first (/start_profile)", "", True
        prof, self._prof = self._prof, None
        prof.stop()
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(self._started))
        path = os.path.join(self._dir, f"breakgraph-{stamp}-{os.getpid()}.trace.json.gz")
        try:
            os.makedirs(self._dir, exist_ok=True)
            prof.export_chrome_trace(path)
        except OSError as e:
            return False, f"the trace was not written: {e}", "", False
        return True, f"trace written: {path}", path, False
