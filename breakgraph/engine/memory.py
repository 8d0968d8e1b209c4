"""Where a rank's device memory goes: the KV pool's size from the budget
``--mem-fraction-static`` leaves once the weights are loaded and room is kept for the largest
step's activations, the graph pools and the request table (``Reserve``, from the measured
``StepPeaks``: engine/memory_profile.py); the one-line refusal when that budget cannot hold
one request of the full context; and the split the startup log and ``/get_server_info``
report (``common.messages.MemoryReport``).

The plan, in bytes, on a device of ``total`` with ``used`` in use after the profile freed
its pools (the weights, the penalty pool, the CUDA context and library handles)::

    KV = total x fraction - used - activations - graph pools - request table
    activations = max(step peaks measured by the profile)
    graph pools = sum over banks of (their largest capture's activations + its outputs
                  + GRAPH_OVERHEAD_BYTES per graph)

``--mem-fraction-static`` left unset is auto: 0.85, or 0.90 (vLLM's default share of the GPU)
where 0.85 cannot hold one request of the context (``--context-length``, else the model's,
which the pool then bounds: :func:`fit_context`), said in the log. The 10-15% left beside the
plan is for what it does not measure (allocator fragmentation, a library's workspace, the
CUDA graphs' growth past their estimate).

All banks share one pool and capture one graph at a time, yet each bank's pool grows by about
its own largest capture's activations: measured per bank on an H100 at default flags
(tests/engine/test_memory_gpu.py prints each bank's pool beside its estimate), Gemma 4's
decode bank took 1.20 GiB after the prefill bank's capture had freed 1.13, and the penalized
bank 1.44 after the decode bank's; so the estimate counts each bank's capture, not the
largest one once. A bank's buckets write one output buffer, the largest bucket's
(graph/bank.py); the overhead covers each graph's kept blocks beyond it (the allocator's
rounding, a break's returned tensor, library workspaces).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from breakgraph.common.messages import MemoryReport
from breakgraph.engine.graphs.key import (
    DECODE,
    DECODE_LONG,
    DECODE_PENALIZED,
    MTP_DECODE,
)

logger = logging.getLogger(__name__)

GIB = 2**30
DEFAULT_MEM_FRACTION = 0.85  # --mem-fraction-static left unset (auto) ...
AUTO_MEM_FRACTION_MAX = 0.90  # ... or this, where one full-context request needs more
# the most running requests a default --max-running-requests allows (max_running_requests)
MAX_RUNNING_DEFAULT_CAP = 1024
GRAPH_OVERHEAD_BYTES = 6 << 20  # per captured graph, beside its outputs (module docstring)
TABLE_CELL_BYTES = 4  # the request table's int32 slot ids


class MemoryPlanError(RuntimeError):
    """The device cannot hold the model and the KV cache it needs: the message names the
    numbers and the flags to change, in one line."""


@dataclass(frozen=True)
class DeviceMemory:
    """A device's memory as ``torch.cuda.mem_get_info`` reports it, bytes."""

    free: int
    total: int

    @classmethod
    def of(cls, device: torch.device) -> DeviceMemory:
        free, total = torch.cuda.mem_get_info(device)
        return cls(free, total)


