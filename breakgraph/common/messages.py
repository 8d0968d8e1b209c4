"""Every message between the API process and the engine process, and their one msgpack codec.

Torch-free: the API process imports it. On the wire a message is the map of its fields plus
``"type": <class name>``; wire names are the field names, and a nested dataclass
(SamplingParams, ModelInfo, TokenDelta, RequestError) travels as the map of its own fields.
A field marked ``PACKED_IDS`` (a prompt's token ids, up to 64K+ of them) travels as one
msgpack bin of native int32s, not as a msgpack list: packing and unpacking it are single C
passes, where a list costs the codec an object per id on each side.
"""

from __future__ import annotations

import array
import dataclasses
import functools
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from breakgraph.common.sampling_params import SamplingParams

# field metadata: token ids that travel packed (see the module docstring)
PACKED_IDS = {"wire": "int32"}


# ---- API -> engine ----
@dataclass
class GenerateReq:
    """Add a request; the API process validated it, the engine checks again (the backstop)."""

    rid: str
    # a list on the API side; on the engine side, as decoded, a read-only int32 array
    input_ids: Sequence[int] = field(metadata=PACKED_IDS)
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
class Shutdown:
    """Stop the engine loop; the engine process exits."""


# ---- engine -> API ----
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


@dataclass
class Ready:
    """The model is loaded and warmed up: the engine serves from now on."""

    info: ModelInfo


@dataclass
class StartupError:
    """The engine could not start (bad model path, out of memory, ...); it exits."""

    message: str


@dataclass
class TokenDelta:
    """One request's share of one step: its new tokens and, once finished, why."""

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
    token_ids: list[int] = field(default_factory=list, metadata=PACKED_IDS)

    def plain_tokens(self) -> list[tuple[str, int]]:
        """(rid, token) of each plain token."""
        return list(zip(self.token_rids, np.asarray(self.token_ids).tolist(), strict=True))


@dataclass
class StatsReply:
    """Answer to StatsReq: ``Engine.stats()``."""

    call_id: int
    stats: dict[str, int | float]


@dataclass
class FlushCacheReply:
    """Answer to FlushCacheReq: whether the cache was flushed."""

    call_id: int
    flushed: bool


ToEngine = GenerateReq | AbortReq | StatsReq | FlushCacheReq | Shutdown
FromEngine = Ready | StartupError | StepResult | StatsReply | FlushCacheReply
Message = ToEngine | FromEngine
MESSAGE_TYPES: dict[str, type] = {cls.__name__: cls for cls in typing.get_args(Message)}


# ---- the codec ----
def encode(msg: Message) -> bytes:
    """``msg`` as msgpack bytes: its fields, and its class name under "type"."""
    if MESSAGE_TYPES.get(type(msg).__name__) is not type(msg):
        raise TypeError(f"{type(msg).__name__} is not a message")
    return msgpack.packb({"type": type(msg).__name__, **_fields(msg)}, default=_fields)


def decode(data: bytes) -> Message:
    """The message in ``data``; ValueError if it is not one (unknown type, wrong fields)."""
    wire = msgpack.unpackb(data)
    if not isinstance(wire, dict) or MESSAGE_TYPES.get(str(wire.get("type"))) is None:
        raise ValueError(f"not a message: {str(wire)[:200]}")
    try:
        return _build(MESSAGE_TYPES[wire.pop("type")], wire)
    except (TypeError, AttributeError) as e:
        raise ValueError(f"malformed message: {e}") from None


def _fields(obj: Any) -> dict[str, Any]:
    """A dataclass as the map of its fields (msgpack calls this for what it cannot pack)."""
    if not hasattr(type(obj), "__dataclass_fields__"):
        raise TypeError(f"cannot send a {type(obj).__name__}")
    fields = vars(obj)  # a plain dataclass's instance dict is its fields, and fast to take
    packed = _packed(type(obj))
    if packed:
        fields = {**fields, **{name: _pack_ids(fields[name]) for name in packed}}
    return fields


