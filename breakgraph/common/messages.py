"""Every message between the API process and the engine process, and their msgpack codec.

Torch-free: the API process imports it. The codec (common/codec.py) sends each message as
the map of its fields plus its class name; a prompt's token ids travel as one bin of packed
int32s. ``TokenDelta`` is also what the engine's step returns (engine/output.py builds it):
the engine loop sends the records it is given, with no conversion in between.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from breakgraph.common.codec import PACKED_INT32, Codec
from breakgraph.common.sampling_params import SamplingParams

# the engine's stats (Engine.stats): numbers by name, and the forward steps by graph
EngineStats = dict[str, int | float | dict[str, int]]


# ---- API -> engine ----
@dataclass
class GenerateReq:
    """Add a request; the API process validated it, the engine checks again (the backstop)."""

    rid: str
    # a list on the API side; on the engine side, as decoded, a read-only int32 array
    input_ids: Sequence[int] = field(metadata=PACKED_INT32)
    sampling: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1  # first prompt position with a logprob (-1: none)
    top_logprobs_num: int = 0


@dataclass
class AbortReq:
    """Abort a request; the engine answers with the request's finished TokenDelta."""

    rid: str


@dataclass
class StatsReq:
    """Ask for the engine's live load and KV usage; answered by a StatsReply."""

    call_id: int


@dataclass
class FlushCacheReq:
    """Drop every cached prefix (refused while requests run); answered by a FlushCacheReply."""

    call_id: int


@dataclass
class ProfileReq:
    """Start (``start``) or stop the engine's torch profiler between two steps; a stop writes
    the trace under the start's ``output_dir``. Answered by a ProfileReply."""

    call_id: int
    start: bool
    output_dir: str = ""


@dataclass
class Shutdown:
    """Stop the engine loop; the engine process exits."""


# ---- engine -> API ----
@dataclass
class MemoryReport:
    """Where the engine's device memory went at startup (rank 0's), bytes; ``free_bytes``,
    ``total_bytes`` and the measured reserves are 0 on the CPU (not measured)."""

    weights_bytes: int
    kv_bytes: int
    kv_tokens: int
    penalty_pool_bytes: int
    graph_pool_bytes: dict[str, int]  # per bank: what its capture reserved
    free_bytes: int
    total_bytes: int
    # kept beside the KV pool for the largest eager step (the memory profile's peak)
    activation_reserve_bytes: int = 0
    graph_pool_estimate_bytes: int = 0  # the plan's estimate of every bank's pool, pre-capture
    graph_pool_estimates: dict[str, int] = field(default_factory=dict)  # ... per bank
    request_table_bytes: int = 0  # the request table (per-request model state: in kv_bytes)


@dataclass
class ModelInfo:
    """What the engine reports once the model is loaded."""

    model_source: str
    architecture: str
    vocab_size: int
    context_length: int
    max_running_requests: int
    kv_capacity_tokens: int
    dtype: str
    device: str
    engine_pid: int
    memory: MemoryReport | None = None


@dataclass
class Ready:
    """The model is loaded and warmed up: the engine serves from now on."""

    info: ModelInfo


@dataclass
class StartupError:
    """The engine could not start (bad model path, out of memory, ...); it exits."""

    message: str


@dataclass(slots=True)  # one per request per step, built on the engine's step path
class TokenDelta:
    """One request's share of one step: its new tokens and, once finished, why (what the
    engine's step returns, and what the API process routes to the request)."""

    rid: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finished: bool = False
    finish_reason: dict[str, Any] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    top_logprobs: list[list[list]] = field(default_factory=list)  # per token: [[lp, id], ...]
    input_logprobs: list[float | None] | None = None  # once, with the first output
    input_top_logprobs: list[list[list] | None] | None = None
    # once, with the first output: the engine's wall-clock (time.time) stamps of the request
    # (engine_recv, scheduled, forward_start, forward_end, first_token)
    timeline: dict[str, float] | None = None


@dataclass
class RequestError:
    """A request the engine refused; the API answers it with a 400."""

    rid: str
    message: str


@dataclass
class StepResult:
    """What one loop iteration produced; step_ms is None when no step ran (only aborts, errors).

    forward_ms: host time in the step's forward call; gpu_ms: the GPU time of an earlier step's
    forward (CUDA events read one step late), gpu_step_ms that step's host wall time."""

    step_ms: float | None
    outputs: list[TokenDelta] = field(default_factory=list)
    errors: list[RequestError] = field(default_factory=list)
    forward_ms: float | None = None
    gpu_ms: float | None = None
    gpu_step_ms: float | None = None
    # the step's plain tokens, most of a decode step's outputs: one token each for requests
    # that neither start nor finish with it and want nothing else with it (no logprobs);
    # their rids, and the tokens as one packed int32 field (no map per request on the wire).
    # They come before ``outputs``: a request with an entry in both (a token read back by a
    # retraction's drain, then its finish) has its delta after its token.
    token_rids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list, metadata=PACKED_INT32)

    def plain_tokens(self) -> list[tuple[str, int]]:
        """(rid, token) of each plain token."""
        return list(zip(self.token_rids, np.asarray(self.token_ids).tolist(), strict=True))


@dataclass
class StatsReply:
    """Answer to StatsReq: ``Engine.stats()``; with ``call_id`` STATS_PUBLISHED, a snapshot the
    engine loop sent unasked (what /metrics and /get_server_info fall back on mid-step)."""

    call_id: int
    stats: EngineStats


STATS_PUBLISHED = -1


@dataclass
class FlushCacheReply:
    """Answer to FlushCacheReq: whether the cache was flushed."""

    call_id: int
    flushed: bool


@dataclass
class ProfileReply:
    """Answer to ProfileReq: whether it did what was asked, why not (``conflict``: the
    profiler's state refused it, a start while one runs or a stop with none), and a stop's
    trace."""

    call_id: int
    ok: bool
    message: str
    trace: str = ""
    conflict: bool = False


ToEngine = GenerateReq | AbortReq | StatsReq | FlushCacheReq | ProfileReq | Shutdown
FromEngine = Ready | StartupError | StepResult | StatsReply | FlushCacheReply | ProfileReply
Message = ToEngine | FromEngine
CODEC = Codec(typing.get_args(Message))
MESSAGE_TYPES: dict[str, type] = CODEC.types
encode: Callable[[Message], bytes] = CODEC.encode
decode: Callable[[bytes], Message] = CODEC.decode
