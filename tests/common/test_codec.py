"""The msgpack codec as another protocol would use it (its own dataclasses, its own Codec):
plain and slots dataclasses, nested ones, and packed int32 arrays (optional ones too) come
back equal; a class outside the protocol is refused on both sides."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgpack
import numpy as np
import pytest

from breakgraph.common.codec import PACKED_INT32, Codec


@dataclass(slots=True)
class Row:
    index: int
    name: str = ""


@dataclass
class Step:
    mode: str
    slots: np.ndarray = field(metadata=PACKED_INT32)
    writes: np.ndarray | None = field(default=None, metadata=PACKED_INT32)
    rows: list[Row] = field(default_factory=list)
    first: Row | None = None
    sent_at: float = 0.0


@dataclass(slots=True)
class Stop:
    pass


@dataclass
class Other:
    x: int


CODEC = Codec([Step, Stop])


def test_a_protocols_own_messages_round_trip():
    slots = np.array([0, 5, 2**31 - 1, -(2**31)], dtype=np.int32)
    step = Step("decode", slots, np.arange(6, dtype=np.int32), [Row(1, "a"), Row(2)], Row(3))
    back = CODEC.decode(CODEC.encode(step))
    assert back.mode == "decode" and back.sent_at == 0.0
    assert back.slots.dtype == np.int32 and back.slots.tolist() == slots.tolist()
    assert not back.slots.flags.writeable  # a view of the message's bytes
    assert back.writes.tolist() == list(range(6))
    assert back.rows == [Row(1, "a"), Row(2)] and back.first == Row(3)
    assert CODEC.decode(CODEC.encode(Step("prefill", [7]))).writes is None
    assert type(CODEC.decode(CODEC.encode(Stop()))) is Stop


def test_slots_dataclasses_travel_as_the_map_of_their_fields():
    wire = msgpack.unpackb(CODEC.encode(Step("d", [1], rows=[Row(4, "x")])))
    assert wire["rows"] == [{"index": 4, "name": "x"}]
    assert wire["slots"] == np.array([1], dtype=np.int32).tobytes()
    assert wire["writes"] is None


def test_a_class_outside_the_protocol_is_refused():
    with pytest.raises(TypeError):
        CODEC.encode(Other(1))
    with pytest.raises(ValueError):
        CODEC.decode(msgpack.packb({"type": "Other", "x": 1}))
    with pytest.raises(TypeError):  # a field the codec cannot pack
        CODEC.encode(Step("d", [1], sent_at=object()))


def test_packed_ints_past_int32_are_refused():
    with pytest.raises(OverflowError):
        CODEC.encode(Step("d", np.array([2**31], dtype=np.int64)))
    with pytest.raises(ValueError):  # a packed field that is not whole int32s
        CODEC.decode(msgpack.packb({"type": "Step", "mode": "d", "slots": b"\x01\x02"}))
    with pytest.raises(ValueError):  # None where the field's type does not admit it
        CODEC.decode(msgpack.packb({"type": "Step", "mode": "d", "slots": None}))
