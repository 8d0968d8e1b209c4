"""Decode graphs of NEXTN's MTP layer (engine/mtp.py): each draft step is one row per request,
a decode step whose forward also reads each row's residual streams (the target's, or the
layer's own from the step before). One whole graph per batch size, as the target's decode
graphs; a batch over the largest bucket replays it in pieces (decode.py's ``replay_rows``)."""

from __future__ import annotations

import torch

from breakgraph.engine.graphs.base import GraphTarget, decode_batch_sizes
from breakgraph.engine.graphs.decode import DecodeGraphs, replay_rows
from breakgraph.engine.graphs.dispatch import decode_key
from breakgraph.engine.graphs.key import MTP_DECODE
from breakgraph.forward_batch import ForwardBatch, forward_context
from breakgraph.graph import StaticInput
from breakgraph.kernels import pdl


class MtpGraphs(DecodeGraphs):
    """``target.model``: the MTP module, ``model(input_ids, positions, streams, 0)`` -> its
    output streams; the bank's outputs are (logits, streams). Its one layer drafts every step
    (DeepSeek V4 ships one)."""

    def __init__(self, target: GraphTarget, max_bs: int, width: int, dtype: torch.dtype):
        # the decode steps' inputs, batch and guard are DecodeGraphs'; its banks are not
        super(DecodeGraphs, self).__init__(target)
        self.penalties = None
        inputs = [*self.step_inputs(), StaticInput("streams", dtype, (width,))]
        sizes = decode_batch_sizes(max_bs)
        self.bank = self._bank(inputs, sizes, name="MTP decode graphs", split_at_breaks=False)
        self.banks = {MTP_DECODE: self.bank}
        self._static_rows(self.bank.max_size)

    def _forward(self, input_ids, positions, out_cache_loc, req_pool_indices, seq_lens, streams):
        batch = self._step_batch(input_ids, positions, out_cache_loc, req_pool_indices, seq_lens)
        with forward_context(self._context(batch)), pdl.scope(input_ids.shape[0]):
            out = self.model(input_ids, positions, streams, 0)
            return self.model.compute_logits(out), out

    def capture(self) -> None:
        self.bank.capture()

    def replay_streams(self, batch: ForwardBatch, streams: torch.Tensor):
        """A draft step -> (logits, output streams) of its rows."""
        key = decode_key(MTP_DECODE, self.bank.sizes, batch.batch_size)
        live = dict(
            input_ids=batch.input_ids, positions=batch.positions,
            out_cache_loc=batch.out_cache_loc, req_pool_indices=batch.req_pool_indices,
            seq_lens=batch.seq_lens, streams=streams,
        )  # fmt: skip
        return replay_rows(self.bank, key, batch.batch_size, live)
