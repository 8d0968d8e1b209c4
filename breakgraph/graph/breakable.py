"""Breakable CUDA graphs: a callable captured as segments with eager breaks between them.

``@eager_break`` marks a function that must run eagerly inside a captured forward (it reads
live per-step state the graph cannot bake in). While a ``BreakableGraph`` captures, each call
of a break ends the current segment, runs the break once, records a replay closure holding
its arguments and result strongly, and begins the next segment on the same memory pool.
Replay runs ``seg[0], brk[0], seg[1], ..., seg[n]``. Outside capture a break is a plain call.

Invariants for break authors: write results into tensors the caller allocated (or return
one tensor: the graph keeps the captured one alive and copies each replay's result into it;
anything else returned raises at capture); the next segment reads those addresses. Tensor
arguments are held *by address*, not owned:
holding them strongly would pin every layer's activations of every bucket (tens of GB for
a 28-layer model at 8K tokens), while by address the pool reuses them across layers, which
is safe because replay runs in capture order. So a break's tensor arguments must be either
produced inside the captured callable or kept alive by their owner (parameters, caches).

Memory: everything a capture allocates lives in the graph's pool, which outlives every
replay. Segments allocate there by CUDA-graph capture; a break's eager allocations during
capture are routed there too; and library workspaces a captured kernel bakes in by address
(cuBLAS/cuBLASLt keep one per handle and stream, freed whenever anyone calls
``torch._C._cuda_clearCublasWorkspaces``, as torch.compile's CUDA-graph trees do before
every recording, followed by ``empty_cache``) are dropped before the capture so that the
capture allocates fresh ones inside the pool. A workspace in the pool can only be reused by
another graph of the same pool, which never runs concurrently with this one.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from breakgraph.common import envs

logger = logging.getLogger(__name__)

_STATE = threading.local()


class GraphReplayError(RuntimeError):
    """A replay piece faulted; the message names the segment or break."""


class _ArrayInterface:
    """A CUDA array interface over a tensor's memory that owns nothing."""

    def __init__(self, t: torch.Tensor, itemsize_dtype: torch.dtype):
        size = t.element_size()
        self.__cuda_array_interface__ = {
            "shape": tuple(t.shape),
            "strides": tuple(st * size for st in t.stride()),
            "typestr": {1: "|u1", 2: "<i2", 4: "<i4", 8: "<i8"}[size],
            "data": (t.data_ptr(), False),
            "version": 2,
        }


def _by_address(x: Any) -> Any:
    """A tensor aliasing ``x``'s memory without keeping it alive (non-tensors unchanged)."""
    if not isinstance(x, torch.Tensor) or not x.is_cuda or x.numel() == 0:
        return x
    alias = torch.as_tensor(_ArrayInterface(x, x.dtype), device=x.device)
    return alias.view(x.dtype)


@dataclass
class _Break:
    name: str
    fn: Callable[..., Any]
    args: tuple
    kwargs: dict
    result: torch.Tensor | None  # a returned tensor, kept alive; replay copies into it

    def __call__(self) -> None:
        out = self.fn(*self.args, **self.kwargs)
        if self.result is not None:
            self.result.copy_(out)


