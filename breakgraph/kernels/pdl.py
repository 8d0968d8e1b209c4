"""Programmatic dependent launch (Hopper and later), opt-in: ``BREAKGRAPH_PDL=1``.

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
(cuBLAS, torch's) launch as always, after their predecessor completes. Off by default until
an H200 run shows the decode step faster with it: ``BREAKGRAPH_PDL=1 breakgraph bench
decode --profile`` against the same command without.
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU-only install: no kernel calls enter()
    triton = None

ENABLED = os.environ.get("BREAKGRAPH_PDL", "0") == "1"


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def launch(device: torch.device) -> dict:
    """Extra launch arguments for a kernel with a ``PDL`` parameter on ``device``."""
    if not ENABLED or device.type != "cuda":
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
