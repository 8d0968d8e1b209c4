"""One rank of the engine, built the same way on every rank: the model (its shard under TP),
the penalty pool, the KV pool, the request table, the runner and its graphs.

Rank 0 (engine.py) and every TP worker (tp/worker.py) call ``build_rank``; the two differ
only in how the KV pool's size is agreed (``agree_slots``: rank 0 takes the smallest any rank
can hold and tells the workers) and in what rank 0 adds around the rank (the scheduler, the
radix tree, the slot allocator, the TP driver).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from breakgraph.cache.kv_pool import KVPool
from breakgraph.cache.req_to_token import ReqToTokenPool
from breakgraph.common.messages import MemoryReport
from breakgraph.distributed import TPGroup
from breakgraph.engine.args import EngineArgs
from breakgraph.engine.draft import DraftModel, load_draft_model
from breakgraph.engine.graph_plan import graph_sizes
from breakgraph.engine.memory import (
    DEFAULT_MEM_FRACTION,
    NO_RESERVE,
    DeviceMemory,
    Reserve,
    fit_context,
    kv_budget_slots,
    max_running_requests,
    tensor_bytes,
)
from breakgraph.engine.memory_profile import plan_reserve
from breakgraph.engine.model_runner import ModelRunner
from breakgraph.engine.mtp import MtpDrafter
from breakgraph.engine.penalties import PenaltyPool
from breakgraph.kernels import jit_watch
from breakgraph.models.config import ModelConfig
from breakgraph.models.loader import load_model, resolve_dtype

logger = logging.getLogger(__name__)

CPU_DEFAULT_MAX_TOTAL_TOKENS = 16384


@dataclass
class Rank:
    """What one rank holds (every rank of a TP group the same, on its own shard)."""

    model: torch.nn.Module
    config: ModelConfig
    tokenizer: object | None
    model_source: str
    device: torch.device
    dtype: torch.dtype
    context_len: int
    eos_token_ids: set[int]
    penalties: PenaltyPool
    num_slots: int  # KV slots, the reserved padding slot 0 not counted
    kv_pool: KVPool
    max_running_requests: int
    req_pool: ReqToTokenPool
    runner: ModelRunner
    memory: MemoryReport
    # STANDALONE speculation's draft model or NEXTN's MTP layers, with a KV pool of its own
    drafter: DraftModel | MtpDrafter | None = None


def rank_device(device: torch.device, rank: int) -> torch.device:
    """A rank's device: ``cuda:{rank}`` on CUDA, the CPU otherwise."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def claim_device(device: torch.device) -> None:
    """Make ``device`` this process's own. On CUDA the host's torch ops are bookkeeping
    (slots, table rows: up to 64K elements), which torch would split over an OpenMP thread
    per core; one busy core then holds up the whole op for an OS time slice (a 64K-slot
    table write: 0.24 ms on one thread, 6 ms on two with one core busy; on the H200 every
    other 64K-prefix hit spent ~10 ms more in scheduling). So one intra-op thread there."""
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
        torch.set_num_threads(1)


