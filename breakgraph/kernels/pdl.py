"""Programmatic dependent launch (Hopper and later) inside small decode graphs.

A kernel launched with it may be scheduled while its predecessor in the stream is still
running, once every program of the predecessor has said so (``griddepcontrol.
launch_dependents``) or exited; it then waits (``griddepcontrol.wait``) until the
predecessor has completed and its writes are visible. Inside a decode graph of a few hundred
kernels of a few µs each, that hides each launch's ramp behind the tail of the kernel before
it (#19: the step is paced by those, not by the bytes).

The kernels that take part have a ``PDL: tl.constexpr = False`` parameter and call
:func:`enter` first thing: every program waits before it reads anything a predecessor may
write, so a grid never completes before its own predecessor did (the chain stays ordered
for kernels further down), then lets its successor be scheduled. Their launch sites add
``**launch(device)``: nothing unless enabled on a CUDA device of compute capability 9+, so
the CPU, the interpreter and older GPUs run exactly the plain kernels. Kernels without it
(cuBLAS, torch's) launch as always, after their predecessor completes.

A kernel may read before its wait what no predecessor writes: when it runs at all, its
predecessor has passed its own wait, so every kernel before that one is complete (decode
attention so reads its lengths and request index). Prefetching more before the wait was
measured and dropped: the GEMMs asking L2 for
their weight lines and decode attention for its keys made Llama-3.1-8B's batch-1 step 1.22x
slower (4.55 -> 5.56 ms) and Qwen3-0.6B's no faster; the early lines compete with the
predecessor's own reads.

When (``BREAKGRAPH_PDL``, read at each launch): ``auto`` (default) inside the decode graphs of
at most ``AUTO_MAX_BATCH`` rows, captured under :func:`scope`; ``1`` every launch; ``0`` none.
An H200 (``bench decode --profile`` with ``BREAKGRAPH_PDL`` 0 and 1)
measured batch 1 faster with it (qwen3-0.6b 1.294 -> 1.197 ms at 1K context, 1.646 -> 1.534 at
8K; llama-3.1-8b 4.914 -> 4.674, 5.203 -> 5.070), qwen3-0.6b batch 2 and 4 too (1.445 -> 1.370,
1.557 -> 1.457), batch 8 slower (1.768 -> 1.827, 5.291 -> 5.370); 32 and 64 within 2%.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from breakgraph.common import envs

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU-only install: no kernel calls enter()
    triton = None

AUTO_MAX_BATCH = 4  # decode graphs of at most this many rows use it under "auto"
_in_scope = False  # set by scope(): launches now are a small decode graph's


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


@contextlib.contextmanager
def scope(batch_size: int):
    """Launches inside are a decode graph's of ``batch_size`` rows (``auto`` decides by it)."""
    global _in_scope
    before, _in_scope = _in_scope, batch_size <= AUTO_MAX_BATCH
    try:
        yield
    finally:
        _in_scope = before


def enabled() -> bool:
    """Whether a launch now takes PDL (before the device check)."""
    mode = envs.PDL.get()
    return mode == "1" or (mode == "auto" and _in_scope)


def launch(device: torch.device) -> dict:
    """Extra launch arguments for a kernel with a ``PDL`` parameter on ``device``."""
    if not enabled() or device.type != "cuda":
        return {}
    if not _capable(device.index if device.index is not None else torch.cuda.current_device()):
        return {}
    return {"PDL": True, "launch_pdl": True}


if triton is not None:

    @triton.jit
    def enter(PDL: tl.constexpr):
        """First thing in a kernel: wait for the predecessor, then let the successor in."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
