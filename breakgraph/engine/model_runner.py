"""Runs one forward of a ForwardBatch: a CUDA graph when one fits, else eagerly.

The model contract: ``model(input_ids, positions)`` -> final hidden states of every row;
``compute_logits(hidden)``; ``kv_cache_shapes()`` -> (num_kv_heads, head_dim) per layer that
stores KV; optionally ``forward_logits_rows(input_ids, positions)`` -> the final hidden
states of the step's ``logits_rows`` only, which eager steps prefer (Gemma 4 runs its
KV-shared layers on those rows only).

Under tensor parallelism rank 0's runner has a ``tp`` driver (engine/tp_worker.py): each
forward first sends the step to the other ranks, which run the same forward on their shards.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

import torch
from torch import nn

from breakgraph.engine.cuda_graphs import DecodeGraphs, PrefillGraphs, decode_batch_sizes
from breakgraph.engine.logprobs import chunked_row_logprobs
from breakgraph.forward_batch import ForwardBatch, ForwardContext, ForwardMode, forward_context

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model: nn.Module, kv_pool, req_to_token: torch.Tensor, tp=None):
        self.model = model
        self.tp = tp  # TPDriver on rank 0 of a TP group; None otherwise (TP 1, workers)
        shapes = [tuple(s) for s in model.kv_cache_shapes()]
        if kv_pool.layer_shapes != shapes:
            raise ValueError(
                f"KV pool layers {kv_pool.layer_shapes} do not match the model's KV layers "
                f"{shapes}: build it with KVPool.from_shapes(slots, model.kv_cache_shapes(), ...)"
            )
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.decode_graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.step_counts: Counter[str] = Counter()  # "decode_graph", "extend_eager", ...
        # per-request sampling state (engine/penalties.py); a fixed one is captured into a
        # second decode bank (rank 0 only: the TP workers' logits are not sampled)
        self.penalties = None

    @torch.inference_mode()
    def capture_graphs(
        self,
        pad_req_idx: int,
        decode_max_bs: int | None,
        prefill_buckets: list[int] | None,
        max_pad_factor: float = 2.0,
        tail_max_rows: int = 160,
        whole_max_tokens: int = 0,
    ) -> None:
        """Capture decode graphs (if decode_max_bs) and prefill graphs (if buckets), one pool;
        for a model with bounded prefill, the tail bank up to ``tail_max_rows`` requests; the
        prefill buckets up to ``whole_max_tokens`` also whole, for lone requests."""
        pool = torch.cuda.graph_pool_handle()
        start = time.perf_counter()
        if prefill_buckets:
            self.prefill_graphs = PrefillGraphs(
                self.model, self.kv_pool, self.req_to_token, pad_req_idx, prefill_buckets, pool,
                max_pad_factor=max_pad_factor, tail_sizes=decode_batch_sizes(tail_max_rows),
                whole_max_tokens=whole_max_tokens,
            )  # fmt: skip
            self.prefill_graphs.capture()
        if decode_max_bs:
            fixed = self.penalties if self.penalties is not None and self.penalties.fixed else None
            self.decode_graphs = DecodeGraphs(
                self.model, self.kv_pool, self.req_to_token, pad_req_idx, decode_max_bs, pool,
                penalties=fixed,
            )  # fmt: skip
            self.decode_graphs.capture()
        logger.info("CUDA graphs captured in %.1f s", time.perf_counter() - start)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """-> logits [B, vocab] float32 of each request's last row."""
        if self.tp is not None:
            with self.tp.step(batch):
                return self._forward(batch)
        return self._forward(batch)

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        decode = batch.mode is ForwardMode.DECODE
        graphs = self.decode_graphs if decode else self.prefill_graphs
        if graphs is not None:
            logits = graphs.run(batch)
            if logits is not None:
                self.step_counts[f"{batch.mode.value}_graph"] += 1
                if not decode and graphs.replayed_whole:
                    self.step_counts["extend_graph_whole"] += 1
                if decode and batch.batch_size > graphs.bank.max_size:
                    self.step_counts["decode_graph_in_pieces"] += 1
                return logits
        self.step_counts[f"{batch.mode.value}_eager"] += 1
        return self._forward_eager(batch)

    @torch.inference_mode()
    def forward_penalized(
        self, batch: ForwardBatch, penalty_rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (logits, logits with the penalty pool applied at ``penalty_rows``): a decode
        step replays the bank that applies it inside the graph; other steps apply it after
        the forward, with the same ops. TP workers run the plain forward (same collectives)."""
        if self.tp is not None:
            with self.tp.step(batch):
                return self._forward_penalized(batch, penalty_rows)
        return self._forward_penalized(batch, penalty_rows)

    def _forward_penalized(self, batch: ForwardBatch, penalty_rows: torch.Tensor):
        if batch.mode is ForwardMode.DECODE and self.decode_graphs is not None:
            out = self.decode_graphs.run_penalized(batch, penalty_rows)
            if out is not None:
                self.step_counts["decode_graph"] += 1
                return out
        logits = self._forward(batch)
        return logits, self.penalties.apply(logits, penalty_rows)

    @torch.inference_mode()
    def forward_eager(self, batch: ForwardBatch) -> torch.Tensor:
        """The step without graphs (every TP rank likewise)."""
        if self.tp is not None:
            with self.tp.step(batch, kind="eager"):
                return self._forward_eager(batch)
        return self._forward_eager(batch)

    def _forward_eager(self, batch: ForwardBatch) -> torch.Tensor:
        ctx = ForwardContext(batch=batch, kv_pool=self.kv_pool, req_to_token=self.req_to_token)
        logits_rows_only = getattr(self.model, "forward_logits_rows", None)
        with forward_context(ctx):
            if logits_rows_only is not None:
                hidden = logits_rows_only(batch.input_ids, batch.positions)
            else:
                hidden = self.model(batch.input_ids, batch.positions)[batch.logits_rows]
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def forward_prompt(
        self, batch: ForwardBatch, rows: torch.Tensor, targets: torch.Tensor, top_k: int
    ):
        """A step with prompt rows whose logprobs are wanted, eagerly and through every layer
        on all rows (no graph, no ``forward_logits_rows``: Gemma 4's KV-shared layers must
        see the prompt rows too) -> (logits of each request's last row, logprobs of the
        rows' targets, top-k logprobs, their ids); the rows go through a chunked LM head."""
        if self.tp is not None:
            with self.tp.step(batch, rows, targets, top_k):
                return self._forward_prompt(batch, rows, targets, top_k)
        return self._forward_prompt(batch, rows, targets, top_k)

    def _forward_prompt(self, batch: ForwardBatch, rows, targets, top_k: int):
        self.step_counts[f"{batch.mode.value}_eager"] += 1
        ctx = ForwardContext(batch=batch, kv_pool=self.kv_pool, req_to_token=self.req_to_token)
        with forward_context(ctx):
            hidden = self.model(batch.input_ids, batch.positions)
        logits = self.model.compute_logits(hidden[batch.logits_rows])
        lp, top_v, top_i = chunked_row_logprobs(
            hidden[rows], targets, self.model.compute_logits, self.vocab_size, top_k
        )
        return logits, lp, top_v, top_i

    @torch.inference_mode()
    def capture_whole(self, batch: ForwardBatch) -> Callable[[], torch.Tensor]:
        """The step captured whole as one CUDA graph at its fixed shape, attention inline (the
        floor a breakable bank is measured against) -> its replay. Under TP every rank
        captures it and every replay runs on every rank. CUDA only."""
        if self.tp is not None:
            with self.tp.step(batch, kind="capture_whole"):
                replay = self._capture_whole(batch)
            tp = self.tp

            def replay_all() -> torch.Tensor:
                tp.replay_whole()
                return replay()

            return replay_all
        return self._capture_whole(batch)

    def _capture_whole(self, batch: ForwardBatch) -> Callable[[], torch.Tensor]:
        from breakgraph.graph import BreakableGraph

        def fwd() -> torch.Tensor:
            return self._forward_eager(batch)

        fwd()  # warm: allocations and Triton compiles happen outside the capture
        graph = BreakableGraph(split_at_breaks=False)
        graph.capture(fwd)
        return graph.replay

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size