def build_rank(
    args: EngineArgs,
    device: torch.device,
    tp_group: TPGroup,
    agree_slots: Callable[[int], int] = lambda n: n,
    on_tables: Callable[[ReqToTokenPool], None] = lambda req_pool: None,
) -> Rank:
    """Load the model, size and allocate the KV pool, build the runner, capture the graphs.
    ``agree_slots(n)``: the KV slots every rank uses, given this rank's ``n``; ``on_tables``:
    called with the request table before any graph is captured (rank 0 logs its writes
    for the workers from then on)."""
    nextn = args.speculative_algorithm == "NEXTN"
    loaded = load_model(
        args.model_path, args.load_format, args.dtype, device, args.seed, args.context_length,
        tp_group=tp_group, with_mtp=nextn,
    )  # fmt: skip
    model = configure_model(loaded.model, args)
    cfg = loaded.config
    dtype = resolve_dtype(args.dtype, device)
    context_len = min(args.context_length or cfg.max_position_embeddings,
                      cfg.max_position_embeddings)  # fmt: skip
    eos = set(cfg.eos_token_ids)
    if loaded.tokenizer is not None:
        eos |= set(loaded.tokenizer.eos_token_ids)
    penalties = penalty_pool(args, cfg.vocab_size, device, eos)  # before the KV pool
    draft = None
    # the draft runs whole on rank 0 only: its steps involve no other rank
    if args.speculative_algorithm == "STANDALONE" and tp_group.rank == 0:
        draft = load_draft_model(args, device, cfg, context_len)
    weights = tensor_bytes([*model.parameters(), *model.buffers()])
    if draft is not None:
        weights += tensor_bytes([*draft.parameters(), *draft.buffers()])
    # the largest steps, measured before the KV pool takes what is left (memory_profile.py)
    reserve = plan_reserve(args, model, penalties, dtype, device, context_len, draft)
    mtp = getattr(model, "mtp", None)  # NEXTN's drafter (its weights are the model's)
    num_slots = agree_slots(
        num_kv_slots(args, model, dtype, device, context_len, weights, draft or mtp, reserve)
    )
    if device.type == "cuda" and not (args.context_length or args.max_total_tokens):
        fitted = fit_context(context_len, num_slots)
        if fitted < context_len:  # the model's context does not fit: the pool's, at defaults
            logger.warning(
                "context length %d, not the model's %d: the KV cache holds %d tokens at "
                "--mem-fraction-static %s (set --context-length to ask for more and be told "
                "what it needs)", fitted, context_len, num_slots,
                args.mem_fraction_static or DEFAULT_MEM_FRACTION,
            )  # fmt: skip
            context_len = fitted
    # + the reserved padding slot 0; only the layers that store KV (Gemma 4 shares KV)
    kv_pool = KVPool.from_model(num_slots + 1, model, dtype, device)
    max_running = max_running_requests(args.max_running_requests, num_slots)
    # + 1: the padding row graph steps use
    req_pool = ReqToTokenPool(max_running + 1, context_len, device)
    kv_pool.add_request_states(max_running + 1, model)  # one row per request table row
    on_tables(req_pool)
    runner = ModelRunner(model, kv_pool, req_pool.table, penalties)
    drafter = None
    if draft is not None:  # its KV at the target's slots: a pool as large
        draft_pool = KVPool.from_model(num_slots + 1, draft, dtype, device)
        drafter = DraftModel(draft, draft_pool, req_pool, device)
    elif mtp is not None:  # the MTP layer's KV at the target's slots
        mtp_pool = KVPool.from_model(num_slots + 1, mtp, dtype, device)
        drafter = MtpDrafter(mtp, mtp_pool, req_pool, runner, device)
    if device.type == "cuda":
        jit_watch.install()
        if getattr(model, "supports_cuda_graphs", True):
            capture_graphs(args, runner, req_pool, max_running, context_len, drafter)
        else:
            logger.warning("%s runs eagerly: its attention is not captured in graphs yet",
                           cfg.architecture)  # fmt: skip
    return Rank(
        model, cfg, loaded.tokenizer, loaded.source, device, dtype, context_len, eos, penalties,
        num_slots, kv_pool, max_running, req_pool, runner,
        memory_report(weights, kv_pool, penalties, runner, reserve), drafter,
    )  # fmt: skip


def configure_model(model, args: EngineArgs):
    """The engine flags a model reads at run time."""
    if args.kv_sharing_fast_prefill is not None and hasattr(model, "kv_sharing_fast_prefill"):
        model.kv_sharing_fast_prefill = args.kv_sharing_fast_prefill
    return model


