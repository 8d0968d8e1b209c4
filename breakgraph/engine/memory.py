"""Where a rank's device memory goes: the KV pool's size from the budget
``--mem-fraction-static`` leaves, the one-line refusal when that budget cannot hold one
request of the full context, and the split (weights, KV, graph pools, the penalty pool, free)
that the startup log and ``/get_server_info`` report (``common.messages.MemoryReport``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from breakgraph.common.messages import MemoryReport

GIB = 2**30


class MemoryPlanError(RuntimeError):
    """The device cannot hold the model and the KV cache it needs: the message names the
    numbers and the flags to change, in one line."""


@dataclass(frozen=True)
class DeviceMemory:
    """A device's memory as ``torch.cuda.mem_get_info`` reports it, bytes."""

    free: int
    total: int

    @classmethod
    def of(cls, device: torch.device) -> DeviceMemory:
        free, total = torch.cuda.mem_get_info(device)
        return cls(free, total)


def kv_budget_slots(
    mem: DeviceMemory,
    fraction: float,
    slot_bytes: int,
    context_len: int,
    weights_bytes: int,
) -> int:
    """KV slots the budget holds: ``total x fraction`` less what is in use now (the weights
    and everything loaded with them); at least one request of ``context_len`` tokens, else a
    ``MemoryPlanError``."""
    used = mem.total - mem.free
    budget = mem.total * fraction - used
    need = slot_bytes * context_len
    if budget < need:
        raise MemoryPlanError(
            f"the KV cache for one {context_len}-token request needs {need / GIB:.2f} GiB, but "
            f"--mem-fraction-static {fraction} of {mem.total / GIB:.1f} GiB leaves "
            f"{max(budget, 0) / GIB:.2f} GiB beside the {used / GIB:.2f} GiB in use "
            f"(weights {weights_bytes / GIB:.2f} GiB; {mem.free / GIB:.2f} GiB free): raise "
            "--mem-fraction-static, lower --context-length, or set --max-total-tokens"
        )
    return int(budget // slot_bytes)


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def memory_log_line(m: MemoryReport) -> str:
    """The startup log's line of where the rank's memory went."""
    graphs = sum(m.graph_pool_bytes.values())
    banks = ", ".join(f"{k} {v / GIB:.2f}" for k, v in m.graph_pool_bytes.items() if v)
    line = (
        f"memory: weights {m.weights_bytes / GIB:.2f} GiB, KV {m.kv_bytes / GIB:.2f} GiB "
        f"({m.kv_tokens} tokens), graph pools {graphs / GIB:.2f} GiB"
        + (f" ({banks})" if banks else "")
        + f", penalty pool {m.penalty_pool_bytes / GIB:.2f} GiB"
    )
    if m.total_bytes:
        line += f", free {m.free_bytes / GIB:.2f} of {m.total_bytes / GIB:.1f} GiB"
    return line
