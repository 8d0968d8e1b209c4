"""The one place that decides which graph a step replays (vLLM's cudagraph dispatcher, SGLang's
``can_run``): a step's batch -> a ``StepKey``. The banks replay the key they are given and own
no choice; "no graph" is an eager key that says why."""

from __future__ import annotations

from breakgraph.engine.graphs.decode import DecodeGraphs
from breakgraph.engine.graphs.key import (
    DECODE,
    DECODE_LONG,
    DECODE_PENALIZED,
    PREFILL,
    PREFILL_WHOLE,
    StepKey,
    eager,
)
from breakgraph.engine.graphs.prefill import PrefillGraphs
from breakgraph.forward_batch import ForwardBatch, ForwardMode
from breakgraph.graph import smallest_bucket
from breakgraph.kernels import decode_attention
from breakgraph.kernels.extend_attention import ONE_PASS_MAX_KEYS

PROMPT_LOGPROBS = eager("prompt logprobs")  # every layer on every row: no graph holds that


def decode_key(bank: str, sizes: list[int], bs: int) -> StepKey:
    """A decode step of ``bs`` rows through ``bank`` (bucket ``sizes``): its smallest bucket,
    or over the largest one, pieces of the largest and a last one in the smallest that fits
    (graphs/decode.py's ``replay_rows``)."""
    most = sizes[-1]
    if bs <= most:
        return StepKey(bank, smallest_bucket(sizes, bs))
    rest = bs % most
    return StepKey(bank, most, rest=smallest_bucket(sizes, rest) if rest else 0)


class StepDispatcher:
    def __init__(self, decode: DecodeGraphs | None = None, prefill: PrefillGraphs | None = None):
        self.decode = decode
        self.prefill = prefill

    def dispatch(self, batch: ForwardBatch, penalized: bool = False) -> StepKey:
        """The key of ``batch``'s forward; ``penalized``: the step applies the penalty pool
        (a decode graph bank may apply it inside its replay)."""
        if batch.mode is ForwardMode.DECODE:
            return self._decode(batch.batch_size, batch.max_seq_len, penalized)
        decode = self.decode
        if (
            batch.decode_rows
            and decode is not None
            and decode.rows_per_request_ok
            and batch.num_tokens <= decode.bank.max_size
        ):
            # a verify step (1 + k rows per request) or a draft model's first step: each
            # row a decode row of its request, a decode graph over them all (decode
            # attention's split-KV; the prefill bank's attention is an eager break per layer)
            return self._decode(batch.num_tokens, batch.max_seq_len, penalized=False)
        return self._prefill(batch)

    def _decode(self, bs: int, max_seq_len: int, penalized: bool) -> StepKey:
        graphs = self.decode
        if graphs is None:
            return eager("no decode graphs")
        if penalized and graphs.penalized_bank is not None:
            name = DECODE_PENALIZED
        elif (
            bs <= graphs.long_bank.max_size
            and max_seq_len >= decode_attention.LONG_CONTEXT_MIN_TOKENS
        ):
            name = DECODE_LONG
        else:
            name = DECODE
        return decode_key(name, graphs.banks[name].sizes, bs)

    def _prefill(self, batch: ForwardBatch) -> StepKey:
        graphs = self.prefill
        if graphs is None:
            return eager("no prefill graphs")
        n, pad = batch.num_tokens, graphs.max_pad_factor
        if graphs.whole is not None and batch.batch_size == 1:
            # a lone request whose context fits the bucket, or is short enough that an eager
            # step's attention would be the one-pass kernel too (a longer prefix may want key
            # splits, which a step plans from its own lengths: the breakable bank)
            size = smallest_bucket(graphs.whole.sizes, n, pad)
            if size is not None and batch.seq_lens_cpu[0] <= max(size, ONE_PASS_MAX_KEYS):
                return StepKey(PREFILL_WHOLE, size)
        sizes = graphs.bank.sizes
        size = smallest_bucket(sizes, n, pad)
        if size is None:
            return eager("over the largest bucket" if n > sizes[-1] else "padding")
        tail = 0
        if graphs.tail is not None and batch.logits_rows.shape[0] != batch.batch_size:
            # the bank holds the head layers only; every row's logits need every layer there
            return eager("every row's logits (bounded prefill)")
        if graphs.tail is not None:  # more tail rows than its largest bucket: an eager tail
            tail = smallest_bucket(graphs.tail.bank.sizes, batch.batch_size) or 0
        return StepKey(PREFILL, size, tail=tail)