def penalty_pool(
    args: EngineArgs, vocab_size: int, device: torch.device, eos: set[int]
) -> PenaltyPool:
    """Fixed (``--max-penalized-requests`` rows) where the decode graphs apply it, else
    growing on demand. Every rank holds one, so every rank captures the same banks (a TP
    worker replays the penalized bank on the neutral row: its logits are not sampled)."""
    if args.max_penalized_requests < 0:
        raise ValueError(
            f"--max-penalized-requests must be >= 0, got {args.max_penalized_requests}"
        )
    in_graphs = (
        device.type == "cuda" and not args.disable_cuda_graph and args.max_penalized_requests > 0
    )
    capacity = args.max_penalized_requests if in_graphs else None
    return PenaltyPool(vocab_size, device, eos, capacity)


def num_kv_slots(
    args: EngineArgs,
    model,
    dtype: torch.dtype,
    device: torch.device,
    context_len: int,
    weights_bytes: int,
    draft=None,
    reserve: Reserve = NO_RESERVE,
) -> int:
    """KV slots this rank's pool holds: ``--max-total-tokens``, else what the memory budget
    leaves beside the ``reserve`` (memory.py): at least one request of ``--context-length``
    tokens where it is given, else of one prefill chunk (the caller then fits the model's
    context to the pool: ``fit_context``); a ``draft`` model keeps its KV at the same
    slots."""
    if args.max_total_tokens:
        return args.max_total_tokens
    if device.type != "cuda":
        return CPU_DEFAULT_MAX_TOTAL_TOKENS
    least = None if args.context_length else min(context_len, args.chunked_prefill_size)
    return kv_budget_slots(
        DeviceMemory.of(device), args.mem_fraction_static,
        KVPool.model_slot_bytes(model, dtype)
        + (KVPool.model_slot_bytes(draft, dtype) if draft is not None else 0),
        context_len, weights_bytes, reserve, least,
    )  # fmt: skip


def memory_report(
    weights_bytes: int,
    kv_pool: KVPool,
    penalties: PenaltyPool,
    runner: ModelRunner,
    reserve: Reserve = NO_RESERVE,
) -> MemoryReport:
    """Where this rank's memory went, once its graphs exist (free and total: 0 on the CPU),
    beside what the plan reserved for the largest step and estimated for the graph pools."""
    device = kv_pool.device
    mem = DeviceMemory.of(device) if device.type == "cuda" else DeviceMemory(0, 0)
    return MemoryReport(
        weights_bytes=weights_bytes,
        kv_bytes=kv_pool.size_bytes,
        kv_tokens=kv_pool.num_slots - 1,
        penalty_pool_bytes=tensor_bytes(penalties.tensors()),
        graph_pool_bytes={name: bank.reserved_bytes for name, bank in runner.banks().items()},
        free_bytes=mem.free,
        total_bytes=mem.total,
        activation_reserve_bytes=reserve.activations,
        graph_pool_estimate_bytes=reserve.graph_pools,
        graph_pool_estimates=dict(reserve.graph_banks),
        request_table_bytes=tensor_bytes([runner.req_to_token]),
    )


def capture_graphs(
    args: EngineArgs,
    runner: ModelRunner,
    req_pool: ReqToTokenPool,
    max_running: int,
    context_len: int,
    drafter: DraftModel | MtpDrafter | None = None,
) -> None:
    """Capture the decode and prefill graphs of ``args`` (every TP rank captures the same;
    rank 0's draft model the same sizes, over the same padding row)."""
    # padding rows of graph steps read this table row: all zeros, i.e. slot 0
    pad_req_idx = req_pool.alloc()
    sizes = graph_sizes(args, max_running, context_len, runner.kv_pool.device)
    draft_runner = drafter.runner if isinstance(drafter, DraftModel) else None
    for r in (runner,) if draft_runner is None else (runner, draft_runner):
        r.capture_graphs(
            pad_req_idx, sizes.decode_max_bs, sizes.prefill_buckets,
            max_pad_factor=args.prefill_graph_max_pad_factor, tail_max_rows=sizes.tail_max_rows,
            whole_max_tokens=sizes.whole_max_tokens,
        )  # fmt: skip
    if isinstance(drafter, MtpDrafter) and sizes.decode_max_bs:
        drafter.capture_graphs(pad_req_idx, sizes.decode_max_bs)
