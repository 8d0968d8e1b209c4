"""The forward metadata of one step and the forward context the attention break reads.

A leaf module (imports only numpy, torch and the torch-only ``AttentionMeta``) so that layers
below the engine can read it."""

from __future__ import annotations

import contextlib
import enum
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from breakgraph.kernels.attention_meta import AttentionMeta

# token ids, slots, rows: a list of ints, a numpy int array or a CPU int tensor
IntSeq = Sequence[int] | np.ndarray | torch.Tensor


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill of new tokens, possibly over a cached prefix
    DECODE = "decode"  # one new token per request


@dataclass
class ForwardBatch:
    """Everything a forward needs: the flat token rows and per-request metadata.

    Token rows of all requests are concatenated (request r owns rows
    ``extend_start_loc[r] : extend_start_loc[r] + extend_lens[r]``). Device tensors
    are on the model's device; the ``*_cpu`` fields are host copies the scheduler
    already had (lists, or the slots as a CPU tensor), so nothing reads device values back
    during a step.
    """

    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64, KV slot of each new token (0 = padding)
    req_pool_indices: torch.Tensor  # [B] int64, row of each request in req_to_token
    seq_lens: torch.Tensor  # [B] int32, prefix + extend tokens
    prefix_lens: torch.Tensor  # [B] int32, tokens already in the KV cache
    extend_lens: torch.Tensor  # [B] int32, new tokens this step
    extend_start_loc: torch.Tensor  # [B] int32, first row of each request
    logits_rows: torch.Tensor  # [B] int64, the rows whose logits are returned (last per request)
    # host-side copies (python ints), known to the scheduler without a device sync
    seq_lens_cpu: list[int]
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    # host copies of the slots and table rows (``build`` keeps them as given: lists, numpy
    # arrays or a CPU tensor): what TP rank 0 sends the other ranks so that they rebuild the
    # step without reading device values
    out_cache_loc_cpu: IntSeq | None = None
    req_pool_indices_cpu: Sequence[int] | None = None
    # ``build(table_width=W)``: each new token's cell in the request table (row * W + column,
    # int64) and its slot as the table holds it (int32), uploaded with the step, so that the
    # step's table write is one kernel (``ReqToTokenPool.write_batch``)
    table_cells: torch.Tensor | None = None
    table_slots: torch.Tensor | None = None
    # a step whose positions only the device knows (engine/spec_chain.py's ``device_batch``):
    # request r's rows are at ``device_base[r] + 0, 1, ...`` and the host lengths are bounds;
    # TP rank 0 broadcasts it and the workers rebuild the step from it
    device_base: torch.Tensor | None = None
    # a few rows per request, each of which may run as a decode row (``as_decode_rows``):
    # speculative decoding's verify steps and a draft model's first step, which the decode
    # graphs replay (engine/graphs/dispatch.py)
    decode_rows: bool = False
    # per-step state the attention break derives once and every layer reuses: launch plans
    # keyed by what they depend on besides the step (heads, head_dim, scale, window)
    attention_plans: dict[tuple, Any] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _attention_meta: AttentionMeta | None = field(
        default=None, init=False, repr=False, compare=False
    )

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def max_extend_len(self) -> int:
        return max(self.extend_lens_cpu)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu)

    def attention_meta(self, req_to_token: torch.Tensor) -> AttentionMeta:
        """The step as the attention kernels read it, over the request table
        ``req_to_token``; built at the first layer and reused (host values, no device work)."""
        meta = self._attention_meta
        if meta is None or meta.req_to_token is not req_to_token:
            # decode: one row per request, and no key bound (decode kernels need none, and a
            # decode graph's capture batch carries placeholder host lengths)
            decode = self.mode is ForwardMode.DECODE
            exact = not decode and self.device_base is None  # host lengths, not bounds
            meta = self._attention_meta = AttentionMeta(
                req_to_token,
                self.req_pool_indices,
                self.seq_lens,
                self.extend_start_loc,
                self.extend_lens,
                max_extend_len=1 if decode else self.max_extend_len,
                max_seq_len=None if decode else self.max_seq_len,
                extend_lens_cpu=self.extend_lens_cpu if exact else None,
                seq_lens_cpu=self.seq_lens_cpu if exact else None,
            )
        return meta

    def tail(self) -> ForwardBatch:
        """The step restricted to each request's last row (``logits_rows``), attending to its
        whole context: the metadata of layers that only the LM head's rows need (the
        KV-shared layers of Gemma 4, which store no KV). Device ops only, no host sync."""
        rows, b = self.logits_rows, self.batch_size
        device = rows.device
        return ForwardBatch(
            mode=self.mode,
            input_ids=self.input_ids[rows],
            positions=self.positions[rows],
            out_cache_loc=self.out_cache_loc[rows],
            req_pool_indices=self.req_pool_indices,
            seq_lens=self.seq_lens,
            prefix_lens=self.seq_lens - 1,
            extend_lens=torch.ones(b, dtype=torch.int32, device=device),
            extend_start_loc=torch.arange(b, dtype=torch.int32, device=device),
            logits_rows=torch.arange(b, dtype=torch.int64, device=device),
            seq_lens_cpu=list(self.seq_lens_cpu),
            prefix_lens_cpu=[s - 1 for s in self.seq_lens_cpu],
            extend_lens_cpu=[1] * b,
        )

    def as_decode_rows(self) -> ForwardBatch:
        """The step as a decode step of one row per token: row t of request r attends to r's
        keys up to its own position, as it does in the extend step, provided the request
        table holds every row's slot at its position (each layer stores the step's keys
        before any row attends). Each row's logits; device ops and one upload, no host sync
        (the positions may be known to the device only: ``device_base``)."""
        ext = np.asarray(self.extend_lens_cpu, dtype=np.int64)
        n = self.num_tokens
        rows = np.repeat(np.asarray(self.req_pool_indices_cpu, dtype=np.int64), ext)
        each = np.arange(n)
        # the rows' tables and the decode metadata in one pinned upload, as ``build``'s
        (rows_t, logits_rows), (ones, starts) = upload_groups(
            [([rows, each], torch.int64), ([np.ones(n, dtype=np.int32), each], torch.int32)],
            self.positions.device,
        )
        prefix = self.positions.to(torch.int32)  # a row's keys before it
        seq_cpu = token_positions(np.asarray(self.prefix_lens_cpu, dtype=np.int64), ext) + 1
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=self.input_ids,
            positions=self.positions,
            out_cache_loc=self.out_cache_loc,
            req_pool_indices=rows_t,
            seq_lens=prefix + 1,
            prefix_lens=prefix,
            extend_lens=ones,
            extend_start_loc=starts,
            logits_rows=logits_rows,
            seq_lens_cpu=seq_cpu.tolist(),
            prefix_lens_cpu=(seq_cpu - 1).tolist(),
            extend_lens_cpu=[1] * n,
            req_pool_indices_cpu=rows.tolist(),
        )

    @classmethod
    def build(
        cls,
        mode: ForwardMode,
        input_ids: IntSeq,
        out_cache_loc: IntSeq,
        req_pool_indices: Sequence[int],
        prefix_lens: Sequence[int],
        extend_lens: Sequence[int],
        device: torch.device | str,
        positions: np.ndarray | None = None,
        table_width: int | None = None,
    ) -> ForwardBatch:
        """Build on the host and upload with pinned, non-blocking copies. The per-token rows
        (positions) are numpy ranges and the token lists are copied into the pinned buffer by
        numpy: no Python loop over the step's tokens. ``positions``: the step's
        :func:`token_positions` where the caller has them already. ``table_width``: the
        request table's row length; the step's table cells and slots go up with it
        (``table_cells``, ``table_slots``)."""
        pre = np.asarray(prefix_lens, dtype=np.int64)
        ext = np.asarray(extend_lens, dtype=np.int64)
        ends = ext.cumsum()
        starts = ends - ext
        if positions is None:
            positions = token_positions(pre, ext, starts)
        dev = torch.device(device)
        pin = dev.type == "cuda"
        # the slots as numpy once: they go up twice (int64, and int32 for the table)
        slots = out_cache_loc.numpy() if isinstance(out_cache_loc, torch.Tensor) else out_cache_loc
        rows64 = [input_ids, positions, slots, req_pool_indices, ends - 1]
        seq = pre + ext
        rows32 = [seq, pre, ext, starts]
        if table_width is not None:
            if len(ext) == 1:  # one request: its row's cells are a range
                cells = positions + int(req_pool_indices[0]) * table_width
            else:
                cells = np.repeat(np.asarray(req_pool_indices, dtype=np.int64), ext) * table_width
                cells += positions
            rows64.append(cells)
            rows32.append(slots)
        i64, i32 = upload_groups([(rows64, torch.int64), (rows32, torch.int32)], dev, pin)
        return cls(
            mode=mode,
            input_ids=i64[0],
            positions=i64[1],
            out_cache_loc=i64[2],
            req_pool_indices=i64[3],
            logits_rows=i64[4],
            seq_lens=i32[0],
            prefix_lens=i32[1],
            extend_lens=i32[2],
            extend_start_loc=i32[3],
            seq_lens_cpu=seq.tolist(),
            prefix_lens_cpu=pre.tolist(),
            extend_lens_cpu=ext.tolist(),
            out_cache_loc_cpu=out_cache_loc,
            req_pool_indices_cpu=req_pool_indices,
            table_cells=i64[5] if table_width is not None else None,
            table_slots=i32[4] if table_width is not None else None,
        )