def max_running_requests(explicit: int | None, num_slots: int) -> int:
    """``--max-running-requests``, else one per 64 KV slots, between 8 and the cap."""
    return explicit or min(MAX_RUNNING_DEFAULT_CAP, max(8, num_slots // 64))


@dataclass(frozen=True)
class StepPeaks:
    """What the memory profile measured (engine/memory_profile.py), bytes above what was
    allocated before each step; all 0 on the CPU (nothing measured)."""

    prefill_forward: int  # the largest captured prefill forward (a full chunk), run eagerly
    prompt_step: int  # a full chunk with every row's prompt logprobs (eager, all layers)
    decode_forward: int  # the largest decode batch's forward with the penalty pool applied
    decode_step: int  # ... and its sampling (top-k/top-p sort) and top logprobs
    decode_rows: int  # that batch's rows
    prefill_out_row_bytes: int  # what the captured prefill forward returns, per token row
    logits_row_bytes: int  # one row of logits
    # speculative decoding: that batch's verify step (every row's logits, each request's
    # last token and k drafts, all sampled); 0 without speculation
    verify_step: int = 0
    prefill_tokens: int = 0  # the chunk prefill_forward ran (0: the largest prefill bucket)

    @property
    def activations(self) -> int:
        """The eager steps run one at a time: the largest one's peak."""
        return max(self.prefill_forward, self.prompt_step, self.decode_step, self.verify_step)


def graph_pool_estimates(
    peaks: StepPeaks, banks: dict[str, list[int]], hidden: bool = False
) -> dict[str, int]:
    """Each bank's pool (name -> buckets) before it is captured: its largest bucket's
    capture (the profiled prefill forward scaled to its tokens, or the profiled decode
    forward to its rows), its outputs (the largest bucket's, which its buckets share) and
    ``GRAPH_OVERHEAD_BYTES`` per graph (module docstring). ``hidden``: decode banks output
    their hidden rows too (NEXTN; its MTP's draft steps are the ``MTP_DECODE`` bank, logits
    and streams out)."""
    estimates = {}
    for name, sizes in banks.items():
        rows = max(sizes)
        hidden_rows = rows * peaks.prefill_out_row_bytes if hidden else 0
        if name in (DECODE, DECODE_LONG, DECODE_PENALIZED, MTP_DECODE):
            capture = _scaled(peaks.decode_forward, rows, peaks.decode_rows)
            copies = 2 if name == DECODE_PENALIZED else 1  # the logits and the penalized ones
            outputs = copies * rows * peaks.logits_row_bytes + hidden_rows
        else:  # prefill, whole prefill, tail: hidden rows (the tail's fewer: an upper bound)
            capture = _scaled(peaks.prefill_forward, rows, peaks.prefill_tokens or rows)
            outputs = rows * peaks.prefill_out_row_bytes
        estimates[name] = capture + outputs + len(sizes) * GRAPH_OVERHEAD_BYTES
    return estimates


def _scaled(peak: int, rows: int, profiled_rows: int) -> int:
    """A profiled step's peak at ``rows`` of its ``profiled_rows`` (its activations grow
    with its rows)."""
    return math.ceil(peak * rows / profiled_rows) if profiled_rows else 0


def graph_pool_estimate(peaks: StepPeaks, banks: dict[str, list[int]], hidden: bool = False) -> int:
    """Every bank's pool (:func:`graph_pool_estimates`), summed."""
    return sum(graph_pool_estimates(peaks, banks, hidden).values())


def request_table_bytes(rows: int, context_len: int, model) -> int:
    """The request table (``rows`` x ``context_len`` int32) and the per-request state a
    model keeps per table row (DeepSeek V4's compressor windows, float32)."""
    fn = getattr(model, "request_state_shapes", None)
    state = sum(math.prod(s) for s in (fn() if fn is not None else {}).values()) * 4
    return rows * (context_len * TABLE_CELL_BYTES + state)


@dataclass(frozen=True)
class Reserve:
    """What the KV pool leaves room for beside it, bytes (all measured or derived before the
    pool is sized)."""

    activations: int  # the largest eager step's peak
    graph_pools: int  # the estimate of every bank's pool
    tables: int  # the request table at the most running requests the flags allow
    graph_banks: dict[str, int] = field(default_factory=dict)  # graph_pools, per bank

    @property
    def total(self) -> int:
        return self.activations + self.graph_pools + self.tables


NO_RESERVE = Reserve(0, 0, 0)


def kv_budget_slots(
    mem: DeviceMemory,
    fraction: float | None,
    slot_bytes: int,
    context_len: int,
    weights_bytes: int,
    reserve: Reserve = NO_RESERVE,
    least: int | None = None,
) -> int:
    """KV slots the budget holds: ``total x fraction`` less what is in use now (the weights
    and everything loaded with them) and the ``reserve``; at least one request of
    ``context_len`` tokens (``least`` tokens where the caller fits a default context to the
    pool: :func:`fit_context`), else a ``MemoryPlanError`` naming every number. ``fraction``
    None is auto: :data:`DEFAULT_MEM_FRACTION`, or :data:`AUTO_MEM_FRACTION_MAX` where that
    one request needs it (module docstring)."""
    used = mem.total - mem.free
    tokens = context_len if least is None else least
    need = slot_bytes * tokens

    def budget_at(share: float) -> float:
        return mem.total * share - used - reserve.total

    auto = fraction is None
    share = DEFAULT_MEM_FRACTION if auto else fraction
    budget = budget_at(share)
    full = slot_bytes * context_len  # one request of the whole context (the least one's too)
    if auto and budget < full:
        logger.info(
            "--mem-fraction-static auto: %.2f of %.1f GiB (%.2f leaves %.2f GiB, one %d-token "
            "request's KV needs %.2f)", AUTO_MEM_FRACTION_MAX, mem.total / GIB, share,
            max(budget, 0) / GIB, context_len, full / GIB,
        )  # fmt: skip
        budget = budget_at(AUTO_MEM_FRACTION_MAX)
    if budget < need:
        flag = fraction if not auto else f"auto ({AUTO_MEM_FRACTION_MAX})"
        raise MemoryPlanError(
            f"the KV cache for one {tokens}-token request needs {need / GIB:.2f} GiB, but "
            f"--mem-fraction-static {flag} of {mem.total / GIB:.1f} GiB leaves "
            f"{max(budget, 0) / GIB:.2f} GiB beside the {used / GIB:.2f} GiB in use "
            f"(weights {weights_bytes / GIB:.2f} GiB), peak activations "
            f"{reserve.activations / GIB:.2f} GiB, graph pools (estimate) "
            f"{reserve.graph_pools / GIB:.2f} GiB and the request table "
            f"{reserve.tables / GIB:.2f} GiB ({mem.free / GIB:.2f} GiB free): raise "
            "--mem-fraction-static, lower --context-length (or --max-running-requests, "
            "--cuda-graph-max-bs, --chunked-prefill-size), or set --max-total-tokens"
        )
    return int(budget // slot_bytes)


def fit_context(context_len: int, num_slots: int) -> int:
    """The context length of a server started without ``--context-length`` whose KV pool
    holds fewer tokens than the model's context: the pool's, rounded down to a multiple of
    1024 (a request that long fits the pool alone), else ``context_len``."""
    if num_slots >= context_len:
        return context_len
    return num_slots - num_slots % 1024 if num_slots >= 1024 else num_slots


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def memory_log_line(m: MemoryReport) -> str:
    """The startup log's line of where the rank's memory went."""
    graphs = sum(m.graph_pool_bytes.values())
    est = m.graph_pool_estimates
    banks = ", ".join(
        f"{k} {v / GIB:.2f}" + (f"/{est[k] / GIB:.2f}" if k in est else "")
        for k, v in m.graph_pool_bytes.items()
        if v
    )
    line = (
        f"memory: weights {m.weights_bytes / GIB:.2f} GiB, KV {m.kv_bytes / GIB:.2f} GiB "
        f"({m.kv_tokens} tokens), graph pools {graphs / GIB:.2f} GiB "
        f"(estimated {m.graph_pool_estimate_bytes / GIB:.2f}"
        + (f"; per bank, measured/estimated: {banks})" if banks else ")")
        + f", activation reserve {m.activation_reserve_bytes / GIB:.2f} GiB"
        + f", request table {m.request_table_bytes / GIB:.2f} GiB"
        + f", penalty pool {m.penalty_pool_bytes / GIB:.2f} GiB"
    )
    if m.total_bytes:
        line += f", free {m.free_bytes / GIB:.2f} of {m.total_bytes / GIB:.1f} GiB"
    return line
