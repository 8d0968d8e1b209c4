"""The scheduler's configuration and its live statistics (no imports from the managers that
read them: scheduler.py, prefill.py and decode.py all import this module)."""

from __future__ import annotations

from dataclasses import dataclass


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
    enable_mixed_chunk: bool = False  # decodes inside prefill steps (EngineArgs: on)
    max_prefill_tokens: int | None = None  # new tokens in one prefill batch (None: no bound)
    overlap: bool = False  # launch step k+1 before reading step k back
    # a cached prefix is resumed at a multiple of prefix_align tokens, and its last
    # prefix_recompute tokens are computed again without storing KV (DeepSeek V4's
    # compressors: cache_manager.py)
    prefix_align: int = 1
    prefix_recompute: int = 0
    # speculative decoding with drafts of up to this many tokens (0: off;
    # engine/speculative.py); a benchmark's fixed mean accepted length (None: the target's)
    speculative_num_draft_tokens: int = 0
    speculative_synthetic_accept_length: float | None = None
    # with overlap, verify steps back to back where they can be (engine/spec_chain.py)
    speculative_chain: bool = True

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
    # penalty-pool rows (penalties, logit_bias, min_new_tokens) held, and the fixed bound
    # when the decode graphs apply them (0: no bound, the pool grows)
    penalized_reqs: int = 0
    penalized_reqs_max: int = 0
    # speculative decoding (engine/speculative.py SpecStats.totals): verify steps, draft
    # tokens verified and kept, tokens kept per request and verify step (0: none yet)
    spec_verify_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accept_length: float = 0.0
