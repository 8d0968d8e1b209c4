"""GraphBank: one BreakableGraph per row-count bucket over bank-owned static inputs.

Each static input is one buffer of the largest bucket's size; bucket ``b`` is captured on
the views ``buf[:b]``. ``replay(b, n, **live)`` copies the live rows into ``buf[:n]`` (one
multi-tensor copy per dtype), fills rows ``n:b`` with the input's pad value, and replays
bucket ``b``. The bank owns no choice: its caller picks the bucket (``smallest_bucket`` is
the usual rule) or runs eagerly. All buckets share one memory pool, captured largest first
so smaller buckets reuse its blocks.

The buckets also share one output buffer per output: the largest bucket's, which the bank
keeps (``outputs``); a smaller bucket's graph copies what it computed into a leading slice of
it (``fn``). So a bank keeps one bucket's outputs instead of one per bucket (a decode bank's
float32 logits are ``rows x vocab`` each: GiBs summed over the buckets of a large
vocabulary), for one copy of a smaller bucket's outputs per replay. The contract this adds
is the one a graph's output already had: a replay overwrites the previous replay's outputs,
so its caller consumes or copies them first (every caller does: it samples, gathers or
copies a step's logits before it launches the next).

Capture runs every bucket once eagerly before capturing any, so lazily sized workspaces and
JIT-compiled kernels of every shape exist first; it then checks that the captures compiled
nothing (``compile_counter``). What a capture allocates is in the pool by construction (see
graph/breakable.py).
"""

from __future__ import annotations

import bisect
import gc
import logging
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from breakgraph.common import envs
from breakgraph.graph import breakable as _breakable
from breakgraph.graph.breakable import BreakableGraph

logger = logging.getLogger(__name__)


class GraphAddressError(RuntimeError):
    """A buffer a captured kernel reads by address has moved since capture."""


class GraphCaptureError(RuntimeError):
    """A capture did something serving cannot afford (a JIT compile inside it)."""


def smallest_bucket(sizes: list[int], n: int, max_pad_factor: float = float("inf")) -> int | None:
    """The smallest of the sorted ``sizes`` >= ``n``, or None if none is or its padding
    exceeds ``max_pad_factor`` (the smallest size takes any smaller ``n``)."""
    i = bisect.bisect_left(sizes, n)
    if n <= 0 or i == len(sizes):
        return None
    size = sizes[i]
    return size if size <= n * max_pad_factor or size == sizes[0] else None


@dataclass(frozen=True)
class StaticInput:
    name: str
    dtype: torch.dtype
    trailing_shape: tuple[int, ...] = ()
    pad_value: int | float = 0


