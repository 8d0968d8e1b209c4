"""CUDA graphs for the model runner: decode (whole forward per batch size) and prefill
(breakable forward per token bucket, attention as the eager break).

A lone request whose whole context fits a small bucket (a short prompt with no cached prefix,
or a short one over a short prefix) replays a *whole* prefill graph instead: the same
forward captured with attention inline, on one request's metadata held in static buffers
(``PrefillGraphs.whole``). Its attention grid is the bucket's, the eager one's or larger
(the extra programs exit); its kernel is the eager one's at these sizes. It saves the
breaks' launches and the gaps between the segments.

A model with KV-shared late layers (``model.bounded_prefill``, Gemma 4) splits its prefill:
the token-bucket bank captures ``forward_head`` (the layers that store KV, all rows) and a
tail bank, bucketed by tail-row count, captures ``forward_tail`` (the KV-shared layers on each
request's last row; attention is the break reading the live ``batch.tail()``).

All banks share one memory pool. The padding convention, in one place: a bucket's rows past
the live ones are padding; their input ids and positions are 0, their KV slot is 0 (reserved,
never part of a real request's context), decode padding rows belong to the padding request
(``pad_req_idx``: its req_to_token row is all zeros, so slot 0) with ``seq_len`` 1, and their
outputs are dropped. Prefill padding rows belong to no request, so attention leaves them
unwritten: the captured graph zeroes them first (a whole graph's attention kernel writes the
zeros itself), so every padding value stays defined (slot 0 never receives NaN/Inf from
uninitialized memory).
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn

from breakgraph.forward_batch import ForwardBatch, ForwardContext, ForwardMode, forward_context
from breakgraph.graph import GraphBank, StaticInput
from breakgraph.kernels import decode_attention, jit_watch, ops, pdl
from breakgraph.kernels.extend_attention import ONE_PASS_MAX_KEYS

logger = logging.getLogger(__name__)


def decode_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to max_bs (SGLang's default shape)."""
    sizes = [b for b in (1, 2, 4, 8) if b <= max_bs]
    sizes += list(range(16, max_bs + 1, 8))
    if max_bs not in sizes:
        sizes.append(max_bs)
    return sorted(set(sizes))


def prefill_token_buckets(max_tokens: int, step: int = 256) -> list[int]:
    """Multiples of ``step`` up to ``max_tokens`` (which is always a bucket)."""
    sizes = list(range(step, max_tokens + 1, step))
    if not sizes or sizes[-1] != max_tokens:
        sizes.append(max_tokens)
    return sizes


class _GraphsBase:
    def __init__(self, model: nn.Module, kv_pool, req_to_token: torch.Tensor, pad_req_idx: int):
        self.model = model
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.pad_req_idx = pad_req_idx
        self.device = req_to_token.device

    def _context(self, batch: ForwardBatch) -> ForwardContext:
        return ForwardContext(batch=batch, kv_pool=self.kv_pool, req_to_token=self.req_to_token)

    def _bank(
        self,
        inputs: list[StaticInput],
        sizes: list[int],
        pool,
        check_addresses,
        *,
        name: str,
        max_pad_factor: float = float("inf"),
        split_at_breaks: bool = True,
        capture_context=None,
        fn=None,
    ) -> GraphBank:
        """A bank over ``fn`` (default ``self._forward``), guarded and compile-checked like
        every bank here."""
        return GraphBank(
            fn or self._forward,
            inputs,
            sizes,
            self.device,
            max_pad_factor=max_pad_factor,
            pool=pool,
            split_at_breaks=split_at_breaks,
            guard_tensors=self._guard_tensors,
            check_addresses=check_addresses,
            capture_context=capture_context,
            compile_counter=self._compile_counter(),
            name=name,
        )

    def _capture_ctx(self, batch: ForwardBatch, size: int, bank=None) -> ForwardContext:
        """The context a bucket of ``size`` rows of ``bank`` (default ``self.bank``) is
        captured in: rows past the next smaller bucket are the ones a replay may pad (a
        smaller count takes a smaller bucket)."""
        ctx = self._context(batch)
        smaller = [b for b in (bank or self.bank).sizes if b < size]
        ctx.pad_rows_from = smaller[-1] if smaller else 0
        return ctx

    def _guard_tensors(self):
        """Buffers captured kernels read by address: weights, rotary caches, KV, the table,
        kernel workspaces. (cuBLAS's workspaces are allocated inside the captures, in the
        pool: see graph/breakable.py.)"""
        yield from self.model.parameters()
        yield from self.model.buffers()
        yield from self.kv_pool.k_buffers
        yield from self.kv_pool.v_buffers
        yield self.req_to_token
        yield from ops.graph_workspaces()

    @staticmethod
    def _compile_counter():
        """JIT compilations (Triton), or None where Triton is absent."""
        return (lambda: jit_watch.stats().total) if jit_watch.install() else None


