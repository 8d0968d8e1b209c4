"""Counts JIT kernel compilations (Triton specializations) and names those after "ready".

A compilation inside serving traffic stalls every request in the step for as long as the
compile takes (seconds on a cold cache), so the server reports them in /metrics and logs
each one that happens after startup.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass
class CompileStats:
    total: int = 0
    after_ready: int = 0
    ready_since: float | None = None
    names_after_ready: list[str] = field(default_factory=list)


_STATS = CompileStats()
_LOCK = threading.Lock()
_INSTALLED = False


def _on_compile(*, fn=None, repr=None, **_: object) -> None:  # noqa: A002 - Triton's keyword
    name = getattr(fn, "name", None) or str(repr)
    with _LOCK:
        _STATS.total += 1
        if _STATS.ready_since is not None:
            _STATS.after_ready += 1
            _STATS.names_after_ready.append(name)
            # the repr names each argument's specialization (type, 16-divisible, == 1):
            # what the warm-up missed
            logger.warning("kernel compiled after ready (a stall in traffic): %s", repr or name)
    return None  # a truthy return from a Triton hook would skip the compile


def install() -> bool:
    """Hook Triton's post-compile callback; False when Triton is not importable."""
    global _INSTALLED
    if _INSTALLED:
        return True
    try:
        from triton import knobs
    except ImportError:
        return False
    prev = knobs.runtime.jit_post_compile_hook
    if prev is not None and prev is not _on_compile:

        def chained(**kw):
            _on_compile(**kw)
            return prev(**kw)

        knobs.runtime.jit_post_compile_hook = chained
    else:
        knobs.runtime.jit_post_compile_hook = _on_compile
    _INSTALLED = True
    return True


def mark_ready() -> None:
    """From now on, every compilation counts as one inside traffic."""
    with _LOCK:
        _STATS.ready_since = time.time()
        _STATS.after_ready = 0
        _STATS.names_after_ready.clear()


def stats() -> CompileStats:
    with _LOCK:
        return CompileStats(
            _STATS.total, _STATS.after_ready, _STATS.ready_since, list(_STATS.names_after_ready)
        )
