"""The penalty pool's per-step apply (engine/penalties.py): repetition, frequency and
presence penalties, ``logit_bias`` and ``min_new_tokens``' banned tokens, from each row's pool
row, over a step's logits [B, V].

The torch twin gathers every pool tensor at the step's rows, so it holds about five [B, V]
float32 copies and four bool masks at its peak; inside a penalized decode graph that peak
stays in the graph pool for the server's life (1.2 GiB at Qwen3's vocabulary and 256 rows,
2.2 GiB at Gemma 4's). The Triton kernel reads each pool row in place and writes the output
once: one pass, no temporaries. Both compute in float32 in the same order, with IEEE
division and no FMA contraction, so their outputs are bit-identical (a neutral row's logits
come out unchanged).
"""

from __future__ import annotations

import torch

from breakgraph.kernels import pdl

try:  # Triton is optional: the CPU-only install runs the torch twin
    import triton
    import triton.language as tl
except ImportError:
    triton = None

_jit = triton.jit if triton is not None else (lambda fn: fn)

BLOCK = 2048  # vocabulary entries per program


def apply_penalties_torch(
    logits: torch.Tensor,
    rows: torch.Tensor,
    counts: torch.Tensor,
    prompt_seen: torch.Tensor,
    bias: torch.Tensor,
    banned: torch.Tensor,
    params: torch.Tensor,
    min_new: torch.Tensor,
    generated: torch.Tensor,
    drafted=None,
) -> torch.Tensor:
    """logits [B, V] and their pool rows [B] (int64) over the pool's tensors (counts [R, V]
    float32, prompt_seen [R, V] bool, bias [R, V] float32, banned [R, V] bool, params [R, 3]
    frequency / presence / repetition, min_new and generated [R] int32) -> float32 logits:
    a seen token's logit divided by the repetition penalty if positive, else multiplied;
    ``- count * frequency - (count > 0) * presence + bias``; a banned token -inf while the row
    has generated fewer than its ``min_new`` tokens. ``drafted`` (engine/penalties.py's
    ``Drafted``): a verify step's rows, each after the draft tokens before it."""
    # in place on the gathered copies: fewer [B, V] buffers (a graph's pool holds its peak)
    params = params[rows]
    freq, pres, rep = params[:, 0:1], params[:, 1:2], params[:, 2:3]
    counts = counts[rows]  # advanced indexing: a copy, free to overwrite
    generated = generated[rows]
    if drafted is not None:
        counts.index_put_(
            (drafted.rows, drafted.tokens), counts.new_ones(()).expand_as(drafted.rows),
            accumulate=True,
        )  # fmt: skip
        generated += drafted.before
    present = counts > 0
    seen = prompt_seen[rows]
    seen |= present
    out = torch.where(logits > 0, logits / rep, logits * rep)
    torch.where(seen, out, logits, out=out)
    out -= counts.mul_(freq)
    del counts
    out -= present.to(out.dtype).mul_(pres)
    out += bias[rows]
    seen = banned[rows]
    seen &= (generated < min_new[rows])[:, None]
    return out.masked_fill_(seen, float("-inf"))


def apply_penalties_triton(
    logits, rows, counts, prompt_seen, bias, banned, params, min_new, generated, drafted=None
) -> torch.Tensor:
    """Triton twin of :func:`apply_penalties_torch`; a verify step's ``drafted`` rows go to
    the twin (their counts change before the apply)."""
    if drafted is not None:
        return apply_penalties_torch(
            logits, rows, counts, prompt_seen, bias, banned, params, min_new, generated, drafted
        )
    b, vocab = logits.shape
    assert logits.stride(-1) == 1 and counts.is_contiguous() and bias.is_contiguous()
    assert prompt_seen.is_contiguous() and banned.is_contiguous() and params.is_contiguous()
    out = torch.empty((b, vocab), dtype=torch.float32, device=logits.device)
    if b == 0:
        return out
    _apply_penalties_kernel[(b, triton.cdiv(vocab, BLOCK))](
        logits, out, rows, counts, prompt_seen, bias, banned, params, min_new, generated,
        logits.stride(0), vocab, BLOCK=BLOCK, num_warps=8, enable_fp_fusion=False,
        **pdl.launch(logits.device),
    )  # fmt: skip
    return out


@_jit
def _apply_penalties_kernel(
    logits,
    out,
    rows,
    counts,
    prompt_seen,
    bias,
    banned,
    row_params,  # a kernel parameter named `params` breaks Triton's argument binder
    min_new,
    generated,
    stride_l,
    vocab,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,  # kernels/pdl.py
):
    pdl.enter(PDL)
    b = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < vocab
    r = tl.load(rows + b).to(tl.int64)
    freq = tl.load(row_params + r * 3)
    pres = tl.load(row_params + r * 3 + 1)
    rep = tl.load(row_params + r * 3 + 2)
    ban_now = tl.load(generated + r) < tl.load(min_new + r)
    x = tl.load(logits + b.to(tl.int64) * stride_l + offs, mask=mask, other=0.0).to(tl.float32)
    pool = r * vocab + offs
    c = tl.load(counts + pool, mask=mask, other=0.0)
    present = c > 0
    seen = (tl.load(prompt_seen + pool, mask=mask, other=0) != 0) | present
    penalized = tl.where(x > 0, tl.math.div_rn(x, rep), x * rep)
    o = tl.where(seen, penalized, x)
    o = o - c * freq
    o = o - present.to(tl.float32) * pres
    o = o + tl.load(bias + pool, mask=mask, other=0.0)
    drop = (tl.load(banned + pool, mask=mask, other=0) != 0) & ban_now
    o = tl.where(drop, float("-inf"), o)
    tl.store(out + b.to(tl.int64) * vocab + offs, o, mask=mask)
