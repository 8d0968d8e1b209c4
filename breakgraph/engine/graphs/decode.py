"""Decode graphs: one whole-forward CUDA graph per decode batch size (attention captured
inline), and the replay of a batch over the largest bucket in pieces."""

from __future__ import annotations

import torch

from breakgraph.engine.graphs.base import GraphsBase, GraphTarget, decode_batch_sizes
from breakgraph.engine.graphs.key import DECODE, DECODE_LONG, DECODE_PENALIZED, StepKey
from breakgraph.forward_batch import ForwardBatch, ForwardMode, forward_context
from breakgraph.graph import GraphBank, StaticInput
from breakgraph.kernels import decode_attention, pdl


class DecodeGraphs(GraphsBase):
    """One whole-forward CUDA graph per decode batch size (attention captured inline).

    With a fixed ``penalties`` pool (engine/penalties.py) a second bank captures the same
    forward followed by the pool's ``apply`` on each row's pool row (a static input, padding
    rows on the neutral row 0): steps with penalties, logit_bias or min_new_tokens replay it
    and get both logits; the others replay the plain bank and pay nothing for it. Batch 1
    over a long context replays a third capture, with decode attention's long-context
    variant (``long_bank``)."""

    def __init__(self, target: GraphTarget, max_bs: int, penalties=None):
        super().__init__(target)
        self.penalties = penalties
        inputs = self.step_inputs()
        sizes = decode_batch_sizes(max_bs)
        self.bank = self._bank(inputs, sizes, name="decode graphs", split_at_breaks=False)
        self.penalized_bank = None
        if penalties is not None:
            assert penalties.fixed, "graphs read the pool by address: it must not grow"
            self.penalized_bank = self._bank(
                [*inputs, StaticInput("penalty_rows", torch.int64, pad_value=0)],
                sizes,
                name="decode graphs with penalties",
                split_at_breaks=False,
                fn=self._forward_penalized,
            )
        # batch 1 over a long context: decode attention's long-context variant, captured once
        # more (kernels/decode_attention.py) and replayed by the step's longest sequence
        self.long_bank = self._bank(
            inputs, sizes[:1], name="decode graphs, long context",
            split_at_breaks=False, capture_context=lambda size: decode_attention.long_context(),
        )  # fmt: skip
        self.banks = {DECODE: self.bank, DECODE_LONG: self.long_bank}
        if self.penalized_bank is not None:
            self.banks[DECODE_PENALIZED] = self.penalized_bank
        self._static_rows(self.bank.max_size)
        # several rows of one request in a step (``ForwardBatch.as_decode_rows``): a model
        # whose decode step keeps no per-request state beside the KV (DeepSeek V4's
        # compressors advance one token per request and step)
        states = getattr(self.model, "request_state_shapes", None)
        self.rows_per_request_ok = not (states and states())
        # a TP worker's penalized replays: every row on the pool's neutral row 0 (a view of
        # one element, for any batch size: no allocation per step)
        self._neutral = torch.zeros(1, dtype=torch.int64, device=self.device)

    def step_inputs(self) -> list[StaticInput]:
        """A decode step's static inputs (padding rows on the padding request, length 1)."""
        return [
            StaticInput("input_ids", torch.int64),
            StaticInput("positions", torch.int64),
            StaticInput("out_cache_loc", torch.int64),
            StaticInput("req_pool_indices", torch.int64, pad_value=self.pad_req_idx),
            StaticInput("seq_lens", torch.int32, pad_value=1),
        ]

    def _static_rows(self, n: int) -> None:
        self._arange32 = torch.arange(n, dtype=torch.int32, device=self.device)
        self._arange64 = torch.arange(n, dtype=torch.int64, device=self.device)
        self._ones32 = torch.ones(n, dtype=torch.int32, device=self.device)

    def _forward(self, input_ids, positions, out_cache_loc, req_pool_indices, seq_lens):
        bs = input_ids.shape[0]
        batch = self._step_batch(input_ids, positions, out_cache_loc, req_pool_indices, seq_lens)
        # small batches' Triton kernels launch dependent on their predecessor (kernels/pdl.py)
        with forward_context(self._context(batch)), pdl.scope(bs):
            hidden = self.model(input_ids, positions)
            logits = self.model.compute_logits(hidden)
        return (logits, hidden) if self.target.keep_hidden else logits

    def _step_batch(self, input_ids, positions, out_cache_loc, req_pool_indices, seq_lens):
        """The decode step a capture sees, over the bank's static inputs."""
        bs = input_ids.shape[0]
        return ForwardBatch(
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

    def _forward_penalized(
        self, input_ids, positions, out_cache_loc, req_pool_indices, seq_lens, penalty_rows
    ):
        out = self._forward(input_ids, positions, out_cache_loc, req_pool_indices, seq_lens)
        if self.target.keep_hidden:
            logits, hidden = out
            return logits, self.penalties.apply(logits, penalty_rows), hidden
        return out, self.penalties.apply(out, penalty_rows)

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

    def neutral_rows(self, bs: int) -> torch.Tensor:
        """Penalty rows for ``bs`` rows that leave the logits as they are."""
        return self._neutral.expand(bs)

    def replay(self, key: StepKey, batch: ForwardBatch, penalty_rows: torch.Tensor | None = None):
        """The step through ``key``'s bank -> logits [B, vocab], or (logits, logits with the
        penalty pool applied) for ``DECODE_PENALIZED`` (``penalty_rows``: each row's pool
        row)."""
        live = dict(
            input_ids=batch.input_ids,
            positions=batch.positions,
            out_cache_loc=batch.out_cache_loc,
            req_pool_indices=batch.req_pool_indices,
            seq_lens=batch.seq_lens,
        )
        if key.bank == DECODE_PENALIZED:
            live["penalty_rows"] = penalty_rows
        out = replay_rows(self.banks[key.bank], key, batch.batch_size, live)
        if not self.target.keep_hidden:
            return out
        self.last_hidden = out[-1]
        return out[0] if len(out) == 2 else out[:2]


def replay_rows(bank: GraphBank, key: StepKey, bs: int, live: dict[str, torch.Tensor]):
    """A decode step of ``bs`` rows through ``bank`` at ``key`` -> its output (a tensor or a
    tuple of them) cut to ``bs`` rows.

    A batch over the bucket ``key.size`` (the largest) replays it piece by piece, the last
    piece in bucket ``key.rest``, each piece's outputs copied out before the next replay
    overwrites them. Each piece reads the weights again, a small cost beside the eager step
    it replaces: every kernel of every layer launched from Python, many times the graph's
    time at these sizes (the cliff a concurrency just over the largest bucket fell off).
    Decode rows are independent requests, so the pieces compute what one step would."""
    most = key.size
    if bs <= most:
        out = bank.replay(most, bs, **live)
        return tuple(t[:bs] for t in out) if isinstance(out, tuple) else out[:bs]
    results = None
    for start in range(0, bs, most):
        n = min(most, bs - start)
        size = most if n == most else key.rest
        out = bank.replay(size, n, **{name: t[start : start + n] for name, t in live.items()})
        parts = out if isinstance(out, tuple) else (out,)
        if results is None:
            results = tuple(t.new_empty((bs, *t.shape[1:])) for t in parts)
        for dst, src in zip(results, parts, strict=True):
            dst[start : start + n].copy_(src[:n])
    return results if isinstance(out, tuple) else results[0]