def token_positions(
    prefix_lens: np.ndarray, extend_lens: np.ndarray, starts: np.ndarray | None = None
) -> np.ndarray:
    """Each new token's position (its column in the request table): request r's rows are
    ``prefix_lens[r] .. prefix_lens[r] + extend_lens[r] - 1``, concatenated (int64)."""
    if len(extend_lens) == 1:  # one request (a lone prompt's step): a range
        first = int(prefix_lens[0])
        return np.arange(first, first + int(extend_lens[0]), dtype=np.int64)
    if starts is None:
        starts = np.cumsum(extend_lens) - extend_lens
    total = int(extend_lens.sum())
    return np.arange(total, dtype=np.int64) + np.repeat(prefix_lens - starts, extend_lens)


_ROW_ALIGN_BYTES = 16  # Triton's pointer specialization (see upload_many)


def upload_many(
    rows: Sequence[IntSeq], dtype: torch.dtype, device: torch.device, pin: bool | None = None
) -> list[torch.Tensor]:
    """Upload int (or float) rows in one host buffer (pinned on CUDA) and one non-blocking
    copy: :func:`upload_groups` with one group."""
    return upload_groups([(rows, dtype)], device, pin)[0]


def upload_groups(
    groups: Sequence[tuple[Sequence[IntSeq], torch.dtype]],
    device: torch.device,
    pin: bool | None = None,
) -> list[list[torch.Tensor]]:
    """Upload groups of rows, each group of one dtype, in one host buffer (pinned on CUDA)
    and one non-blocking copy: a step's metadata is a single pinned allocation and a single
    copy whatever its dtypes. A row is a list, a numpy array or a CPU tensor; numpy copies
    each into the buffer (a list converts in C; an array or tensor is a memcpy). Returns
    each group's device rows.

    Each row starts on a 16-byte boundary of the buffer. Triton specializes a pointer
    argument on 16-byte alignment, so rows packed end to end would hand the kernels a
    different variant for each batch size's residue (an odd batch misaligns the rows after
    the first): a compilation in traffic for every class the warm-up missed."""
    if pin is None:
        pin = device.type == "cuda"
    # each group a run of rows, each row padded to the boundary: (dtype, start byte, bytes,
    # [length, padding, length, padding, ...] in elements)
    layout, off = [], 0
    for rows, dtype in groups:
        per = _ROW_ALIGN_BYTES // dtype.itemsize  # elements per boundary
        pieces = []
        for r in rows:
            n = len(r)
            pieces += (n, -n % per)
        size = sum(pieces) * dtype.itemsize
        layout.append((dtype, off, size, pieces))
        off += size
    host = torch.empty(off, dtype=torch.uint8, pin_memory=pin)
    buf = host.numpy()
    for (rows, _), (dtype, start, size, pieces) in zip(groups, layout, strict=True):
        view = buf[start : start + size].view(_numpy_dtype(dtype))
        at = 0
        for r, n, pad in zip(rows, pieces[0::2], pieces[1::2], strict=True):
            if n:
                view[at : at + n] = r.numpy() if isinstance(r, torch.Tensor) else r
            at += n + pad
    dev = host.to(device, non_blocking=True)
    # the device rows: one split per group (its rows and the padding between them)
    return [
        list(torch.split_with_sizes(dev[start : start + size].view(dtype), pieces)[0::2])
        for dtype, start, size, pieces in layout
    ]


