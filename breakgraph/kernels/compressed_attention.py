"""Compressed attention over a paged cache (DeepSeek V4): torch versions of its three ops.

- ``pool_windows``: a compressor's softmax pooling of each window of ``ratio`` tokens into
  one entry, over a step's rows and a per-request state that carries the window still
  open between steps (online softmax: per channel the running max, the sum of weights and
  the weighted sum, float32). With ``overlap`` (CSA) every token feeds two entries: the
  first half of its channels the next window's entry, the second half its own window's.
- ``indexer_scores``: the lightning indexer's score of every compressed entry a row may
  see, ``sum_h w_h relu(q_h . k_e)``, ``-inf`` for entries it may not see yet.
- ``sparse_attention``: each row over its sliding window of keys (K = V, one head) and
  compressed entries (all it may see, or the indexer's picks), with a sink logit per head.

Entry ``e`` of a request (the window of positions ``[e r, (e + 1) r)``) lives in the cache
row of the window's last token's slot, so one request-table lookup finds it; a row at
position ``p`` may see the entries of the windows closed by then, ``e < (p + 1) // r``.

The torch versions process rows in chunks of ``ROW_CHUNK`` so the gathered keys stay
bounded. The Triton kernels read keys through the request table (nothing gathered):
``sparse_attention`` and ``indexer_scores`` a program per row, ``pool_windows`` a program
per (request, window) pair, which writes only the closing rows' entries (the others stay 0).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from breakgraph.kernels.fused import (  # the pair rotation: the rope kernels' own
    _rotate_pairs,
    norm_rope_tail_torch,
    norm_rope_tail_triton,
    rope_tail_torch,
    rope_tail_triton,
)
from breakgraph.kernels.launch import sm_count

try:  # Triton is optional: the CPU-only install runs the torch versions
    import triton
    import triton.language as tl
except ImportError:
    triton = None

_jit = triton.jit if triton is not None else (lambda fn: fn)


def _jit_live(*names: str):
    """``triton.jit`` with the integer arguments ``names`` not specialized: they follow the
    live step (picks per row, entries, windows per request), and a new value class (1, a
    multiple of 16, other) would otherwise compile a variant in traffic."""
    if triton is None:
        return lambda fn: fn
    return lambda fn: triton.jit(fn, do_not_specialize=list(names))


ROW_CHUNK = 256


@dataclass
class CompressedStep:
    """One step's rows as the compressed-attention ops read them (device tensors, built
    once per step; ``max_extend`` and ``max_seq`` are host ints)."""

    positions: torch.Tensor  # [T] int64
    row_req: torch.Tensor  # [T] int64, the step-local request of each row
    req_rows: torch.Tensor  # [B] int64, each request's row of the request table
    start_pos: torch.Tensor  # [B] int64, each request's first position this step
    end_pos: torch.Tensor  # [B] int64, one past its last
    fresh: torch.Tensor  # [B] bool: its compressors start from no state
    req_to_token: torch.Tensor  # [R, C] int32
    max_extend: int
    max_seq: int
    # what the layers derive from the step once and share (``derive``)
    derived: dict = field(default_factory=dict, repr=False)

    def derive(self, key, make):
        """``make()``, computed at the first layer that asks for ``key``, kept for the step."""
        value = self.derived.get(key)
        if value is None:
            value = self.derived[key] = make()
        return value

    @functools.cached_property
    def fresh_i8(self) -> torch.Tensor:
        """``fresh`` as int8 (what the pooling kernel reads)."""
        return self.fresh.to(torch.int8)

    @functools.cached_property
    def token_rows(self) -> torch.Tensor:
        """[T] int64: each row's request-table row."""
        return self.req_rows[self.row_req]

    @functools.cached_property
    def row_start(self) -> torch.Tensor:
        """[B] int64: each request's first row in the step."""
        n = self.end_pos - self.start_pos
        return n.cumsum(0) - n


