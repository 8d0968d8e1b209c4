"""Runs one forward of a ForwardBatch through the graph the dispatcher picks, or eagerly.

The model contract: ``model(input_ids, positions)`` -> final hidden states of every row;
``compute_logits(hidden)``; ``kv_cache_shapes()`` -> (num_kv_heads, head_dim) per layer that
stores KV; optionally ``forward_logits_rows(input_ids, positions)`` -> the final hidden
states of the step's ``logits_rows`` only, which eager steps prefer (Gemma 4 runs its
KV-shared layers on those rows only).

With ``keep_hidden`` (NEXTN speculation: the MTP layers read the target's streams), each
forward leaves the model's output of every row in ``hidden`` (a graph's output buffer: valid
until the next replay of its bank; rows past the step's are padding).

Every rank of a TP group holds the same runner (engine/rank.py). Rank 0's has a ``tp``
driver (engine/tp/driver.py): each forward first sends the step and its key to the other
ranks, whose runners ``execute`` it on their shards.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import torch
from torch import nn

from breakgraph.engine.graphs.base import GraphTarget, decode_batch_sizes
from breakgraph.engine.graphs.decode import DecodeGraphs
from breakgraph.engine.graphs.dispatch import PROMPT_LOGPROBS, StepDispatcher
from breakgraph.engine.graphs.key import DECODE_BANKS, DECODE_PENALIZED, EAGER, StepKey
from breakgraph.engine.graphs.prefill import PrefillGraphs
from breakgraph.engine.logprobs import chunked_row_logprobs
from breakgraph.forward_batch import ForwardBatch, ForwardContext, ForwardMode, forward_context
from breakgraph.graph import GraphBank

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model: nn.Module, kv_pool, req_to_token: torch.Tensor, penalties=None):
        """``penalties``: the rank's penalty pool (engine/penalties.py); a fixed one is
        captured into a second decode bank."""
        self.model = model
        self.tp = None  # rank 0 of a TP group: its TPDriver (attach_tp)
        shapes = [tuple(s) for s in model.kv_cache_shapes()]
        if kv_pool.layer_shapes != shapes:
            raise ValueError(
                f"KV pool layers {kv_pool.layer_shapes} do not match the model's KV layers "
                f"{shapes}: build it with KVPool.from_model(slots, model, ...)"
            )
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.penalties = penalties
        self.decode_graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.dispatcher = StepDispatcher()
        self.step_counts: Counter[StepKey] = Counter()  # rank 0's steps by key
        self.keep_hidden = False
        self.hidden: torch.Tensor | None = None  # the last forward's rows (``keep_hidden``)

    def attach_tp(self, driver) -> None:
        """Rank 0 of a TP group: every forward goes to the workers first."""
        self.tp = driver

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
        target = GraphTarget(
            self.model, self.kv_pool, self.req_to_token, pad_req_idx,
            torch.cuda.graph_pool_handle(), keep_hidden=self.keep_hidden,
        )  # fmt: skip
        start = time.perf_counter()
        if prefill_buckets:
            self.prefill_graphs = PrefillGraphs(
                target, prefill_buckets, max_pad_factor=max_pad_factor,
                tail_sizes=decode_batch_sizes(tail_max_rows), whole_max_tokens=whole_max_tokens,
            )  # fmt: skip
            self.prefill_graphs.capture()
        if decode_max_bs:
            fixed = self.penalties if self.penalties is not None and self.penalties.fixed else None
            self.decode_graphs = DecodeGraphs(target, decode_max_bs, penalties=fixed)
            self.decode_graphs.capture()
        self.dispatcher = StepDispatcher(self.decode_graphs, self.prefill_graphs)
        logger.info("CUDA graphs captured in %.1f s", time.perf_counter() - start)

    def banks(self) -> dict[str, GraphBank]:
        """Every bank this runner captured, by its name in graphs/key.py."""
        banks: dict[str, GraphBank] = {}
        for graphs in (self.prefill_graphs, self.decode_graphs):
            if graphs is not None:
                banks.update(graphs.banks)
        return banks

    def dispatch(self, batch: ForwardBatch, penalized: bool = False) -> StepKey:
        """The key serving replays ``batch`` with (see engine/graphs/dispatch.py)."""
        return self.dispatcher.dispatch(batch, penalized)

    def count(self, *banks: str) -> int:
        """Rank 0's steps so far through any of ``banks`` (graphs/key.py's names)."""
        return sum(n for key, n in self.step_counts.items() if key.bank in banks)

    def steps_by_graph(self) -> dict[str, int]:
        """Rank 0's steps so far by the bank they replayed, eager ones by why: ``{"decode":
        n, "eager (padding)": m, ...}`` (``StepKey``'s text without its buckets)."""
        steps: Counter[str] = Counter()
        for key, n in self.step_counts.items():
            steps[str(key) if key.eager else key.bank] += n
        return dict(steps)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, key: StepKey | None = None) -> torch.Tensor:
        """-> logits [B, vocab] float32 of each request's last row, through ``key`` (default:
        the dispatcher's choice; a benchmark may name another bank's bucket)."""
        key = key or self.dispatch(batch)
        self.step_counts[key] += 1
        if self.tp is not None:
            with self.tp.step(batch, key):
                return self.execute(key, batch)
        return self.execute(key, batch)

    @torch.inference_mode()
    def forward_eager(self, batch: ForwardBatch) -> torch.Tensor:
        """The step without graphs (every TP rank likewise)."""
        return self.forward(batch, StepKey(EAGER, reason="asked"))

    @torch.inference_mode()
    def forward_penalized(
        self, batch: ForwardBatch, penalty_rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (logits, logits with the penalty pool applied at ``penalty_rows``): a decode
        step replays the bank that applies it inside the graph; other steps apply it after
        the forward, with the same ops."""
        key = self.dispatch(batch, penalized=True)
        self.step_counts[key] += 1
        if self.tp is not None:
            with self.tp.step(batch, key):
                return self._penalized(key, batch, penalty_rows)
        return self._penalized(key, batch, penalty_rows)

    def _penalized(self, key: StepKey, batch: ForwardBatch, penalty_rows: torch.Tensor):
        if key.bank == DECODE_PENALIZED:
            out = self.decode_graphs.replay(key, batch, penalty_rows)
            self.hidden = self.decode_graphs.last_hidden
            return out
        logits = self.execute(key, batch)
        return logits, self.penalties.apply(logits, penalty_rows)

    def execute(self, key: StepKey, batch: ForwardBatch) -> torch.Tensor:
        """This rank's forward of ``batch`` through ``key`` -> logits (a TP worker runs rank
        0's key; ``DECODE_PENALIZED`` on a worker: its logits with the neutral pool row)."""
        if key.eager:
            return self._eager(batch)
        if key.bank in DECODE_BANKS and batch.mode is ForwardMode.EXTEND:
            return self._decode_rows(key, batch)
        graphs = self.decode_graphs if batch.mode is ForwardMode.DECODE else self.prefill_graphs
        if key.bank == DECODE_PENALIZED:
            logits = graphs.replay(key, batch, graphs.neutral_rows(batch.batch_size))[0]
        else:
            logits = graphs.replay(key, batch)
        self.hidden = graphs.last_hidden
        return logits

    def _decode_rows(self, key: StepKey, batch: ForwardBatch) -> torch.Tensor:
        """An extend step of a few rows per request through a decode graph, one decode row
        per token (``ForwardBatch.as_decode_rows``) -> the logits of its ``logits_rows``."""
        logits = self.decode_graphs.replay(key, batch.as_decode_rows())
        self.hidden = self.decode_graphs.last_hidden
        if batch.logits_rows.shape[0] == batch.num_tokens:  # every row, in order
            return logits
        return logits[batch.logits_rows]

    def _eager(self, batch: ForwardBatch) -> torch.Tensor:
        ctx = ForwardContext(batch=batch, kv_pool=self.kv_pool, req_to_token=self.req_to_token)
        logits_rows_only = getattr(self.model, "forward_logits_rows", None)
        with forward_context(ctx):
            if logits_rows_only is not None:
                hidden = logits_rows_only(batch.input_ids, batch.positions)
            else:
                hidden = self.model(batch.input_ids, batch.positions)
                if self.keep_hidden:
                    self.hidden = hidden
                hidden = hidden[batch.logits_rows]
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def forward_prompt(
        self, batch: ForwardBatch, rows: torch.Tensor, targets: torch.Tensor, top_k: int
    ):
        """A step with prompt rows whose logprobs are wanted, eagerly and through every layer
        on all rows (no graph, no ``forward_logits_rows``: Gemma 4's KV-shared layers must
        see the prompt rows too) -> (logits of each request's last row, logprobs of the
        rows' targets, top-k logprobs, their ids); the rows go through a chunked LM head."""
        self.step_counts[PROMPT_LOGPROBS] += 1
        if self.tp is not None:
            with self.tp.step(batch, PROMPT_LOGPROBS, rows, targets, top_k):
                return self.execute_prompt(batch, rows, targets, top_k)
        return self.execute_prompt(batch, rows, targets, top_k)

    def execute_prompt(self, batch: ForwardBatch, rows, targets, top_k: int):
        """This rank's part of ``forward_prompt``."""
        ctx = ForwardContext(batch=batch, kv_pool=self.kv_pool, req_to_token=self.req_to_token)
        with forward_context(ctx):
            hidden = self.model(batch.input_ids, batch.positions)
        if self.keep_hidden:
            self.hidden = hidden
        logits = self.model.compute_logits(hidden[batch.logits_rows])
        lp, top_v, top_i = chunked_row_logprobs(
            hidden[rows], targets, self.model.compute_logits, self.vocab_size, top_k
        )
        return logits, lp, top_v, top_i

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size
