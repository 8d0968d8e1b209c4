"""All-reduce, residual add and RMSNorm in one kernel, over symmetric memory (TP decode).

A row-parallel projection (o, down) ends each rank with a partial sum of the hidden states;
the layer then sums them over the ranks (the all-reduce), adds the residual and normalizes
for the next projection: three launches (a staging copy, the one-shot all-reduce, the norm),
each a few µs at decode's few rows. This kernel does all of it in one launch, one program
per row:

1. store the row's partial sum into this rank's symmetric buffer, in the slot of the row's
   call parity (``epoch % 2``);
2. signal every peer (the row's flag in the peer's flag array := epoch; release, system
   scope) and wait until every peer's flag for the row reaches the epoch (acquire);
3. sum the row over the ranks in rank order (the same float32 sum on every rank, so every
   rank gets the same bits), add the residual (one rounding, as ``fused_add_rms_norm``),
   store the new residual and the normalized row.

One barrier per call, not two: a rank can start call k + 1 (writing the other slot) while a
peer still reads call k's slot, but it cannot write call k's slot again (call k + 2) before
every peer has signalled call k + 1, which each does only after its call k is done. The
epochs are this rank's calls per row (a device counter, so CUDA-graph replays count too);
every rank makes the same calls, so their epochs agree. A flag compares wrap-safely.

The torch twin is the unfused sequence (``all_reduce`` then ``fused_add_rms_norm``); the
GPU test compares both against a float32 reference on two GPUs.
"""

from __future__ import annotations

import torch

try:  # Triton is optional: the CPU-only install never runs this kernel
    import triton
    import triton.language as tl
except ImportError:
    triton = None

_jit = triton.jit if triton is not None else (lambda fn: fn)


@_jit
def _all_reduce_add_rms_norm_kernel(
    x,  # [M, H] this rank's partial sums
    residual,  # [M, H] the residual stream
    weight,  # [H]
    out,  # [M, H] the normalized rows
    res_out,  # [M, H] the residual plus the sum
    buffers,  # int64 [WORLD]: each rank's data buffer (2 slots x SLOT elements)
    flags,  # int64 [WORLD]: each rank's flags, int32 [max rows, WORLD]
    epochs,  # int32 [max rows]: this rank's calls so far, per row
    n_cols,
    eps,
    SLOT: tl.constexpr,  # elements per parity slot
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    epoch = tl.load(epochs + row) + 1
    tl.store(epochs + row, epoch)
    at = (epoch % 2) * SLOT + row.to(tl.int64) * n_cols + offs
    part = tl.load(x + row.to(tl.int64) * n_cols + offs, mask=mask, other=0.0)
    mine = tl.load(buffers + RANK).to(tl.pointer_type(x.dtype.element_ty))
    tl.store(mine + at, part, mask=mask)
    tl.debug_barrier()  # every thread's store before the signal (released at system scope)
    for r in tl.static_range(WORLD):
        if r != RANK:
            peer_flags = tl.load(flags + r).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(peer_flags + row * WORLD + RANK, epoch, sem="release", scope="sys")
    my_flags = tl.load(flags + RANK).to(tl.pointer_type(tl.int32))
    for r in tl.static_range(WORLD):
        if r != RANK:
            seen = tl.atomic_add(my_flags + row * WORLD + r, 0, sem="acquire", scope="sys")
            while seen - epoch < 0:  # wrap-safe: int32 epochs
                seen = tl.atomic_add(my_flags + row * WORLD + r, 0, sem="acquire", scope="sys")
    tl.debug_barrier()  # the peers' rows are visible to every thread from here
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for r in tl.static_range(WORLD):
        if r == RANK:
            acc += part.to(tl.float32)
        else:
            peer = tl.load(buffers + r).to(tl.pointer_type(x.dtype.element_ty))
            acc += tl.load(peer + at, mask=mask, other=0.0, volatile=True).to(tl.float32)
    summed = acc.to(x.dtype.element_ty)  # the all-reduce's output, rounded as it would be
    at_row = row.to(tl.int64) * n_cols + offs
    r_in = tl.load(residual + at_row, mask=mask, other=0.0)
    h = (summed.to(tl.float32) + r_in.to(tl.float32)).to(x.dtype.element_ty)
    tl.store(res_out + at_row, h, mask=mask)
    hf = h.to(tl.float32)
    variance = tl.sum(hf * hf, 0) / n_cols
    normed = (hf * tl.rsqrt(variance + eps)).to(h.dtype)
    w = tl.load(weight + offs, mask=mask, other=0.0)
    y = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out + at_row, y.to(out.dtype.element_ty), mask=mask)


def all_reduce_add_rms_norm_triton(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    buffers: torch.Tensor,
    flags: torch.Tensor,
    epochs: torch.Tensor,
    slot_elems: int,
    rank: int,
    world: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(s), s)`` with ``s`` the sum over ranks of ``x`` plus ``residual``, as
    ``fused_add_rms_norm`` of the all-reduced ``x``. ``x``, ``residual`` contiguous [M, H] of
    one dtype, M <= ``epochs``' length, M * H <= ``slot_elems``; every rank calls it alike
    (see the module doc)."""
    m, h = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(residual)
    block = triton.next_power_of_2(h)
    _all_reduce_add_rms_norm_kernel[(m,)](
        x, residual, weight, out, res_out, buffers, flags, epochs, h, eps,
        SLOT=slot_elems, RANK=rank, WORLD=world, BLOCK=block,
        num_warps=max(1, min(16, block // 512)),
    )  # fmt: skip
    return out, res_out