class GraphBank:
    def __init__(
        self,
        fn: Callable[..., Any],
        inputs: list[StaticInput],
        sizes: Iterable[int],
        device: torch.device | str,
        *,
        pool=None,
        split_at_breaks: bool = True,
        guard_tensors: Callable[[], Iterable[torch.Tensor]] | None = None,
        check_addresses: bool | None = None,
        capture_context: Callable[[int], AbstractContextManager] | None = None,
        compile_counter: Callable[[], int] | None = None,
        name: str = "graph",
    ):
        """``capture_context(size)``, if given, is entered around each bucket's warm-up and
        capture (e.g. to set up state the breaks read during capture). ``compile_counter``,
        if given, counts JIT compilations; a capture that moves it raises."""
        self.forward = fn
        self.inputs = inputs
        self.sizes = sorted(set(sizes))
        if not self.sizes:
            raise ValueError("a GraphBank needs at least one bucket size")
        self.device = torch.device(device)
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self.split_at_breaks = split_at_breaks
        self.guard_tensors = guard_tensors
        self.capture_context = capture_context or (lambda size: nullcontext())
        self.compile_counter = compile_counter
        if check_addresses is None:
            check_addresses = envs.GRAPH_GUARD.get()
        self.check_addresses = check_addresses
        self.name = name
        max_size = self.sizes[-1]
        self.static = {
            spec.name: torch.full(
                (max_size, *spec.trailing_shape),
                spec.pad_value,
                dtype=spec.dtype,
                device=self.device,
            )
            for spec in inputs
        }
        self._dirty_rows = {spec.name: 0 for spec in inputs}
        self.graphs: dict[int, BreakableGraph] = {}
        # the largest bucket's outputs, which every bucket's replay writes (module docstring);
        # a tuple like the function's (None where an output is not shared), None until captured
        self.outputs: tuple[torch.Tensor | None, ...] | None = None
        self._addresses: list[int] = []
        self.capture_seconds = 0.0
        self.reserved_bytes = 0  # what the capture added to the device's reserved memory

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def views(self, size: int) -> dict[str, torch.Tensor]:
        return {name: buf[:size] for name, buf in self.static.items()}

    def fn(self, **views: torch.Tensor) -> Any:
        """What a bucket captures: ``forward`` on the bucket's static views, its outputs, while
        a capture runs, written into the bank's shared ones (``_share``); outside a capture
        (the eager warm-up) ``forward``'s own."""
        out = self.forward(**views)
        if getattr(_breakable._STATE, "capture", None) is None:
            return out
        return self._share(out, next(iter(views.values())).shape[0] if views else 0)

    def _share(self, out: Any, size: int) -> Any:
        """The first capture (the largest bucket's) keeps its outputs as the bank's; a later
        one copies each output into the leading ``size`` rows of the bank's and returns those
        views. An output that is not a tensor of ``size`` rows like the bank's stays its own."""
        parts = out if isinstance(out, tuple) else (out,)
        if self.outputs is None:
            if size == self.max_size:
                self.outputs = tuple(_rows_of(p, size) for p in parts)
            return out
        if len(parts) != len(self.outputs):
            return out
        shared = []
        for part, buf in zip(parts, self.outputs, strict=True):
            fits = (
                buf is not None
                and _rows_of(part, size) is not None
                and (part.shape[1:], part.dtype) == (buf.shape[1:], buf.dtype)
                and size <= buf.shape[0]
            )
            if not fits:
                shared.append(part)
                continue
            dst = buf[:size]
            if (part.data_ptr(), part.stride()) != (dst.data_ptr(), dst.stride()):
                dst.copy_(part)
            shared.append(dst)
        return tuple(shared) if isinstance(out, tuple) else shared[0]

    def _watched(self) -> list[torch.Tensor]:
        extra = list(self.guard_tensors()) if self.guard_tensors is not None else []
        outputs = [t for t in self.outputs or () if t is not None]  # written by address
        return list(self.static.values()) + outputs + extra

    def capture(self, warmup: bool = True, progress: bool = True) -> None:
        """Run every bucket eagerly (grows lazy workspaces, compiles every kernel variant),
        then capture every bucket, largest first; check the captures compiled nothing."""
        start = time.perf_counter()
        stream = torch.cuda.Stream()  # one capture stream for every bucket
        pool_before = torch.cuda.memory_reserved(self.device)
        sizes = sorted(self.sizes, reverse=True)
        if warmup:
            for size in sizes:
                with self.capture_context(size):
                    stream.wait_stream(torch.cuda.current_stream())  # inputs the context uploaded
                    with torch.cuda.stream(stream):
                        self.forward(**self.views(size))
                    # The context's tensors were allocated on the current stream and are freed
                    # as it exits: their blocks' next users there (the next bucket's upload)
                    # must wait for this bucket's kernels on the side stream, which read them.
                    torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
        compiles = self.compile_counter() if self.compile_counter is not None else 0
        # A cyclic-GC pass inside a capture may destroy another graph (or free its pool's
        # blocks) while this stream captures: collect now, and not again until done.
        gc.collect()
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            self._capture_all(sizes, stream, warmup, progress)
        finally:
            if gc_was_enabled:
                gc.enable()
        if self.compile_counter is not None and self.compile_counter() != compiles:
            raise GraphCaptureError(
                f"{self.name}: {self.compile_counter() - compiles} kernel(s) compiled during "
                "capture; the eager run of every bucket before capture should have compiled them"
            )
        torch.cuda.empty_cache()
        self._addresses = [t.data_ptr() for t in self._watched()]
        self.capture_seconds = time.perf_counter() - start
        self.reserved_bytes = torch.cuda.memory_reserved(self.device) - pool_before
        logger.info(
            "%s: captured %d buckets (%d..%d) in %.2f s, %.0f MiB reserved",
            self.name,
            len(self.sizes),
            self.sizes[0],
            self.max_size,
            self.capture_seconds,
            self.reserved_bytes / 2**20,
        )

    def _capture_all(self, sizes, stream, warmup: bool, progress: bool) -> None:
        bar = tqdm(sizes, desc=f"Capturing {self.name}", disable=not progress, leave=False)
        self.outputs = None  # the first (largest) capture's become the bank's
        for size in bar:
            free_before = torch.cuda.mem_get_info(self.device)[0]
            t0 = time.perf_counter()
            graph = BreakableGraph(pool=self.pool, split_at_breaks=self.split_at_breaks)
            with self.capture_context(size):
                graph.capture(self.fn, warmup=0 if warmup else 1, stream=stream, **self.views(size))
            self.graphs[size] = graph
            used = free_before - torch.cuda.mem_get_info(self.device)[0]
            logger.debug(
                "%s bucket %d: %d segments, %.0f ms, %.1f MiB",
                self.name,
                size,
                graph.num_segments,
                (time.perf_counter() - t0) * 1e3,
                used / 2**20,
            )

    def check_guard(self) -> None:
        """Every buffer watched at capture is where it was. Watch lists may grow at the end
        (a workspace outgrown after capture keeps its old buffer alive and adds a new one)."""
        now = [t.data_ptr() for t in self._watched()]
        if now[: len(self._addresses)] != self._addresses:
            moved = [
                i for i, (a, b) in enumerate(zip(now, self._addresses, strict=False)) if a != b
            ]
            raise GraphAddressError(
                f"{self.name}: {len(moved) or 'some'} buffer(s) read by address moved since capture "
                f"(watched #{moved[:5]}; {len(now)} now vs {len(self._addresses)} at capture)"
            )

    def replay(self, size: int, n: int, **live: torch.Tensor) -> Any:
        """Replay bucket ``size`` (captured, >= ``n``) on ``n`` live rows -> its output, all
        ``size`` rows (the first ``n`` are the live ones')."""
        graph = self.graphs[size]
        copies: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for spec in self.inputs:
            buf, src = self.static[spec.name], live[spec.name]
            dst, srcs = copies.setdefault((buf.dtype, src.dtype, src.device), ([], []))
            dst.append(buf[:n])
            srcs.append(src)
            # rows past n hold the pad value except up to the high-water mark of live rows
            dirty = self._dirty_rows[spec.name]
            if dirty > n:
                buf[n:dirty].fill_(spec.pad_value)
            self._dirty_rows[spec.name] = n
        # the live rows in one launch per dtype pair (a multi-tensor copy), not one per input
        for dst, srcs in copies.values():
            torch._foreach_copy_(dst, srcs, non_blocking=True)
        if self.check_addresses:
            self.check_guard()
        return graph.replay()


def _rows_of(x: Any, size: int) -> torch.Tensor | None:
    """``x`` if it is a tensor of ``size`` rows, else None."""
    return x if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == size else None
