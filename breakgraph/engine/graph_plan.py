"""Which CUDA graphs a rank captures, known before it captures them: the decode batch and
prefill token buckets the flags select (``GraphSizes``) and, per bank, the buckets the
runner's banks will hold (``GraphSizes.banks``), so that the memory plan (engine/memory.py)
can estimate the graph pools before the KV pool takes what is left."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from breakgraph.engine.args import EngineArgs
from breakgraph.engine.graphs.base import decode_batch_sizes, prefill_token_buckets
from breakgraph.engine.graphs.key import (
    DECODE,
    DECODE_LONG,
    DECODE_PENALIZED,
    PREFILL,
    PREFILL_WHOLE,
    TAIL,
)

# speculative decoding's verify steps (1 + k rows per request) replay the decode graphs, a
# decode row per token; those of a model with per-request state (DeepSeek V4) and those over
# the largest decode bucket are extend steps of a few tokens: buckets below the prefill
# ones, each at most twice the tokens of the steps it takes
SPEC_BUCKETS = (2, 4, 8, 16, 32, 64, 128)


def default_cuda_graph_max_bs(total_memory: int, tp_size: int) -> int:
    """The largest decode graph by GPU memory, SGLang's tiers: 256 rows on an 80-160 GB GPU
    (H100, H200), 512 from four TP ranks or on a larger GPU, 160 below 60 GB. Above it a
    decode step replays the largest graph in pieces (graphs/decode.py)."""
    gib = total_memory / 2**30
    if gib < 60:
        return 160
    if gib < 160 and tp_size < 4:
        return 256
    return 512


@dataclass(frozen=True)
class GraphSizes:
    """The graph sizes of a configuration: the largest decode batch (None: no decode
    graphs), the prefill token buckets (None: no prefill graphs), the tail bank's largest
    row count and the largest whole prefill bucket."""

    decode_max_bs: int | None
    prefill_buckets: list[int] | None
    tail_max_rows: int
    whole_max_tokens: int

    def banks(self, model, penalized: bool) -> dict[str, list[int]]:
        """Each bank's buckets as ``ModelRunner.capture_graphs`` builds them (graphs/decode.py,
        graphs/prefill.py): ``penalized``, a fixed penalty pool (its own decode bank)."""
        banks: dict[str, list[int]] = {}
        if self.prefill_buckets:
            buckets = sorted(set(self.prefill_buckets))
            banks[PREFILL] = buckets
            tail = decode_batch_sizes(self.tail_max_rows) if self.tail_max_rows else []
            if getattr(model, "bounded_prefill", False) and tail:
                banks[TAIL] = tail
            elif getattr(model, "supports_whole_prefill_graphs", True):
                whole = [b for b in buckets if b <= self.whole_max_tokens]
                if whole:
                    banks[PREFILL_WHOLE] = whole
        if self.decode_max_bs:
            sizes = decode_batch_sizes(self.decode_max_bs)
            banks[DECODE] = sizes
            banks[DECODE_LONG] = sizes[:1]
            if penalized:
                banks[DECODE_PENALIZED] = sizes
        return banks


def graph_sizes(
    args: EngineArgs, max_running: int, context_len: int, device: torch.device
) -> GraphSizes:
    """The sizes ``args`` captures on a CUDA ``device`` for ``max_running`` requests."""
    graph_max_bs = args.cuda_graph_max_bs
    if graph_max_bs is None:
        total = torch.cuda.get_device_properties(device).total_memory
        graph_max_bs = default_cuda_graph_max_bs(total, args.tp_size)
    decode_bs = None if args.disable_cuda_graph else min(graph_max_bs, max_running)
    buckets = None
    if args.cuda_graph_backend_prefill in ("auto", "breakable"):
        max_tokens = min(
            args.cuda_graph_max_tokens_prefill or args.chunked_prefill_size, context_len
        )
        buckets = args.cuda_graph_bs_prefill or prefill_token_buckets(max_tokens)
        buckets = [b for b in buckets if b <= context_len]
        if args.speculative_algorithm and buckets:
            buckets = sorted({*buckets, *(b for b in SPEC_BUCKETS if b < min(buckets))})
    return GraphSizes(
        decode_bs, buckets, min(graph_max_bs, max_running), args.cuda_graph_max_tokens_prefill_whole
    )


def planned_banks(
    args: EngineArgs, model, penalties, max_running: int, context_len: int, device: torch.device
) -> dict[str, list[int]]:
    """The banks this rank will capture, by name (none on the CPU, or for a model that runs
    eagerly)."""
    if device.type != "cuda" or not getattr(model, "supports_cuda_graphs", True):
        return {}
    sizes = graph_sizes(args, max_running, context_len, device)
    return sizes.banks(model, penalized=penalties is not None and penalties.fixed)