class DecodeGraphs(_GraphsBase):
    """One whole-forward CUDA graph per decode batch size (attention captured inline).

    With a fixed ``penalties`` pool (engine/penalties.py) a second bank captures the same
    forward followed by the pool's ``apply`` on each row's pool row (a static input, padding
    rows on the neutral row 0): steps with penalties, logit_bias or min_new_tokens replay it
    and get both logits; the others replay the plain bank and pay nothing for it. Batch 1
    over a long context replays a third capture, with decode attention's long-context
    variant (``long_bank``)."""

    def __init__(
        self,
        model,
        kv_pool,
        req_to_token,
        pad_req_idx,
        max_bs: int,
        pool,
        check_addresses=None,
        penalties=None,
    ):
        super().__init__(model, kv_pool, req_to_token, pad_req_idx)
        self.penalties = penalties
        inputs = [
            StaticInput("input_ids", torch.int64),
            StaticInput("positions", torch.int64),
            StaticInput("out_cache_loc", torch.int64),
            StaticInput("req_pool_indices", torch.int64, pad_value=pad_req_idx),
            StaticInput("seq_lens", torch.int32, pad_value=1),
        ]
        sizes = decode_batch_sizes(max_bs)
        self.bank = self._bank(
            inputs, sizes, pool, check_addresses, name="decode graphs", split_at_breaks=False
        )
        self.penalized_bank = None
        if penalties is not None:
            assert penalties.fixed, "graphs read the pool by address: it must not grow"
            self.penalized_bank = self._bank(
                [*inputs, StaticInput("penalty_rows", torch.int64, pad_value=0)],
                sizes,
                pool,
                check_addresses,
                name="decode graphs with penalties",
                split_at_breaks=False,
                fn=self._forward_penalized,
            )
        # batch 1 over a long context: decode attention's long-context variant, captured once
        # more (kernels/decode_attention.py) and replayed by the step's longest sequence
        self.long_bank = self._bank(
            inputs, sizes[:1], pool, check_addresses, name="decode graphs, long context",
            split_at_breaks=False, capture_context=lambda size: decode_attention.long_context(),
        )  # fmt: skip
        n = self.bank.max_size
        self._arange32 = torch.arange(n, dtype=torch.int32, device=self.device)
        self._arange64 = torch.arange(n, dtype=torch.int64, device=self.device)
        self._ones32 = torch.ones(n, dtype=torch.int32, device=self.device)

    def _forward(self, input_ids, positions, out_cache_loc, req_pool_indices, seq_lens):
        bs = input_ids.shape[0]
        batch = ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=input_ids,
            positions=positions,
            out_cache_loc=out_cache_loc,
            req_pool_indices=req_pool_indices,
            seq_lens=seq_lens,
            prefix_lens=seq_lens,  # unused by decode attention
            extend_lens=self._ones32[:bs],
            extend_start_loc=self._arange32[:bs],
            logits_rows=self._arange64[:bs],
            seq_lens_cpu=[1] * bs,
            prefix_lens_cpu=[0] * bs,
            extend_lens_cpu=[1] * bs,
        )
        # small batches' Triton kernels launch dependent on their predecessor (kernels/pdl.py)
        with forward_context(self._context(batch)), pdl.scope(bs):
            hidden = self.model(input_ids, positions)
            return self.model.compute_logits(hidden)

    def _forward_penalized(
        self, input_ids, positions, out_cache_loc, req_pool_indices, seq_lens, penalty_rows
    ):
        logits = self._forward(input_ids, positions, out_cache_loc, req_pool_indices, seq_lens)
        return logits, self.penalties.apply(logits, penalty_rows)

    def _guard_tensors(self):
        # the pool first: the base list ends with kernel workspaces, a list that may grow
        if self.penalties is not None:
            yield from self.penalties.tensors()
        yield from super()._guard_tensors()

    def capture(self) -> None:
        self.bank.capture()
        self.long_bank.capture()
        if self.penalized_bank is not None:
            self.penalized_bank.capture()

    def _live(self, batch: ForwardBatch) -> dict[str, torch.Tensor]:
        return dict(
            input_ids=batch.input_ids,
            positions=batch.positions,
            out_cache_loc=batch.out_cache_loc,
            req_pool_indices=batch.req_pool_indices,
            seq_lens=batch.seq_lens,
        )

    def run(self, batch: ForwardBatch) -> torch.Tensor | None:
        bank = self.bank
        if (
            batch.batch_size <= self.long_bank.max_size
            and batch.max_seq_len >= decode_attention.LONG_CONTEXT_MIN_TOKENS
        ):
            bank = self.long_bank
        return _replay_rows(bank, batch.batch_size, self._live(batch))

    def run_penalized(
        self, batch: ForwardBatch, penalty_rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(logits, logits with the penalty pool applied), or None (no bank or no bucket)."""
        if self.penalized_bank is None:
            return None
        live = {**self._live(batch), "penalty_rows": penalty_rows}
        return _replay_rows(self.penalized_bank, batch.batch_size, live)


def _replay_rows(bank, bs: int, live: dict[str, torch.Tensor]):
    """A decode step of ``bs`` rows through ``bank`` -> its output (a tensor or a tuple of
    them) cut to ``bs`` rows, or None where the bank has no bucket.

    A batch over the largest bucket replays it piece by piece, each piece ``max_size`` rows
    or fewer, its outputs copied out before the next replay overwrites them. Each piece
    reads the weights again, a small cost beside the eager step it replaces: every kernel
    of every layer launched from Python, many times the graph's time at these sizes (the
    cliff a concurrency just over the largest bucket fell off). Decode rows are independent
    requests, so the pieces compute what one step would."""
    most = bank.max_size
    if bs <= most:
        out = bank.run(bs, **live)
        if out is None:
            return None
        return tuple(t[:bs] for t in out) if isinstance(out, tuple) else out[:bs]
    results = None
    for start in range(0, bs, most):
        n = min(most, bs - start)
        out = bank.run(n, **{name: t[start : start + n] for name, t in live.items()})
        if out is None:
            return None
        parts = out if isinstance(out, tuple) else (out,)
        if results is None:
            results = tuple(t.new_empty((bs, *t.shape[1:])) for t in parts)
        for dst, src in zip(results, parts, strict=True):
            dst[start : start + n].copy_(src[:n])
    return results if isinstance(out, tuple) else results[0]


class PrefillGraphs(_GraphsBase):
    """Breakable prefill graphs per token bucket; the attention break reads the live step."""

    def __init__(
        self,
        model,
        kv_pool,
        req_to_token,
        pad_req_idx,
        buckets: list[int],
        pool,
        max_pad_factor: float = 2.0,
        check_addresses=None,
        tail_sizes: list[int] | None = None,
        whole_max_tokens: int = 0,
    ):
        """``tail_sizes``: the tail bank's row buckets, for a model with ``bounded_prefill``.
        ``whole_max_tokens``: the buckets up to it are captured whole too, for lone requests
        (none for a model with bounded prefill: its tail is a bank of its own)."""
        super().__init__(model, kv_pool, req_to_token, pad_req_idx)
        bounded = bool(getattr(model, "bounded_prefill", False))
        self.tail = None
        if bounded and tail_sizes:
            self.tail = TailGraphs(
                model, kv_pool, req_to_token, pad_req_idx, tail_sizes, pool, check_addresses
            )
        inputs = [
            StaticInput("input_ids", torch.int64),
            StaticInput("positions", torch.int64),
            StaticInput("out_cache_loc", torch.int64),  # the captured KV store's slots
        ]
        self.bank = self._bank(
            inputs,
            buckets,
            pool,
            check_addresses,
            name="prefill graphs",
            max_pad_factor=max_pad_factor,
            capture_context=self._capture_context,
        )
        self.whole = None
        self.replayed_whole = False  # the last step's bank (run)
        whole_sizes = [b for b in buckets if b <= whole_max_tokens]
        if whole_sizes and self.tail is None:
            # the lone request's metadata the captured attention reads: its table row, its
            # context length and its new tokens (separate buffers: each 16-byte aligned, as
            # the uploaded rows are, so the kernels compile no variant of their own)
            dev = self.device
            self._one = {
                "req_pool_indices": torch.zeros(1, dtype=torch.int64, device=dev),
                "seq_lens": torch.zeros(1, dtype=torch.int32, device=dev),
                "extend_lens": torch.zeros(1, dtype=torch.int32, device=dev),
                "extend_start_loc": torch.zeros(1, dtype=torch.int32, device=dev),  # stays 0
            }
            self.whole = self._bank(
                inputs,
                whole_sizes,
                pool,
                check_addresses,
                name="whole prefill graphs",
                max_pad_factor=max_pad_factor,
                split_at_breaks=False,
                capture_context=self._capture_whole_context,
            )

    def _forward(self, input_ids, positions, out_cache_loc):
        del out_cache_loc  # the KV store reads it through the capture's forward context
        if self.tail is not None:
            return self.model.forward_head(input_ids, positions)
        return self.model(input_ids, positions)

    @contextlib.contextmanager
    def _capture_context(self, size: int):
        """One request of ``size`` new tokens over the padding row (slot 0 everywhere); the KV
        store is captured on the bank's static slots."""
        batch = ForwardBatch.build(
            ForwardMode.EXTEND, [0] * size, [0] * size, [self.pad_req_idx], [0], [size], self.device
        )
        batch.out_cache_loc = self.bank.views(size)["out_cache_loc"]
        with forward_context(self._capture_ctx(batch, size)):
            yield

    @contextlib.contextmanager
    def _capture_whole_context(self, size: int):
        """One request of ``size`` new tokens over the padding row, its metadata the static
        buffers a replay fills, and the grid the bucket's: every live count up to ``size``."""
        batch = ForwardBatch.build(
            ForwardMode.EXTEND, [0] * size, [0] * size, [self.pad_req_idx], [0], [size], self.device
        )
        one = self._one
        one["req_pool_indices"].fill_(self.pad_req_idx)
        one["seq_lens"].fill_(size)
        one["extend_lens"].fill_(size)
        for name, buf in one.items():
            setattr(batch, name, buf)
        batch.out_cache_loc = self.whole.views(size)["out_cache_loc"]
        ctx = self._capture_ctx(batch, size, self.whole)
        ctx.attention_zeroes_padding = True  # its grid covers every row of the bucket
        with forward_context(ctx):
            yield

    def capture(self) -> None:
        self.bank.capture()
        if self.whole is not None:
            self.whole.capture()
        if self.tail is not None:
            self.tail.capture()

    def whole_bucket(self, batch: ForwardBatch) -> int | None:
        """The whole graph's bucket for ``batch``, or None: one request whose context (cached
        prefix and new tokens) fits the bucket or is short enough that an eager step's
        attention would be the one-pass kernel too (a longer prefix may want key splits,
        which a step plans from its own lengths: the breakable bank)."""
        if self.whole is None or batch.batch_size != 1:
            return None
        size = self.whole.bucket_for(batch.num_tokens)
        if size is None:
            return None
        return size if batch.seq_lens_cpu[0] <= max(size, ONE_PASS_MAX_KEYS) else None

    def run(self, batch: ForwardBatch, whole: bool = True) -> torch.Tensor | None:
        """The step's logits through a graph, or None (no bucket: the caller runs eagerly).
        ``whole=False``: never the whole graph (benchmarks compare the two).
        ``replayed_whole`` says which bank the step replayed."""
        bank = self.bank
        if whole and self.whole_bucket(batch) is not None:
            bank, one = self.whole, self._one  # its attention reads these, by address
            torch._foreach_copy_(
                [one["seq_lens"], one["extend_lens"]], [batch.seq_lens, batch.extend_lens]
            )
            one["req_pool_indices"].copy_(batch.req_pool_indices)
        self.replayed_whole = bank is self.whole
        # the attention break reads the live batch; the captured KV store, the bank's slots
        with forward_context(self._context(batch)):
            out = bank.run(
                batch.num_tokens,
                input_ids=batch.input_ids,
                positions=batch.positions,
                out_cache_loc=batch.out_cache_loc,
            )
        if out is None:
            return None
        if self.tail is None:
            return self.model.compute_logits(out[batch.logits_rows])
        hidden, per_layer_inputs = out
        rows, tail = batch.logits_rows, batch.tail()
        live = {"hidden": hidden[rows], "positions": tail.positions}
        if per_layer_inputs is not None:
            live["per_layer_inputs"] = per_layer_inputs[rows]
        with forward_context(self._context(tail)):
            final = self.tail.bank.run(tail.batch_size, **live)
            if final is None:  # more tail rows than the largest tail bucket
                final = self.model.forward_tail(
                    live["hidden"], live.get("per_layer_inputs"), live["positions"]
                )
        return self.model.compute_logits(final[: tail.batch_size])


