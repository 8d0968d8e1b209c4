"""Device scratch buffers for kernels that CUDA graphs capture: they grow, but never move
while in use.

A captured kernel keeps the address it was captured with, so an outgrown buffer is never
freed: growing allocates a new one for the launches to come and keeps the old one alive.
``buffers()`` lists every buffer ever handed out in allocation order, so a list taken earlier
is a prefix of a later one (what the graph banks' address guards compare)."""

from __future__ import annotations

import torch

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

    def get(
        self, name: str, n: int, dtype: torch.dtype, device: torch.device, zero: bool = False
    ) -> torch.Tensor:
        """The first ``n`` elements of buffer ``name`` on ``device`` (zero-filled when first
        allocated if ``zero``: kernels that leave it zeroed after each launch)."""
        key = (name, torch.device(device))
        buf = self._live.get(key)
        if buf is None or buf.numel() < n:
            make = torch.zeros if zero else torch.empty
            buf = self._live[key] = make(n, dtype=dtype, device=device)
            self._all.append(buf)
            if self._graph_held:
                _GRAPH_HELD.append(buf)
        return buf[:n]

    def buffers(self) -> list[torch.Tensor]:
        return list(self._all)
