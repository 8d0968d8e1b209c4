"""Free device memory filled with NaN bits: what a replay must never read (a graph reads its
inputs and workspaces by address, so memory freed after capture must not reach it)."""

from __future__ import annotations

import torch


def poison_free_memory(margin_bytes: int = 2 << 30) -> list[torch.Tensor]:
    """Fill the memory nobody holds with NaN bits: the allocator's cached free blocks, then,
    after dropping cuBLAS's workspaces and emptying the cache (what torch.compile's graph
    trees do), most of the device. Returns the poison (hold it while replaying)."""
    held = []
    for seg in torch.cuda.memory_snapshot():
        if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0):
            continue  # graph pools: owned by their graphs
        for block in seg["blocks"]:
            if block["state"] == "inactive":
                held.append(torch.empty(block["size"], dtype=torch.uint8, device="cuda"))
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info()[0]
    chunk = 1 << 30
    while free - chunk > margin_bytes:
        held.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
        free -= chunk
    for t in held:
        t.fill_(255)  # all-ones bits: NaN in bf16, fp16 and fp32
    torch.cuda.synchronize()
    return held