def pool_windows_torch(
    kv: torch.Tensor,
    score: torch.Tensor,
    state: torch.Tensor,
    ratio: int,
    overlap: bool,
    step: CompressedStep,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """kv, score [T, C] (C = D, or 2D with ``overlap``), state [R, S, 3, D] float32 (S = 2
    with overlap: the open window's entry and the next one's) -> each row's pooled window
    [T, D] float32: for a row that closes its window, that window's entry before the norm;
    other rows get their partial window (the caller stores only the closing rows').
    ``state`` rows of the step's requests are read (unless ``fresh``) and rewritten.
    ``out``: written and returned instead of a new tensor (the kernel leaves the rows that
    close no window as they are)."""
    t_rows, c = kv.shape
    d = c // 2 if overlap else c
    b = step.start_pos.shape[0]
    span = step.max_extend // ratio + 3  # windows a request's rows and state may touch
    base = step.start_pos // ratio
    win = step.positions // ratio
    seg_own = step.row_req * span + (win - base[step.row_req])
    kv, score = kv.float(), score.float()
    if overlap:  # [:D] feeds the next window's entry, [D:] its own
        segs = torch.cat([seg_own, seg_own + 1])
        logits = torch.cat([score[:, d:], score[:, :d]])
        values = torch.cat([kv[:, d:], kv[:, :d]])
    else:
        segs, logits, values = seg_own, score, kv
    n_state = state.shape[1]
    carried = state[step.req_rows]  # [B, S, 3, D]
    st_seg = (torch.arange(b, device=kv.device)[:, None] * span
              + torch.arange(n_state, device=kv.device)).reshape(-1)  # fmt: skip
    st_max = carried[:, :, 0].masked_fill(step.fresh[:, None, None], float("-inf"))
    st_max = st_max.reshape(-1, d)
    n_seg = b * span
    peak = torch.full((n_seg, d), float("-inf"), device=kv.device)
    peak.scatter_reduce_(0, segs[:, None].expand(-1, d), logits, "amax")
    peak.scatter_reduce_(0, st_seg[:, None].expand(-1, d), st_max, "amax")
    peak_safe = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    w = torch.exp(logits - peak_safe[segs])
    total = torch.zeros((n_seg, d), device=kv.device).index_add_(0, segs, w)
    acc = torch.zeros((n_seg, d), device=kv.device).index_add_(0, segs, w * values)
    st_w = torch.exp(st_max - peak_safe[st_seg])  # 0 for an empty or ignored state
    total.index_add_(0, st_seg, st_w * carried[:, :, 1].reshape(-1, d))
    acc.index_add_(0, st_seg, st_w * carried[:, :, 2].reshape(-1, d))
    pooled = acc[seg_own] / total[seg_own]
    # the windows open at each request's next position (and the next one's, with overlap)
    end_seg = (torch.arange(b, device=kv.device) * span + step.end_pos // ratio - base)[:, None]
    new_seg = end_seg + torch.arange(n_state, device=kv.device)
    state[step.req_rows] = torch.stack([peak[new_seg], total[new_seg], acc[new_seg]], dim=2)
    if out is not None:
        return out.copy_(pooled)
    return pooled


def window_score_torch(
    gate: torch.Tensor, position_bias: torch.Tensor, slot_in_window: torch.Tensor
) -> torch.Tensor:
    """A compressor's pooling logits: ``gate`` [T, C] (its projection's output) in float32
    plus the bias [ratio, C] of each row's slot in its window (``slot_in_window`` [T])."""
    return gate.float() + position_bias[slot_in_window]


def window_score_triton(
    gate: torch.Tensor, position_bias: torch.Tensor, slot_in_window: torch.Tensor
) -> torch.Tensor:
    """Triton twin of :func:`window_score_torch`: one launch (not a cast, a gather and an
    add), float32 as the twin."""
    t, c = gate.shape
    out = torch.empty((t, c), dtype=torch.float32, device=gate.device)
    if t == 0:
        return out
    assert gate.stride(-1) == 1 and position_bias.is_contiguous()
    block = min(1024, triton.next_power_of_2(c))
    _window_score_kernel[(t, triton.cdiv(c, block))](
        gate, position_bias, slot_in_window, out, gate.stride(0), c, BLOCK=block, num_warps=4
    )
    return out


@_jit
def _window_score_kernel(gate, bias, slot, out, stride_g, c, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < c
    at = tl.load(slot + row).to(tl.int64)
    g = tl.load(gate + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(bias + at * c + offs, mask=mask, other=0.0)
    tl.store(out + row * c + offs, g + b, mask=mask)


def _visible_entries(step: CompressedStep, ratio: int, rows: slice) -> tuple[torch.Tensor, ...]:
    """(entry ids [n, E], visible [n, E], their cache slots [n, E]) of ``rows``: every entry
    ``e < max_seq // ratio``, visible where its window closed by the row's position."""
    n_entries = max(step.max_seq // ratio, 1)
    pos = step.positions[rows]
    e = torch.arange(n_entries, device=pos.device)
    visible = e[None, :] < ((pos + 1) // ratio)[:, None]
    last_pos = (e * ratio + ratio - 1).clamp(max=step.req_to_token.shape[1] - 1)
    slots = step.req_to_token[step.token_rows[rows][:, None], last_pos[None, :]]
    return e.expand(pos.shape[0], -1), visible, slots.long()


def indexer_scores_torch(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    step: CompressedStep,
    ratio: int,
    scale: float,
    weight_scale: float = 1.0,
) -> torch.Tensor:
    """q [T, H, Di], weights [T, H], index_cache [slots, Di] -> float32 [T, E]
    (E = ``max_seq // ratio``): ``sum_h w_h relu(q_h . k_e) * scale`` with w the weights in
    float32 times ``weight_scale``, ``-inf`` where entry e is not visible to the row. Under
    TP each rank sums its heads and the ranks' sums are all-reduced (an entry no row sees
    stays ``-inf``)."""
    t_rows = q.shape[0]
    out = []
    for lo in range(0, t_rows, ROW_CHUNK):
        rows = slice(lo, min(lo + ROW_CHUNK, t_rows))
        _, visible, slots = _visible_entries(step, ratio, rows)
        keys = index_cache[slots].float()  # [n, E, Di]
        dots = torch.einsum("nhd,ned->nhe", q[rows].float(), keys).relu() * scale
        s = torch.einsum("nhe,nh->ne", dots, weights[rows].float() * weight_scale)
        out.append(s.masked_fill(~visible, float("-inf")))
    return torch.cat(out) if out else q.new_zeros((0, max(step.max_seq // ratio, 1)))


def sparse_attention_torch(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    comp_cache: torch.Tensor | None,
    step: CompressedStep,
    window: int,
    ratio: int,
    picks: torch.Tensor | None,
    sinks: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    rope: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    q_scratch: bool = False,
) -> torch.Tensor:
    """q [T, H, D] over each row's last ``window`` keys of ``kv_cache`` [slots, 1, D] (K = V)
    and, with ``comp_cache`` [slots, D], its visible compressed entries (``picks`` [T, k]:
    the indexer's top-k as it comes, any entry -1 or not visible yet skipped; None: all
    visible), softmax with a sink logit per head (``sinks`` [H]) -> [T, H, D] in q's dtype
    (into ``out`` where given). ``rope`` (cos, sin [T, r / 2], eps): DeepSeek V4's q as the
    projection leaves it, normed (unweighted, ``eps``) and roped on its last r channels
    first, and the output's rope undone at the row's position (V = K carries it).
    ``q_scratch``: the caller reads q no more, so a kernel may norm and rope it in place
    (here it is not)."""
    t_rows, heads, d = q.shape
    out = torch.empty_like(q) if out is None else out
    if rope is not None:
        cos, sin, eps = rope
        q = norm_rope_tail_torch(q, None, eps, cos, sin)
    offs = torch.arange(window, device=q.device)
    width = step.req_to_token.shape[1]
    for lo in range(0, t_rows, ROW_CHUNK):
        rows = slice(lo, min(lo + ROW_CHUNK, t_rows))
        pos = step.positions[rows]
        table = step.token_rows[rows]
        key_pos = pos[:, None] - window + 1 + offs[None, :]
        ok = key_pos >= 0
        slots = step.req_to_token[table[:, None], key_pos.clamp(0, width - 1)].long()
        keys = kv_cache[slots, 0].float()  # [n, W, D]
        if comp_cache is not None:
            if picks is None:
                _, visible, cslots = _visible_entries(step, ratio, rows)
            else:
                p = picks[rows]
                visible = (p >= 0) & (p < ((pos + 1) // ratio)[:, None])
                last_pos = (p.clamp(min=0) * ratio + ratio - 1).clamp(max=width - 1)
                cslots = step.req_to_token[table[:, None], last_pos].long()
            keys = torch.cat([keys, comp_cache[cslots].float()], dim=1)
            ok = torch.cat([ok, visible], dim=1)
        logits = torch.einsum("nhd,nkd->nhk", q[rows].float(), keys) * scale
        logits = logits.masked_fill(~ok[:, None, :], float("-inf"))
        sink = sinks.float()[None, :, None].expand(logits.shape[0], -1, 1)
        combined = torch.cat([logits, sink], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1)[..., :-1]
        o = torch.einsum("nhk,nkd->nhd", probs, keys).to(q.dtype)
        out[rows] = o if rope is None else rope_tail_torch(o, cos[rows], sin[rows], inverse=True)
    return out


# ---------------------------------------------------------------------------- Triton


@_jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:  # float32 models: no TF32 rounding
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@_jit
def _unrope_stored(row, h_ok, cos_row, sin_row, D: tl.constexpr, HALF: tl.constexpr):
    """The rope of rows of heads already stored (``row`` [BLOCK_H, 1] pointers) undone on
    their last ``2 * HALF`` channels where they lie: every value and its partner read once
    the whole program has stored (a barrier), written back once all have read (another);
    a shuffle of the accumulator in registers would take a tile of shared memory."""
    rel = tl.arange(0, 2 * HALF)
    ch = D - 2 * HALF + rel
    even = rel % 2 == 0
    tl.debug_barrier()
    v = tl.load(row + ch[None, :], mask=h_ok[:, None], other=0.0)
    p = tl.load(row + tl.where(even, ch + 1, ch - 1)[None, :], mask=h_ok[:, None], other=0.0)
    vf = _rotate_pairs(v.to(tl.float32), p.to(tl.float32), cos_row, sin_row, rel[None, :],
                       even[None, :], (rel >= 0)[None, :], True)  # fmt: skip
    tl.debug_barrier()
    tl.store(row + ch[None, :], vf.to(v.dtype), mask=h_ok[:, None])


@_jit
def _attend_block(q, cache, slot, stride, d, ok, m_i, l_i, acc, scale, IEEE: tl.constexpr):
    """One block of keys (the cache's rows ``slot``; ``ok`` masks them; K = V) into the
    online softmax of a block of heads: running max ``m_i``, sum ``l_i`` and output ``acc``
    [BLOCK_H, D]."""
    keys = tl.load(cache + slot[:, None] * stride + d[None, :], mask=ok[:, None], other=0.0)
    logits = _dot(q, tl.trans(keys), IEEE) * scale
    logits = tl.where(ok[None, :], logits, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(logits, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(logits - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(keys.dtype), keys, IEEE)
    return m_new, l_i, acc


@_jit
def _window_slots(pos, j0, n, table, WINDOW: tl.constexpr):
    """Slots of keys ``j0 + n`` of the sliding window ending at ``pos``, oldest first, and
    their mask."""
    kp = pos - WINDOW + 1 + j0 + n
    ok = (kp >= 0) & (j0 + n < WINDOW)
    slot = tl.load(table + tl.maximum(kp, 0), mask=ok, other=0).to(tl.int64)
    return slot, ok


@_jit_live("n_picks", "stride_picks")
def _sparse_attention_kernel(
    q,
    kv_cache,
    comp_cache,
    out,
    part_o,
    part_lse,
    positions,
    token_rows,
    req_to_token,
    picks,
    sinks,
    heads,
    table_width,
    n_picks,
    stride_qt,
    stride_qh,
    stride_kv,
    stride_comp,
    stride_table,
    stride_picks,
    scale,
    cos,
    sin,
    stride_c,
    eps,
    WINDOW: tl.constexpr,
    RATIO: tl.constexpr,
    MODE: tl.constexpr,  # 0: window only, 1: + every visible entry, 2: + the picked entries
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    IEEE: tl.constexpr,
    ROPE: tl.constexpr,  # q normed and roped here, the output's rope undone (HALF pairs)
    HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    h_ok = h < heads
    d = tl.arange(0, D)
    pos = tl.load(positions + t)
    row = tl.load(token_rows + t).to(tl.int64)
    table = req_to_token + row * stride_table
    q_tile = tl.load(
        q + t * stride_qt + h[:, None] * stride_qh + d[None, :], mask=h_ok[:, None], other=0.0
    )
    if ROPE:  # fused.norm_rope_tail's arithmetic (the norm's scale and product rounded)
        qf = q_tile.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(qf * qf, 1) / D + eps).to(q_tile.dtype).to(tl.float32)[:, None]
        y = (qf * rstd).to(q_tile.dtype)
        a, b = tl.split(tl.reshape(y, (BLOCK_H, D // 2, 2)))
        k = tl.arange(0, D // 2) - (D // 2 - HALF)
        c = tl.load(cos + t * stride_c + k, mask=k >= 0, other=1.0)[None, :]
        s = tl.load(sin + t * stride_c + k, mask=k >= 0, other=0.0)[None, :]
        a, b = a.to(tl.float32), b.to(tl.float32)
        a2 = (a * c - b * s).to(q_tile.dtype)
        b2 = (b * c + a * s).to(q_tile.dtype)
        q_tile = tl.reshape(tl.join(a2, b2), (BLOCK_H, D))
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, D), tl.float32)
    n = tl.arange(0, BLOCK_N)
    # the row's key blocks: the window's, then its entries' (every visible one, or the
    # picks); a split takes a contiguous run of them
    visible = (pos + 1) // RATIO
    window_blocks: tl.constexpr = (WINDOW + BLOCK_N - 1) // BLOCK_N
    entries = 0
    if MODE == 1:
        entries = visible
    if MODE == 2:
        entries = n_picks
    blocks = window_blocks + tl.cdiv(entries, BLOCK_N)
    per = tl.cdiv(blocks, SPLITS)
    lo = split * per
    hi = tl.minimum(lo + per, blocks)
    # the window's blocks from the first that holds a key (position >= 0): a block of
    # masked keys only would leave the online softmax's max at -inf (exp(-inf + inf): NaN)
    first = (tl.maximum(WINDOW - 1 - pos, 0) // BLOCK_N).to(tl.int32)
    for b in range(tl.maximum(lo, first), tl.minimum(hi, window_blocks)):  # oldest first
        slot, ok = _window_slots(pos, b * BLOCK_N, n, table, WINDOW)
        m_i, l_i, acc = _attend_block(
            q_tile, kv_cache, slot, stride_kv, d, ok, m_i, l_i, acc, scale, IEEE
        )
    for b in range(tl.maximum(lo, window_blocks), hi):
        j = (b - window_blocks) * BLOCK_N + n
        if MODE == 1:  # every entry whose window closed by this row
            e = j
            ok = e < visible
        else:  # the indexer's picks (-1 or not visible yet: none)
            e = tl.load(picks + t * stride_picks + j, mask=j < n_picks, other=-1)
            ok = (e >= 0) & (e < visible)
        # the top-k comes sorted by score: the entries a row cannot see yet (-inf) are its
        # last picks, whole blocks of them skipped here
        if tl.max(ok.to(tl.int32), 0) > 0:
            last = tl.minimum(tl.maximum(e, 0) * RATIO + RATIO - 1, table_width - 1)
            slot = tl.load(table + last, mask=ok, other=0).to(tl.int64)
            m_i, l_i, acc = _attend_block(
                q_tile, comp_cache, slot, stride_comp, d, ok, m_i, l_i, acc, scale, IEEE
            )
    if SPLITS == 1:
        sink = tl.load(sinks + h, mask=h_ok, other=0.0)
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.exp(sink - m_new)
        o = (acc * alpha[:, None] / l_i[:, None]).to(out.dtype.element_ty)
        row = out + t * stride_qt + h[:, None] * stride_qh
        tl.store(row + d[None, :], o, mask=h_ok[:, None])
        if ROPE:
            _unrope_stored(row, h_ok, cos + t * stride_c, sin + t * stride_c, D, HALF)
    else:  # this split's partial: its output and log-sum-exp ([T, H, SPLITS] rows of D)
        seen = l_i > 0
        o = acc / tl.where(seen, l_i, 1.0)[:, None]
        lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), -1.0e30)
        part = (t * heads + h) * SPLITS + split
        tl.store(part_o + part[:, None] * D + d[None, :], o, mask=h_ok[:, None])
        tl.store(part_lse + part, lse, mask=h_ok)


@_jit
def _sparse_merge_kernel(
    part_o, part_lse, sinks, out, heads, stride_ot, stride_oh, cos, sin, stride_c,
    D: tl.constexpr, SPLITS: tl.constexpr, ROPE: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    """One (row, head): its splits' partials merged by log-sum-exp, the sink (a key whose
    value is 0) in the sum's denominator; ROPE: the output's rope undone."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    rows = (t * heads + h) * SPLITS + tl.arange(0, SPLITS)
    d = tl.arange(0, D)
    lse = tl.load(part_lse + rows)
    sink = tl.load(sinks + h)
    m = tl.maximum(tl.max(lse, 0), sink)
    w = tl.exp(lse - m)[:, None]
    denom = tl.sum(w, 0) + tl.exp(sink - m)
    o = tl.load(part_o + rows[:, None] * D + d[None, :])
    o = (tl.sum(o * w, 0) / denom).to(out.dtype.element_ty)
    if ROPE:  # each channel's pair partner merged the same way, then the rotation undone
        rel = d - (D - 2 * HALF)
        tail = rel >= 0
        even = d % 2 == 0
        at = tl.where(tail, tl.where(even, d + 1, d - 1), d)
        p = tl.load(part_o + rows[:, None] * D + at[None, :])
        p = (tl.sum(p * w, 0) / denom).to(out.dtype.element_ty).to(tl.float32)
        o = _rotate_pairs(o.to(tl.float32), p, cos + t * stride_c, sin + t * stride_c,
                          tl.maximum(rel, 0), even, tail, True).to(out.dtype.element_ty)  # fmt: skip
    tl.store(out + t * stride_ot + h * stride_oh + d, o)


# (heads a program, keys a block, warps, pipeline stages) of the sparse attention kernel, by
# ``bench kernels --v4-attention`` at V4-Flash's shapes (H100, ms): a step whose rows fill the
# GPU takes every head a program (the one K = V head's tiles loaded once, not per 16 heads):
# CSA 8K tokens 5.75 against 11.24 with 16 heads a program, HCA 1.63 against 2.58, CSA 1K over
# a 64K prefix 0.87 against 1.77; a decode step keeps 16 heads a program and splits each row's
# keys (sparse_splits): CSA at batch 1 0.026 against 0.164 in one split, batch 32 0.097
# against 0.164 (every head a program and 16 splits there: 0.101-0.110). Every head a program
# spills (255 registers, the [64, 512] float32 output tile); two programs a row each holding
# half the output's channels do not, and measured 2.0x the time (CSA 8K 11.6 ms: each
# recomputes the scores), four 3.7x.
PREFILL_SPARSE_CONFIG = (64, 32, 8, 2)
SPARSE_CONFIG = (16, 16, 4, 3)
MAX_SPLITS = 16


def sparse_splits(t_rows: int, heads: int, block_h: int, device: torch.device) -> int:
    """Splits of each row's keys: enough that a small step (a decode batch) has about two
    programs per SM; 1 (no merge) once the rows alone fill the GPU. Host sizes only."""
    if device.type != "cuda":
        return 1
    programs = t_rows * triton.cdiv(heads, block_h)
    sms = sm_count(device)
    if programs >= sms:
        return 1
    return min(MAX_SPLITS, triton.next_power_of_2(triton.cdiv(2 * sms, programs)))


def sparse_attention_triton(
    q, kv_cache, comp_cache, step, window, ratio, picks, sinks, scale, out=None, rope=None,
    q_scratch=False, config=None, splits=None,
):  # fmt: skip
    """Triton twin of :func:`sparse_attention_torch`: a program per row, block of heads (the
    one K = V head's tiles shared by them) and split of the row's keys, an online softmax
    over the window's keys and the entries; with one split the sink is added last, with
    several a merge kernel combines the splits' partials and the sink. No host sync: every
    bound is a device value or a shape. ``config``: the launch config, (heads a program, keys
    a block, warps, stages) (default
    :data:`PREFILL_SPARSE_CONFIG` where the rows fill the GPU, else :data:`SPARSE_CONFIG`);
    ``splits`` (a power of 2; default :func:`sparse_splits`)."""
    t_rows, heads, d = q.shape
    assert q.stride(2) == 1 and kv_cache.stride(2) == 1 and d & (d - 1) == 0
    out = torch.empty_like(q) if out is None else out
    assert out.stride(2) == 1 and out.stride()[:2] == q.stride()[:2]
    if t_rows == 0:
        return out
    mode = 0 if comp_cache is None else (1 if picks is None else 2)
    comp = kv_cache if comp_cache is None else comp_cache
    pk = step.positions if picks is None else picks.contiguous()
    if config is None:
        fills = sparse_splits(t_rows, heads, SPARSE_CONFIG[0], q.device) == 1
        config = PREFILL_SPARSE_CONFIG if fills and q.is_cuda else SPARSE_CONFIG
    block_h, block_n, warps, stages = config
    block_h = min(block_h, max(16, triton.next_power_of_2(heads)))  # TP: fewer heads a rank
    splits = splits or sparse_splits(t_rows, heads, block_h, q.device)
    sinks = sinks.float().contiguous()
    cos = sin = sinks
    eps, half = 0.0, 1
    # q's norm and rope (and the output's inverse) inside the kernel where its registers have
    # room (16 heads a program); every head a program spills more with them (255 registers,
    # 216 -> 344 bytes of stack) and measured slower than the two kernels beside it (an 8K
    # step's 20 V4 layers: the attention 99 ms with them inside, against ~68 without and ~16
    # for the two: H100, bench kernels --v4-attention and a profile of the same run)
    fold = rope is not None and block_h < PREFILL_SPARSE_CONFIG[0]
    if rope is not None:
        cos, sin, eps = rope
        cos, sin, half = cos[:t_rows].contiguous(), sin[:t_rows].contiguous(), cos.shape[1]
        assert cos.shape[0] == t_rows and half & (half - 1) == 0 and 2 * half <= d
        if not fold:  # in place where the caller gives q up (the prefill's: [T, 64, 512])
            scratch = q_scratch and q.is_contiguous()
            q = norm_rope_tail_triton(q, None, eps, cos, sin, in_place=scratch)
            assert q.stride()[:2] == out.stride()[:2]
    part_o = part_lse = out
    if splits > 1:
        part_o = torch.empty((t_rows, heads, splits, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((t_rows, heads, splits), dtype=torch.float32, device=q.device)
    _sparse_attention_kernel[(t_rows, triton.cdiv(heads, block_h), splits)](
        q, kv_cache, comp, out, part_o, part_lse, step.positions, step.token_rows,
        step.req_to_token, pk, sinks, heads, step.req_to_token.shape[1],
        0 if picks is None else picks.shape[1], q.stride(0), q.stride(1), kv_cache.stride(0),
        comp.stride(0), step.req_to_token.stride(0), 0 if picks is None else pk.stride(0), scale,
        cos, sin, cos.stride(0), eps, WINDOW=window, RATIO=max(ratio, 1), MODE=mode, D=d,
        BLOCK_H=block_h, BLOCK_N=block_n, SPLITS=splits, IEEE=q.dtype == torch.float32,
        ROPE=fold, HALF=half, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if splits > 1:
        _sparse_merge_kernel[(t_rows, heads)](
            part_o, part_lse, sinks, out, heads, out.stride(0), out.stride(1), cos, sin,
            cos.stride(0), D=d, SPLITS=splits, ROPE=fold, HALF=half, num_warps=4,
        )  # fmt: skip
    if rope is not None and not fold:  # the output's rope undone: its tail channels only
        rope_tail_triton(out, cos, sin, inverse=True, in_place=True)
    return out


@_jit_live("n_entries", "stride_o")
def _indexer_scores_kernel(
    q,
    weights,
    index_cache,
    out,
    positions,
    token_rows,
    req_to_token,
    heads,
    n_entries,
    table_width,
    stride_qt,
    stride_qh,
    stride_w,
    stride_k,
    stride_table,
    stride_o,
    scale,
    weight_scale,
    RATIO: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_E: tl.constexpr,
    IEEE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    d = tl.arange(0, D)
    pos = tl.load(positions + t)
    n_visible = (pos + 1) // RATIO
    visible = e < n_visible
    total = tl.zeros((BLOCK_E,), tl.float32)
    # a block past the row's visible entries scores nothing: under a decode graph the grid
    # covers every entry the request table can hold, most of them not there yet
    if tl.program_id(1) * BLOCK_E < n_visible:
        table = req_to_token + tl.load(token_rows + t).to(tl.int64) * stride_table
        last = tl.minimum(e * RATIO + RATIO - 1, table_width - 1)
        slot = tl.load(table + last, mask=visible, other=0).to(tl.int64)
        keys = tl.load(
            index_cache + slot[:, None] * stride_k + d[None, :], mask=visible[:, None], other=0.0
        )
        for h0 in range(0, heads, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            h_ok = h < heads
            q_tile = tl.load(
                q + t * stride_qt + h[:, None] * stride_qh + d[None, :],
                mask=h_ok[:, None],
                other=0.0,
            )
            dots = tl.maximum(_dot(q_tile, tl.trans(keys), IEEE), 0.0) * scale
            w = tl.load(weights + t * stride_w + h, mask=h_ok, other=0.0).to(tl.float32)
            total += tl.sum(dots * (w * weight_scale)[:, None], 0)
    total = tl.where(visible, total, float("-inf"))
    tl.store(out + t * stride_o + e, total, mask=e < n_entries)


# (heads a tile, entries a program, warps) of the indexer's scores kernel, by ``bench kernels
# --v4-attention`` at V4-Flash's shapes (H100, ms): 8K tokens 0.84 against 1.19 with
# (32, 64, 4) and 1.70 with (16, 32, 4); 1K over a 64K prefix 1.34 against 1.74 and 2.83;
# decode batch 32 0.018 against 0.023, batch 1 0.008 against 0.009
INDEXER_CONFIG = (32, 128, 4)


def indexer_scores_triton(
    q, weights, index_cache, step, ratio, scale, weight_scale=1.0, config=None
):  # fmt: skip
    """Triton twin of :func:`indexer_scores_torch`: a program per row and block of entries,
    the heads' dot products a tile of heads at a time (the weights read in their own dtype);
    ``config``: the launch config (default :data:`INDEXER_CONFIG`)."""
    t_rows, heads, d = q.shape
    n_entries = max(step.max_seq // ratio, 1)
    out = torch.empty((t_rows, n_entries), dtype=torch.float32, device=q.device)
    if t_rows == 0:
        return out
    assert q.stride(2) == 1 and index_cache.stride(1) == 1 and d & (d - 1) == 0
    assert weights.stride(1) == 1
    block_h, block_e, warps = config or INDEXER_CONFIG
    _indexer_scores_kernel[(t_rows, triton.cdiv(n_entries, block_e))](
        q, weights, index_cache, out, step.positions, step.token_rows, step.req_to_token, heads,
        n_entries, step.req_to_token.shape[1], q.stride(0), q.stride(1), weights.stride(0),
        index_cache.stride(0), step.req_to_token.stride(0), out.stride(0), scale, weight_scale,
        RATIO=ratio, D=d, BLOCK_H=block_h, BLOCK_E=block_e, IEEE=q.dtype == torch.float32,
        num_warps=warps,
    )  # fmt: skip
    return out


@_jit_live("span")
def _pool_kernel(
    kv,
    score,
    state,
    new_state,
    pooled,
    start_pos,
    end_pos,
    row_start,
    fresh,
    req_rows,
    span,
    stride_kv,
    stride_sc,
    stride_st,
    stride_p,
    D: tl.constexpr,
    RATIO: tl.constexpr,
    OVERLAP: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    b = pid // span
    local = pid % span
    c = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    c_ok = c < D
    p0 = tl.load(start_pos + b)
    p1 = tl.load(end_pos + b)
    r0 = tl.load(row_start + b)
    e = p0 // RATIO + local  # the entry (window) this program pools
    m_i = tl.full((BLOCK_D,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_D,), tl.float32)
    a_i = tl.zeros((BLOCK_D,), tl.float32)
    n_state: tl.constexpr = 2 if OVERLAP else 1
    if local < n_state:  # the carried state of the window open at p0 (and the next)
        if tl.load(fresh + b) == 0:
            st = state + tl.load(req_rows + b).to(tl.int64) * stride_st + local * 3 * D
            m_i = tl.load(st + c, mask=c_ok, other=float("-inf"))
            l_i = tl.load(st + D + c, mask=c_ok, other=0.0)
            a_i = tl.load(st + 2 * D + c, mask=c_ok, other=0.0)
    # this step's rows feeding entry e: its own window's (their second half with overlap)
    # and, with overlap, the previous window's first half
    lo = e * RATIO - RATIO if OVERLAP else e * RATIO
    for p in range(tl.maximum(lo, p0), tl.minimum(e * RATIO + RATIO, p1)):
        row = (r0 + p - p0).to(tl.int64)
        if OVERLAP:  # the previous window's rows give their first half, its own the second
            off = tl.where(p < e * RATIO, 0, D)
        else:
            off = 0
        x = tl.load(score + row * stride_sc + off + c, mask=c_ok, other=0.0).to(tl.float32)
        v = tl.load(kv + row * stride_kv + off + c, mask=c_ok, other=0.0).to(tl.float32)
        m_new = tl.maximum(m_i, x)
        alpha = tl.where(m_i == float("-inf"), 0.0, tl.exp(m_i - m_new))
        w = tl.exp(x - m_new)
        l_i = l_i * alpha + w
        a_i = a_i * alpha + w * v
        m_i = m_new
    close = e * RATIO + RATIO - 1
    if (close >= p0) & (close < p1):
        row = (r0 + close - p0).to(tl.int64)
        tl.store(pooled + row * stride_p + c, a_i / l_i, mask=c_ok)
    slot = e - p1 // RATIO  # 0: the window open at p1; 1 (overlap): the next one
    if (slot >= 0) & (slot < n_state):
        dst = new_state + b.to(tl.int64) * n_state * 3 * D + slot * 3 * D
        tl.store(dst + c, m_i, mask=c_ok)
        tl.store(dst + D + c, l_i, mask=c_ok)
        tl.store(dst + 2 * D + c, a_i, mask=c_ok)


def pool_windows_triton(kv, score, state, ratio, overlap, step, out=None):
    """Triton twin of :func:`pool_windows_torch`: each (request, window) pair's entry as an
    online softmax over its rows in the step and the carried state; a closing row gets its
    entry, other rows 0 (``out``'s other rows are left as they are); the new state is written
    beside the old, then copied over it."""
    t_rows, c = kv.shape
    d = c // 2 if overlap else c
    b = step.start_pos.shape[0]
    n_state = state.shape[1]
    if out is None:
        out = torch.zeros((t_rows, d), dtype=torch.float32, device=kv.device)
    pooled = out
    new_state = torch.empty((b, n_state, 3, d), dtype=torch.float32, device=kv.device)
    span = step.max_extend // ratio + 3
    score = score.contiguous()
    block_d = min(128, triton.next_power_of_2(d))
    _pool_kernel[(b * span, triton.cdiv(d, block_d))](
        kv, score, state, new_state, pooled, step.start_pos, step.end_pos, step.row_start,
        step.fresh_i8, step.req_rows, span, kv.stride(0), score.stride(0),
        state.stride(0), pooled.stride(0), D=d, RATIO=ratio, OVERLAP=overlap, BLOCK_D=block_d,
    )  # fmt: skip
    state[step.req_rows] = new_state
    return pooled