@functools.cache
def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.empty(0, dtype=dtype).numpy().dtype


@dataclass
class ForwardContext:
    """Live state of the current step, read by the attention break and the KV store."""

    batch: ForwardBatch
    kv_pool: object  # cache.kv_pool.KVPool: k_buffers[kv_layer], v_buffers[kv_layer] of [slots, kv_heads, head_dim]
    req_to_token: torch.Tensor  # [max_reqs, max_context] int32
    # Set only while a graph bucket is captured: rows at or past it may be padding in a
    # replay; layers whose kernels leave such rows unwritten zero them inside the graph.
    pad_rows_from: int | None = None
    # Set while a whole prefill graph (one request) is captured: the attention kernel writes
    # zeros to the padding rows itself, so the attention layer fills nothing.
    attention_zeroes_padding: bool = False


_CONTEXT: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _CONTEXT is None:
        raise RuntimeError("no forward context: a model forward must run inside forward_context()")
    return _CONTEXT


def set_forward_context(ctx: ForwardContext | None) -> None:
    global _CONTEXT
    _CONTEXT = ctx


@contextlib.contextmanager
def forward_context(ctx: ForwardContext):
    prev = _CONTEXT
    set_forward_context(ctx)
    try:
        yield ctx
    finally:
        set_forward_context(prev)
