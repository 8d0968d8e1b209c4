"""A msgpack codec for a closed set of dataclass messages: one protocol between two processes.

``Codec([A, B, ...])`` encodes an instance of a listed class and decodes it back; anything
else is refused on both sides. On the wire a message is the map of its fields plus
``"type": <class name>``; wire names are the field names, and a nested dataclass (a field
typed X, X | None or list[X]) travels as the map of its own fields. Plain and ``slots=True``
dataclasses both travel. A field marked ``PACKED_INT32`` (a prompt's token ids, up to 64K+
of them; any flat int32 array) travels as one msgpack bin of native int32s, not as a msgpack
list: packing and unpacking it are single C passes, where a list costs the codec an object
per id on each side. It decodes as a read-only int32 numpy array over the message's bytes
(None stays None where the field's type admits it).
"""

from __future__ import annotations

import array
import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgpack
import numpy as np

# field metadata: a flat int32 array that travels packed (see the module docstring)
PACKED_INT32 = {"wire": "int32"}


class Codec:
    """The msgpack codec of one protocol: the message classes it may send, by class name."""

    def __init__(self, messages: Iterable[type]):
        self.types: dict[str, type] = {}
        for cls in messages:
            if not dataclasses.is_dataclass(cls) or cls.__name__ in self.types:
                raise TypeError(f"{cls.__name__}: not a dataclass, or a second of that name")
            self.types[cls.__name__] = cls

    def encode(self, msg: Any) -> bytes:
        """``msg`` as msgpack bytes: its fields, and its class name under "type"."""
        if self.types.get(type(msg).__name__) is not type(msg):
            raise TypeError(f"{type(msg).__name__} is not a message")
        return msgpack.packb({"type": type(msg).__name__, **_fields(msg)}, default=_fields)

    def decode(self, data: bytes) -> Any:
        """The message in ``data``; ValueError if it is not one (unknown type, wrong fields)."""
        wire = msgpack.unpackb(data)
        if not isinstance(wire, dict) or self.types.get(str(wire.get("type"))) is None:
            raise ValueError(f"not a message: {str(wire)[:200]}")
        try:
            return _build(self.types[wire.pop("type")], wire)
        except (TypeError, AttributeError) as e:
            raise ValueError(f"malformed message: {e}") from None


def _fields(obj: Any) -> dict[str, Any]:
    """A dataclass as the map of its fields (msgpack calls this for what it cannot pack)."""
    return _to_wire(type(obj))(obj)


@functools.cache
def _to_wire(cls: type) -> Callable[[Any], dict[str, Any]]:
    """How an instance of ``cls`` becomes the map of its fields: a plain dataclass's
    instance dict is that map already (and fast to take); a slots one's is built."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"cannot send a {cls.__name__}")
    fields: Callable[[Any], dict[str, Any]] = vars
    if "__dict__" not in dir(cls):
        fields = functools.partial(_slot_fields, tuple(f.name for f in dataclasses.fields(cls)))
    packed = _packed(cls)
    if not packed:
        return fields

    def with_packed(obj: Any) -> dict[str, Any]:
        wire = fields(obj)
        return {**wire, **{name: _pack_int32(wire[name]) for name in packed}}

    return with_packed


def _slot_fields(names: tuple[str, ...], obj: Any) -> dict[str, Any]:
    return {name: getattr(obj, name) for name in names}


@functools.cache
def _packed(cls: type) -> tuple[str, ...]:
    """The fields of ``cls`` that travel as packed int32s."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.metadata == PACKED_INT32)


def _pack_int32(values: Any) -> bytes | None:
    """Ints as native int32 bytes (both processes share the host's byte order); a
    non-integer is a TypeError, one past int32 an OverflowError (the receiver checks
    ranges). Ids the API validated (``IdList``, ``IdArray``) carry their bytes already."""
    if values is None:
        return None
    packed = getattr(values, "packed", None)
    if packed is not None and len(packed) == 4 * len(values):
        return packed
    if isinstance(values, np.ndarray) and values.dtype == np.int32:
        return values.tobytes()
    return array.array("i", values).tobytes()


def _unpack_int32(data: Any) -> np.ndarray:
    """Packed ints as the receiver takes them: a read-only int32 array over the message's
    bytes (no Python int per id)."""
    if not isinstance(data, bytes):
        raise TypeError(f"packed int32s must be bytes, not {type(data).__name__}")
    if len(data) % 4:
        raise TypeError(f"packed int32s must be whole int32s, not {len(data)} bytes")
    return np.frombuffer(data, dtype=np.int32)


def _build(cls: type, wire: dict[str, Any]) -> Any:
    for name, rebuild in _nested(cls).items():
        if name in wire:
            wire[name] = rebuild(wire[name])
    return cls(**wire)


@functools.cache
def _nested(cls: type) -> dict[str, Callable[[Any], Any]]:
    """For each field of ``cls`` that holds dataclasses (X, X | None or list[X]) or packed
    ints: how to rebuild it."""
    hints = typing.get_type_hints(cls)
    rebuild: dict[str, Callable[[Any], Any]] = {}
    for name in _packed(cls):
        rebuild[name] = _unpack_int32
    for name, tp in hints.items():
        args = typing.get_args(tp)
        if dataclasses.is_dataclass(tp):
            rebuild[name] = functools.partial(_build, tp)
        elif typing.get_origin(tp) is list and dataclasses.is_dataclass(args[0]):
            rebuild[name] = functools.partial(_build_list, args[0])
        elif types.NoneType in args and len(args) == 2:  # X | None
            inner = next(a for a in args if a is not types.NoneType)
            build = rebuild.get(name)
            if build is None and dataclasses.is_dataclass(inner):
                build = functools.partial(_build, inner)
            if build is not None:
                rebuild[name] = functools.partial(_or_none, build)
    return rebuild


def _or_none(rebuild: Callable[[Any], Any], value: Any) -> Any:
    return None if value is None else rebuild(value)


def _build_list(cls: type, items: list[dict[str, Any]]) -> list[Any]:
    if _nested(cls):
        return [_build(cls, item) for item in items]
    return [cls(**item) for item in items]  # the common case (TokenDelta), kept fast


class IdList(list):
    """Token ids the API validated, with ``packed``, their int32 bytes, which the message
    carries as they are (a 64K prompt is not packed a second time). Never mutated once
    built: the bytes are a copy of the ids."""

    packed: bytes | None = None


class IdArray(Sequence[int]):
    """A prompt's token ids that the API parsed straight into an int64 array (no Python int
    per id: ``server/json_body.py``'s fast path), with ``packed``, their int32 bytes, once
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