@functools.cache
def _packed(cls: type) -> tuple[str, ...]:
    """The fields of ``cls`` that travel as packed int32s."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.metadata == PACKED_IDS)


def _pack_ids(ids: list[int]) -> bytes:
    """Token ids as native int32 bytes (both processes share the host's byte order); a
    non-integer is a TypeError, one past int32 an OverflowError (the engine checks ranges).
    An ``IdList`` the API validated carries its bytes already."""
    packed = getattr(ids, "packed", None)
    if packed is not None and len(packed) == 4 * len(ids):
        return packed
    return array.array("i", ids).tobytes()


class IdList(list):
    """Token ids the API validated, with ``packed``, their int32 bytes, which the message
    carries as they are (a 64K prompt is not packed a second time). Never mutated once
    built: the bytes are a copy of the ids."""

    packed: bytes | None = None


class IdArray(Sequence[int]):
    """A prompt's token ids that the API parsed straight into an int64 array (no Python int
    per id: ``protocol.parse_json``'s fast path), with ``packed``, their int32 bytes, once
    ``check_input_ids`` has checked them. Reads as a sequence of ints; a slice, or adding a
    list, gives a list."""

    __slots__ = ("values", "packed")

    def __init__(self, values: np.ndarray):
        self.values = values
        self.packed: bytes | None = None

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.values[i].tolist()
        return int(self.values[i])

    def __iter__(self):
        return iter(self.values.tolist())

    def __add__(self, other):
        return self.values.tolist() + list(other)

    def __radd__(self, other):
        return list(other) + self.values.tolist()

    def __eq__(self, other) -> bool:
        if isinstance(other, IdArray):
            return bool(np.array_equal(self.values, other.values))
        return isinstance(other, Sequence) and self.values.tolist() == list(other)

    def __repr__(self) -> str:
        return f"IdArray({len(self)} ids)"


def packed_id_list(ids: list[int], arr: np.ndarray) -> IdList:
    """``ids`` (valid, in int32 range; ``arr`` their values, as the caller's check found
    them) as an IdList carrying their int32 bytes (``ids`` itself when it is one already:
    the parser's own copy, not shared)."""
    out = ids if isinstance(ids, IdList) else IdList(ids)
    out.packed = arr.astype(np.int32, copy=False).tobytes()
    return out


def _unpack_ids(data: Any) -> np.ndarray:
    """Packed ids as the engine takes them: a read-only int32 array over the message's
    bytes (no Python int per id)."""
    if not isinstance(data, bytes):
        raise TypeError(f"packed token ids must be bytes, not {type(data).__name__}")
    if len(data) % 4:
        raise TypeError(f"packed token ids must be whole int32s, not {len(data)} bytes")
    return np.frombuffer(data, dtype=np.int32)


def _build(cls: type, wire: dict[str, Any]) -> Any:
    for name, rebuild in _nested(cls).items():
        if name in wire:
            wire[name] = rebuild(wire[name])
    return cls(**wire)


@functools.cache
def _nested(cls: type) -> dict[str, Callable[[Any], Any]]:
    """For each field of ``cls`` that holds dataclasses (X or list[X]) or packed ids: how to
    rebuild it."""
    rebuild: dict[str, Callable[[Any], Any]] = dict.fromkeys(_packed(cls), _unpack_ids)
    for name, tp in typing.get_type_hints(cls).items():
        args = typing.get_args(tp)
        if dataclasses.is_dataclass(tp):
            rebuild[name] = functools.partial(_build, tp)
        elif typing.get_origin(tp) is list and dataclasses.is_dataclass(args[0]):
            rebuild[name] = functools.partial(_build_list, args[0])
    return rebuild


def _build_list(cls: type, items: list[dict[str, Any]]) -> list[Any]:
    if _nested(cls):
        return [_build(cls, item) for item in items]
    return [cls(**item) for item in items]  # the common case (TokenDelta), kept fast