class TailGraphs(_GraphsBase):
    """Bounded replay: the KV-shared layers on each request's last row, one breakable graph
    per tail-row count; the attention break reads the live ``batch.tail()``."""

    def __init__(
        self, model, kv_pool, req_to_token, pad_req_idx, sizes, pool, check_addresses=None
    ):
        super().__init__(model, kv_pool, req_to_token, pad_req_idx)
        inputs = [StaticInput("positions", torch.int64)]
        inputs += [
            StaticInput(name, dtype, shape) for name, (shape, dtype) in model.tail_inputs().items()
        ]
        self.bank = self._bank(
            inputs,
            sizes,
            pool,
            check_addresses,
            name="tail graphs",
            capture_context=self._capture_context,
        )

    def _forward(self, positions, hidden, per_layer_inputs=None):
        return self.model.forward_tail(hidden, per_layer_inputs, positions)

    @contextlib.contextmanager
    def _capture_context(self, size: int):
        """``size`` one-row requests over the padding row (their keys: slot 0)."""
        batch = ForwardBatch.build(
            ForwardMode.EXTEND, [0] * size, [0] * size, [self.pad_req_idx] * size,
            [0] * size, [1] * size, self.device,
        )  # fmt: skip
        with forward_context(self._capture_ctx(batch, size)):
            yield

    def capture(self) -> None:
        self.bank.capture()
