"""Continuous batching, one step at a time: schedule -> launch -> process outputs.

Schedule picks a prefill batch (prefill.py: admission, prefix match, chunking) or else a
decode batch (decode.py: one token per running request, retraction under KV pressure);
the KV slots, radix tree and request table behind both are cache_manager.py's. Launch runs
the forward and samples on the device; only then are the sampled ids read back (the step's
one host sync), and output.py turns them into request state and finish decisions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from breakgraph.cache.kv_pool import SlotAllocator
from breakgraph.cache.radix_cache import RadixCache
from breakgraph.cache.req_to_token import ReqToTokenPool
from breakgraph.engine.cache_manager import CacheManager
from breakgraph.engine.decode import DecodeManager
from breakgraph.engine.output import OutputProcessor, StepOutput, fill_meta, finished_output
from breakgraph.engine.prefill import PrefillManager
from breakgraph.engine.request import Req
from breakgraph.engine.sampler import sample
from breakgraph.forward_batch import ForwardBatch, upload_many

__all__ = ["Scheduler", "SchedulerConfig", "SchedulerStats", "StepOutput"]


@dataclass
class SchedulerConfig:
    chunked_prefill_size: int
    max_running_requests: int
    max_context_len: int
    eos_token_ids: set[int]
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.001
    reserve_cap_tokens: int = 4096  # a request reserves at most this many future decode tokens
    enable_mixed_chunk: bool = False  # running requests decode inside prefill steps
    max_prefill_tokens: int | None = None  # new tokens in one prefill batch (None: no bound)

    def __post_init__(self) -> None:
        if self.max_prefill_tokens is not None and self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")


@dataclass
class SchedulerStats:
    """Live load and KV usage (for /metrics and /get_server_info)."""

    num_running_reqs: int  # decoding, or between admission and their last prefill chunk
    num_queued_reqs: int
    kv_tokens_used: int  # held by requests or locked in the tree
    kv_tokens_cached: int  # held only by the tree (evictable)
    kv_tokens_total: int
    num_retractions: int


class Scheduler:
    def __init__(
        self,
        forward: Callable[[ForwardBatch], torch.Tensor],
        allocator: SlotAllocator,
        req_pool: ReqToTokenPool,
        tree: RadixCache,
        config: SchedulerConfig,
        device: torch.device,
        stop_text: Callable[[list[int]], str] | None = None,
    ):
        self.forward = forward  # batch -> logits [batch size, vocab] of each request's last row
        self.cfg = config
        self.device = device
        self.cache = CacheManager(allocator, tree, req_pool)
        self.decode = DecodeManager(self.cache, config, device)
        self.prefill = PrefillManager(self.cache, self.decode, config, device)
        self.output = OutputProcessor(config.eos_token_ids, config.max_context_len, stop_text)
        self.reqs: dict[str, Req] = {}
        self.last_step_tokens = 0

    # ---- requests in and out ----
    def add(self, req: Req) -> None:
        if req.rid in self.reqs:
            raise ValueError(f"request id {req.rid!r} is already in use")
        self.reqs[req.rid] = req
        self.prefill.add(req)

    def abort(self, rid: str) -> StepOutput | None:
        """Abort a request wherever it is; its KV slots are freed at once."""
        req = self.reqs.get(rid)
        if req is None:
            return None
        self.prefill.remove(req)
        self.decode.remove(req)
        return self._finish(req, {"type": "abort", "message": "aborted"})

    @property
    def has_work(self) -> bool:
        return self.prefill.has_work or bool(self.decode.running)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running_reqs=len(self.decode.running) + self.prefill.num_in_prefill,
            num_queued_reqs=len(self.prefill.waiting),
            kv_tokens_used=self.cache.kv_tokens_used,
            kv_tokens_cached=self.cache.kv_tokens_cached,
            kv_tokens_total=self.cache.kv_tokens_total,
            num_retractions=self.decode.num_retractions,
        )

    # ---- one step ----
    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """Schedule, launch (no host sync until here), then read the sampled ids back."""
        outputs: list[StepOutput] = []
        scheduled = self.schedule(outputs)
        if scheduled is None:
            self.last_step_tokens = 0
            return outputs
        reqs, batch = scheduled
        self.last_step_tokens = batch.num_tokens
        done, ids, logprobs = self.launch(reqs, batch)
        if done:
            outputs.extend(self.process_outputs(done, ids, logprobs))
        return outputs

    def schedule(self, outputs: list[StepOutput]) -> tuple[list[Req], ForwardBatch] | None:
        """Pick the next batch (prefill first, else decode) and upload its metadata.

        Requests finished without a forward have their outputs appended to ``outputs``.
        """
        no_forward: list[Req] = []
        scheduled = self.prefill.schedule_batch(no_forward)
        for req in no_forward:
            outputs.append(self._finish(req, {"type": "length", "length": 0}))
        if scheduled is not None or not self.decode.running:
            return scheduled
        retracted, exhausted = self.decode.make_room(
            others_hold_kv=self.prefill.chunked is not None
        )
        for req in retracted:
            self.prefill.requeue(req)
        if exhausted is not None:
            # nothing else holds KV and it cannot grow: finish it rather than spin
            outputs.append(
                self._finish(exhausted, {"type": "length", "length": len(exhausted.output_ids)})
            )
            return None
        return self.decode.schedule_batch()

    def launch(self, reqs: list[Req], batch: ForwardBatch):
        """Forward and sample on the device; returns (requests sampled, ids, logprobs).

        A request mid-prefill (chunked) has no token to sample: its logits row is dropped.
        """
        logits = self.forward(batch)
        chunked = self.prefill.chunked
        done = [r for r in reqs if r is not chunked]
        if not done:
            return done, None, None
        if len(done) != len(reqs):
            rows = [i for i, r in enumerate(reqs) if r is not chunked]
            logits = logits[upload_many([rows], torch.int64, logits.device)[0]]
        want_logprob = any(r.return_logprob for r in done)
        ids, logprobs = sample(
            logits, [r.sampling for r in done], [r.generator for r in done], want_logprob
        )
        return done, ids, logprobs

    def process_outputs(
        self, reqs: list[Req], ids: torch.Tensor, logprobs: torch.Tensor | None
    ) -> list[StepOutput]:
        """Append each request's sampled token; finish it, or move it on to decoding."""
        ids_list = ids.tolist()  # the step's one host sync
        lp_list = logprobs.tolist() if logprobs is not None else [None] * len(reqs)
        outputs = []
        for req, tok, lp in zip(reqs, ids_list, lp_list, strict=True):
            out, reason = self.output.append_token(req, tok, lp)
            if reason is not None:
                self.decode.remove(req)
                out = self._finish(req, reason, out)
            else:
                if not req.decoding:  # its prefill just completed
                    self.decode.add(req)
                fill_meta(out, req)
            outputs.append(out)
        return outputs

    def _finish(self, req: Req, reason: dict, last: StepOutput | None = None) -> StepOutput:
        """Release the request's KV and table row, forget it, report it finished."""
        self.cache.release(req)
        self.reqs.pop(req.rid, None)
        return finished_output(req, reason, last)
