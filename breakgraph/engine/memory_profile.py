"""The memory profile: before the KV pool is sized, the largest steps the flags allow run once
through the real runner, on a temporary KV pool and request table just large enough for
them, and the caching allocator reports each step's peak (vLLM profiles a dummy forward of
its largest batch the same way). What it measured becomes the ``Reserve`` the KV pool
leaves room for (engine/memory.py has the arithmetic).

The steps, each measured from what was allocated before it:

- the largest captured prefill step: a full ``--chunked-prefill-size`` chunk through what the
  prefill graphs capture (``model(...)``, or ``forward_head`` for a model with a bounded
  prefill tail), run eagerly; its peak bounds a capture's activations, and its output per
  row is what each prefill graph keeps;
- the same chunk with every row's prompt logprobs and the top 20 (the eager step through
  all layers and the chunked LM head: the largest prefill step serving runs);
- the largest decode batch (``--max-running-requests``, else the default's cap) with the
  penalty pool applied, then sampled with top-k, top-p and min-p (a sort over the
  vocabulary per row) and its top-20 logprobs;
- with speculative decoding, that batch's verify step: each request's last token and its
  ``--speculative-num-draft-tokens`` drafts, every row's logits with the penalty pool
  applied, every row sampled, and every row's top-20 logprobs;
- with a draft model (STANDALONE), its own chunk and decode batch: it runs between the
  target's steps (the larger peak counts) and captures its own graphs, in a pool of its own
  (the two estimates add up).

The profile leaves nothing behind: its pools, table rows and runner are dropped, the
penalty pool is read on its neutral row only, and the random number generators are
restored, so later outputs are what they would have been without it. On the CPU nothing is
measured (there is no device allocator to ask): the steps still run, at ``CPU_TOKENS``
tokens and ``CPU_ROWS`` rows, so the CPU tests cover the path.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from breakgraph.cache.kv_pool import KVPool
from breakgraph.cache.req_to_token import ReqToTokenPool
from breakgraph.common.sampling_params import MAX_TOP_LOGPROBS
from breakgraph.engine.acceptance import verify_sample
from breakgraph.engine.args import EngineArgs
from breakgraph.engine.graph_plan import planned_banks
from breakgraph.engine.graphs.key import DECODE, MTP_DECODE
from breakgraph.engine.logprobs import token_logprobs
from breakgraph.engine.memory import (
    GIB,
    MAX_RUNNING_DEFAULT_CAP,
    DeviceMemory,
    MemoryPlanError,
    Reserve,
    StepPeaks,
    graph_pool_estimates,
    request_table_bytes,
    tensor_bytes,
)
from breakgraph.engine.model_runner import ModelRunner
from breakgraph.engine.prefill import extend_batch
from breakgraph.engine.request import SamplingParams
from breakgraph.engine.sampler import sample
from breakgraph.forward_batch import ForwardBatch, ForwardContext, ForwardMode, forward_context

logger = logging.getLogger(__name__)

CPU_TOKENS = 16  # the chunk the CPU profiles: nothing is measured there, the path runs
CPU_ROWS = 4
# the sampling that allocates the most: every filter on, so the sort over the vocabulary runs
HEAVIEST_SAMPLING = SamplingParams(temperature=0.7, top_p=0.9, top_k=50, min_p=0.05)


def plan_reserve(
    args: EngineArgs,
    model,
    penalties,
    dtype: torch.dtype,
    device: torch.device,
    context_len: int,
    draft=None,
) -> Reserve:
    """Profile the largest steps ``args`` allows (and ``draft``'s, a draft model's), then
    what the KV pool must leave beside it: their peak, the graph pools' estimate and the
    request table (at the most running requests the flags allow: ``--max-running-requests``,
    else the default's cap)."""
    rows = args.max_running_requests or MAX_RUNNING_DEFAULT_CAP
    chunk = min(args.chunked_prefill_size, context_len)
    drafts = 0  # draft tokens a verify step checks per request (speculative.draft_tokens)
    if args.speculative_algorithm:
        steps = args.speculative_algorithm in ("STANDALONE", "NEXTN") and args.speculative_num_steps
        drafts = steps or args.speculative_num_draft_tokens
    try:
        peaks = profile_steps(model, penalties, dtype, device, chunk, rows, drafts)
        draft_peaks = None
        if draft is not None:  # greedy, no penalty pool of its own
            draft_peaks = profile_steps(draft, None, dtype, device, chunk, rows)
    except torch.OutOfMemoryError as e:  # the steps alone do not fit beside the model
        mem = DeviceMemory.of(device) if device.type == "cuda" else DeviceMemory(0, 0)
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise MemoryPlanError(
            f"the largest steps (a {chunk}-token chunk with prompt logprobs, {rows} decode "
            f"rows sampled) ran out of memory beside the model ({why}; "
            f"{mem.free / GIB:.2f} of {mem.total / GIB:.1f} GiB free): lower "
            "--chunked-prefill-size or --max-running-requests"
        ) from None
    banks = planned_banks(args, model, penalties, rows, context_len, device)
    nextn = getattr(model, "mtp", None) is not None  # outputs its streams; the MTP's graphs
    if nextn and DECODE in banks:
        banks[MTP_DECODE] = banks[DECODE]
    activations, graphs = peaks.activations, graph_pool_estimates(peaks, banks, nextn)
    if draft_peaks is not None:
        draft_banks = planned_banks(args, draft, None, rows, context_len, device)
        activations = max(activations, draft_peaks.activations)
        for name, size in graph_pool_estimates(draft_peaks, draft_banks).items():
            graphs[f"draft {name}"] = size
    reserve = Reserve(
        activations,
        sum(graphs.values()),
        request_table_bytes(rows + 1, context_len, model),  # + padding row
        graphs,
    )
    if device.type == "cuda":
        logger.info(
            "memory profile: a %d-token chunk %.2f GiB (with prompt logprobs %.2f), %d decode "
            "rows %.2f GiB (verifying drafts %.2f); graph pools estimated at %.2f GiB over %d "
            "graphs",
            chunk, peaks.prefill_forward / GIB, peaks.prompt_step / GIB, rows,
            peaks.decode_step / GIB, peaks.verify_step / GIB, reserve.graph_pools / GIB,
            sum(len(s) for s in banks.values()),
        )  # fmt: skip
    return reserve


class _Peak:
    """A step's peak device memory above what was allocated when it began (0 on the CPU)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._allocated = self._reserved = 0

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()  # the reserved peak then counts this step's segments
            self._allocated = torch.cuda.memory_allocated(self.device)
            self._reserved = torch.cuda.memory_reserved(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def read(self) -> int:
        """The peak so far: what the step allocated at most, or the segments the allocator
        took for it (its rounding and fragmentation) if more."""
        if not self.cuda:
            return 0
        torch.cuda.synchronize(self.device)
        return max(
            torch.cuda.max_memory_allocated(self.device) - self._allocated,
            torch.cuda.max_memory_reserved(self.device) - self._reserved,
        )


@torch.inference_mode()
def profile_steps(
    model,
    penalties,
    dtype: torch.dtype,
    device: torch.device,
    chunk: int,
    rows: int,
    drafts: int = 0,
) -> StepPeaks:
    """Run the module docstring's steps for a ``chunk``-token prefill and ``rows`` decode
    rows (verifying ``drafts`` tokens each, if any) on temporary pools, dropped before
    returning; their peaks."""
    cuda = device.type == "cuda"
    if not cuda:
        chunk, rows = min(chunk, CPU_TOKENS), min(rows, CPU_ROWS)
    slots = max(chunk, rows * (1 + drafts))
    kv = KVPool.from_model(slots + 1, model, dtype, device)  # + slot 0
    kv.add_request_states(rows, model)
    table = ReqToTokenPool(rows, max(chunk, 2 + drafts), device)
    runner = ModelRunner(model, kv, table.table, penalties)
    peak = _Peak(device)
    vocab = runner.vocab_size
    try:
        with torch.random.fork_rng(devices=[device] if cuda else []):
            ids = (np.arange(chunk + 1, dtype=np.int64) * 7919) % (vocab - 1) + 1
            batch = extend_batch(
                ids[:chunk].astype(np.int32), torch.arange(1, chunk + 1), [0], [0], [chunk],
                table, device,
            )  # fmt: skip

            peak.start()
            out = _captured_prefill(model, kv, table, batch)
            parts = out if isinstance(out, tuple) else (out,)
            out_row_bytes = tensor_bytes(t for t in parts if t is not None) // chunk
            del out, parts
            prefill_forward = peak.read()

            peak.start()
            rows_t = torch.arange(chunk, device=device)
            targets = torch.from_numpy(ids[1:]).to(device)
            runner.forward_prompt(batch, rows_t, targets, MAX_TOP_LOGPROBS)
            prompt_step = peak.read()
            del rows_t, targets, batch

            decode_forward, decode_step, logits_row_bytes = _decode(
                runner, penalties, table, device, rows, ids, peak
            )
            verify_step = (
                _verify(runner, penalties, table, device, rows, drafts, ids, peak) if drafts else 0
            )
    finally:
        del runner, kv, table
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
    return StepPeaks(
        prefill_forward, prompt_step, decode_forward, decode_step, rows, out_row_bytes,
        logits_row_bytes, verify_step, chunk,
    )  # fmt: skip


def _captured_prefill(model, kv: KVPool, table: ReqToTokenPool, batch: ForwardBatch):
    """What a prefill graph captures (graphs/prefill.py), run eagerly -> its output."""
    ctx = ForwardContext(batch=batch, kv_pool=kv, req_to_token=table.table)
    with forward_context(ctx):
        if getattr(model, "bounded_prefill", False):
            return model.forward_head(batch.input_ids, batch.positions)
        return model(batch.input_ids, batch.positions)


def _decode(runner, penalties, table, device, rows: int, ids: np.ndarray, peak: _Peak):
    """The decode batch of ``rows`` one-token requests (table row i, KV slot i + 1) through
    the penalized forward, the heaviest sampling and the top logprobs -> (the forward's peak,
    the step's peak, the bytes of one logits row)."""
    batch = ForwardBatch.build(
        ForwardMode.DECODE, ids[np.arange(rows) % len(ids)], np.arange(1, rows + 1),
        list(range(rows)), [0] * rows, [1] * rows, device, table_width=table.max_context_len,
    )  # fmt: skip
    table.write_batch(batch)
    pen_rows = torch.zeros(rows, dtype=torch.int64, device=device)  # the neutral row
    peak.start()
    if penalties is not None:
        logits, processed = runner.forward_penalized(batch, pen_rows)
    else:  # a draft model: no penalty pool
        logits = processed = runner.forward(batch)
    forward = peak.read()
    sampled, _ = sample(processed, [HEAVIEST_SAMPLING] * rows, [None] * rows)
    if penalties is not None:
        penalties.record(pen_rows, sampled)  # the neutral row stays zero
    token_logprobs(logits, sampled, MAX_TOP_LOGPROBS)
    step = peak.read()
    return forward, step, logits.shape[-1] * logits.element_size()


def _verify(
    runner, penalties, table, device, rows: int, drafts: int, ids: np.ndarray, peak: _Peak
) -> int:
    """The verify step of ``rows`` requests of ``1 + drafts`` rows each (speculative.py's
    ``build_verify`` shape: every row's logits) through the forward, the penalty pool on
    every row, ``verify_sample`` with the heaviest sampling and the top logprobs of each row's
    choice and draft token -> its peak."""
    n = rows * (1 + drafts)
    batch = extend_batch(
        ids[np.arange(n) % len(ids)].astype(np.int32), torch.arange(1, n + 1),
        list(range(rows)), [0] * rows, [1 + drafts] * rows, table, device,
    )  # fmt: skip
    batch.logits_rows = torch.arange(n, dtype=torch.int64, device=device)
    draft_next = torch.ones(n, dtype=torch.int64, device=device)
    peak.start()
    logits = runner.forward(batch)
    target = logits
    if penalties is not None:
        target = penalties.apply(logits, torch.zeros(n, dtype=torch.int64, device=device))
    _, choice = verify_sample(target, [HEAVIEST_SAMPLING] * n, [None] * n, draft_next)
    del target
    token_logprobs(logits, torch.stack([choice, draft_next], dim=1), MAX_TOP_LOGPROBS)
    return peak.read()
