"""Device scratch buffers for kernels that CUDA graphs capture: they grow, but never move
while in use.

A captured kernel keeps the address it was captured with, so an outgrown buffer is never
freed: growing allocates a new one for the launches to come and keeps the old one alive.
``buffers()`` lists every buffer ever handed out in allocation order, so a list taken earlier
is a prefix of a later one (what the graph banks' address guards compare).

Kernels that split a reduction over programs and let the last to finish combine the parts
(the skinny GEMM's split K) count arrivals in ``counters`` with :func:`last_to_arrive`, which
leaves each counter at zero for the next launch."""

from __future__ import annotations

import torch

try:  # Triton is optional: the CPU-only install runs the torch twins
    import triton
    import triton.language as tl
except ImportError:
    triton = None

_jit = triton.jit if triton is not None else (lambda fn: fn)

# every buffer of the workspaces made with ``graph_held=True`` (the kernels' module-wide
# defaults), in allocation order across them: what the graph banks' guards watch
_GRAPH_HELD: list[torch.Tensor] = []


def graph_held() -> list[torch.Tensor]:
    """The default workspaces' buffers, in allocation order (later ones append)."""
    return list(_GRAPH_HELD)


class Workspace:
    def __init__(self, graph_held: bool = False) -> None:
        self._live: dict[tuple[str, torch.device], torch.Tensor] = {}
        self._all: list[torch.Tensor] = []
        self._graph_held = graph_held

    def buffer(
        self, name: str, n: int, dtype: torch.dtype, device: torch.device, zero: bool = False
    ) -> torch.Tensor:
        """The first ``n`` elements of buffer ``name`` on ``device`` (zero-filled when first
        allocated if ``zero``: kernels that leave it zeroed after each launch)."""
        key = (name, device)
        buf = self._live.get(key)
        if buf is None or buf.numel() < n:
            make = torch.zeros if zero else torch.empty
            buf = self._live[key] = make(n, dtype=dtype, device=device)
            self._all.append(buf)
            if self._graph_held:
                _GRAPH_HELD.append(buf)
        return buf[:n]

    def counters(self, n: int, device: torch.device) -> torch.Tensor:
        """``n`` int32 arrival counters (:func:`last_to_arrive`), all zero between launches."""
        return self.buffer("counters", n, torch.int32, device, zero=True)

    def buffers(self) -> list[torch.Tensor]:
        return list(self._all)


@_jit
def last_to_arrive(counter, arrivals):
    """Count this program in at ``counter`` (a scalar pointer) once its part is stored; True
    for the last of ``arrivals`` programs, which resets the counter for the next launch.

    Every thread's stores happen before the arrival (barrier), and the acq_rel atomic releases
    them at GPU scope; the last arrival's acquire makes every part visible to its loads, which
    should bypass L1 (``cache_modifier=".cg"``). Nothing spin-waits: a fault cannot hang it."""
    tl.debug_barrier()
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    last = arrived == arrivals - 1
    if last:
        tl.store(counter, 0)
    return last
