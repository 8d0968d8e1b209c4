"""Python garbage-collector pauses in a serving process, and the freeze that keeps them short.

A full (generation 2) collection walks every tracked object of the process. A process that
has imported torch and Triton and built a model and its graphs holds hundreds of thousands
of them, so such a collection pauses the host for tens of milliseconds. Every request in the
step waits for it. It comes at random: it is triggered when enough containers have been
allocated, and request handling allocates them (decoded messages, lists of ids).

``freeze()`` runs once the process is ready. It collects, then moves every surviving object
to the permanent generation (``gc.freeze``), so later collections only walk what serving
allocates. vLLM's engine does the same after start-up. It also times each collection
through ``gc.callbacks``. The pauses after ready are reported with the engine's stats, so a
stall from the collector is a number in /metrics, not a guess.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# a pause this long after ready is logged (each is a stall of every request in its step)
WARN_PAUSE_S = 0.010


@dataclass
class GcStats:
    collections_after_ready: int = 0
    pause_s_after_ready: float = 0.0
    max_pause_s_after_ready: float = 0.0
    frozen_objects: int = 0


_STATS = GcStats()
_LOCK = threading.Lock()
_READY = False
_started: float | None = None


def _on_gc(phase: str, info: dict) -> None:
    global _started
    if phase == "start":
        _started = time.perf_counter()
        return
    if _started is None or not _READY:
        return
    pause = time.perf_counter() - _started
    _started = None
    with _LOCK:
        _STATS.collections_after_ready += 1
        _STATS.pause_s_after_ready += pause
        _STATS.max_pause_s_after_ready = max(_STATS.max_pause_s_after_ready, pause)
    if pause >= WARN_PAUSE_S:
        logger.warning(
            "garbage collection of generation %d paused the host %.1f ms (%d collected)",
            info.get("generation", -1), pause * 1e3, info.get("collected", 0),
        )  # fmt: skip


def freeze() -> int:
    """Serving starts: collect once, freeze the survivors out of later collections, and count
    the pauses from now on. Returns the number of objects frozen."""
    global _READY
    if _on_gc not in gc.callbacks:  # time every collection of this process, once
        gc.callbacks.append(_on_gc)
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    with _LOCK:
        _STATS.collections_after_ready = 0
        _STATS.pause_s_after_ready = _STATS.max_pause_s_after_ready = 0.0
        _STATS.frozen_objects = frozen
    _READY = True
    return frozen


def stats() -> GcStats:
    with _LOCK:
        return GcStats(**vars(_STATS))


def report(prefix: str = "gc_") -> dict[str, int | float]:
    """The stats as a server reports them, keys under ``prefix``."""
    s = stats()
    return {
        prefix + "collections_after_ready": s.collections_after_ready,
        prefix + "pause_seconds_after_ready": round(s.pause_s_after_ready, 6),
        prefix + "max_pause_seconds_after_ready": round(s.max_pause_s_after_ready, 6),
        prefix + "frozen_objects": s.frozen_objects,
    }