def eager_break(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``fn`` to run eagerly between captured segments (see module docstring)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        capture = getattr(_STATE, "capture", None)
        if capture is None or not capture.split_at_breaks:
            return fn(*args, **kwargs)
        return capture._run_break(fn, args, kwargs)

    wrapper.__wrapped_break__ = fn
    return wrapper


def _clear_library_workspaces() -> None:
    """Drop cuBLAS/cuBLASLt's cached workspaces: the next GEMM allocates a new one (inside a
    capture: in the graph's pool, where no one else's ``clear`` + ``empty_cache`` frees it)."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


@contextlib.contextmanager
def _allocate_in_pool(device: torch.device, pool):
    """Route this thread's CUDA allocations to ``pool`` (a break's memory during capture)."""
    begin = getattr(torch._C, "_cuda_beginAllocateCurrentThreadToPool", None)
    if begin is None:  # older torch: the break allocates from the general allocator
        yield
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    begin(index, pool)
    try:
        yield
    finally:
        torch._C._cuda_endAllocateToPool(index, pool)
        torch._C._cuda_releasePool(index, pool)


def debug_mode() -> bool:
    """``BREAKGRAPH_GRAPH_DEBUG=1``: replays run piece by piece, each checked (common/envs.py)."""
    return envs.GRAPH_DEBUG.get()


class BreakableGraph:
    """One callable captured into CUDA-graph segments separated by eager breaks."""

    def __init__(self, pool=None, split_at_breaks: bool = True):
        """``split_at_breaks=False`` captures breaks inline: one whole graph, for callables
        whose breaks are themselves capturable (e.g. decode attention)."""
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self.split_at_breaks = split_at_breaks
        self.segments: list[torch.cuda.CUDAGraph] = []
        self.breaks: list[_Break] = []
        self.output: Any = None
        self._stream: torch.cuda.Stream | None = None

    @property
    def num_segments(self) -> int:
        return len(self.segments)

    def capture(
        self,
        fn: Callable[..., Any],
        *args,
        warmup: int = 1,
        stream: torch.cuda.Stream | None = None,
        **kwargs,
    ) -> Any:
        """Capture ``fn(*args, **kwargs)``; its inputs must be the static tensors replay reuses.

        ``warmup`` eager calls run first on the capture stream (library handles such as
        cuBLAS's cannot be created inside a capture); pass 0 if the stream is already warm.
        """
        if getattr(_STATE, "capture", None) is not None:
            raise RuntimeError("nested BreakableGraph capture")
        self._stream = stream or torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            for _ in range(warmup):
                fn(*args, **kwargs)
        torch.cuda.synchronize()
        _clear_library_workspaces()  # the capture allocates its own, in the pool
        _STATE.capture = self
        try:
            with torch.cuda.stream(self._stream):
                self._begin_segment()
                self.output = fn(*args, **kwargs)
                self.segments[-1].capture_end()
        except BaseException:
            self._abort_capture()
            raise
        finally:
            _STATE.capture = None
            # eager work after this must not share the in-pool workspace the graph bakes in
            _clear_library_workspaces()
        torch.cuda.synchronize()
        return self.output

    def _abort_capture(self) -> None:
        """End a capture that failed midway so the stream and allocator leave capture mode."""
        with torch.cuda.stream(self._stream):
            if self.segments and torch.cuda.is_current_stream_capturing():
                try:
                    self.segments[-1].capture_end()
                except Exception:  # noqa: BLE001 - the original error is the one to report
                    logger.debug("capture_end after a failed capture raised", exc_info=True)
        self.segments.clear()
        self.breaks.clear()

    def _begin_segment(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool)
        self.segments.append(graph)

    def _run_break(self, fn, args, kwargs):
        self.segments[-1].capture_end()
        name = f"{getattr(fn, '__qualname__', repr(fn))}#{len(self.breaks)}"
        # eagerly, on the capture stream, outside any graph; its memory comes from the pool
        with _allocate_in_pool(torch.cuda.current_stream().device, self.pool):
            result = fn(*args, **kwargs)
        if result is not None and not isinstance(result, torch.Tensor):
            raise TypeError(
                f"eager break {name} returned {type(result).__name__}: a break must return "
                "None or one tensor (replay copies into the captured one; anything else "
                "would be read later from memory the graph does not own)"
            )
        held_args = tuple(_by_address(a) for a in args)
        held_kwargs = {k: _by_address(v) for k, v in kwargs.items()}
        self.breaks.append(_Break(name, fn, held_args, held_kwargs, result))
        self._begin_segment()
        return result

    def replay(self) -> Any:
        if debug_mode():
            return self._replay_debug()
        segments, breaks = self.segments, self.breaks
        for i, brk in enumerate(breaks):
            segments[i].replay()
            brk()
        segments[-1].replay()
        return self.output

    def _replay_debug(self) -> Any:
        """Piece by piece with a sync after each, naming the piece where a fault appears."""
        for i, seg in enumerate(self.segments):
            before = self.breaks[i - 1].name if i > 0 else "start"
            after = self.breaks[i].name if i < len(self.breaks) else "end"
            self._checked(seg.replay, f"segment {i} (between {before} and {after})")
            if i < len(self.breaks):
                self._checked(self.breaks[i], f"break {i} ({self.breaks[i].name})")
        return self.output

    @staticmethod
    def _checked(piece: Callable[[], None], what: str) -> None:
        try:
            piece()
            torch.cuda.synchronize()
        except Exception as e:
            raise GraphReplayError(f"graph replay faulted in {what}: {e}") from e
