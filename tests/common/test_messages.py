"""The process protocol: every message survives the codec under its own field names, and
the API process (``breakgraph serve`` minus the engine) never imports torch."""

from __future__ import annotations

import array
import dataclasses
import subprocess
import sys

import msgpack
import numpy as np
import pytest

from breakgraph.common.messages import (
    MESSAGE_TYPES,
    AbortReq,
    FlushCacheReply,
    FlushCacheReq,
    GenerateReq,
    ModelInfo,
    ProfileReply,
    ProfileReq,
    Ready,
    RequestError,
    Shutdown,
    StartupError,
    StatsReply,
    StatsReq,
    StepResult,
    TokenDelta,
    decode,
    encode,
)
from breakgraph.common.sampling_params import SamplingParams

SAMPLING = SamplingParams(
    max_new_tokens=7, temperature=0.5, top_k=3, seed=11, stop=["\n"], stop_token_ids=[2]
)
INFO = ModelInfo("m.gguf", "LlamaForCausalLM", 256, 4096, 64, 16384, "float32", "cpu", 123)
DELTA = TokenDelta("a", [5, 6], [-0.5, -1.25], True, {"type": "stop", "matched": 2}, 3, 2, 1)
SAMPLES = [
    GenerateReq("a", [1, 2, 3], SAMPLING, return_logprob=True),
    AbortReq("a"),
    StatsReq(3),
    FlushCacheReq(4),
    Shutdown(),
    Ready(INFO),
    StartupError("ValueError: no such model"),
    StepResult(
        12.5,
        [DELTA, TokenDelta("b", [7])],
        [RequestError("c", "the prompt is empty")],
        token_rids=["d", "e"],
        token_ids=[2**31 - 1, 0],
    ),
    StepResult(None),
    StatsReply(5, {"num_running_reqs": 1, "kv_usage": 0.25}),
    FlushCacheReply(6, True),
    ProfileReply(8, True, "trace written: /tmp/p.trace.json.gz", "/tmp/p.trace.json.gz"),
    ProfileReply(9, False, "no profile is running", conflict=True),
    ProfileReq(7, True, "/tmp/profiles"),
]


def test_every_message_round_trips():
    assert {type(m) for m in SAMPLES} == set(MESSAGE_TYPES.values())
    for msg in SAMPLES:
        back = decode(encode(msg))
        if isinstance(msg, GenerateReq):  # the engine side gets the ids as an int32 array
            back.input_ids = back.input_ids.tolist()
        if isinstance(msg, StepResult):  # the plain tokens too
            assert back.plain_tokens() == list(zip(msg.token_rids, msg.token_ids, strict=True))
            back.token_ids = back.token_ids.tolist()
        assert back == msg


def test_wire_names_are_field_names():
    wire = msgpack.unpackb(encode(SAMPLES[0]))
    assert wire == {
        "type": "GenerateReq",
        "rid": "a",
        "input_ids": array.array("i", [1, 2, 3]).tobytes(),  # packed: one bin, not a list
        "sampling": dataclasses.asdict(SAMPLING),
        "return_logprob": True,
        "logprob_start_len": -1,
        "top_logprobs_num": 0,
    }
    step = msgpack.unpackb(encode(SAMPLES[7]))
    assert step["outputs"][0] == {"rid": "a", **dataclasses.asdict(DELTA)}
    assert step["token_rids"] == ["d", "e"]
    assert step["token_ids"] == array.array("i", [2**31 - 1, 0]).tobytes()  # one bin


@pytest.mark.parametrize(
    "wire",
    [
        [1, 2],
        {"rid": "a"},
        {"type": "Nope"},
        {"type": "AbortReq"},
        {"type": "AbortReq", "rid": "a", "extra": 1},
        {"type": "GenerateReq", "rid": "a", "input_ids": [1], "sampling": {"bogus": 1}},
        {"type": "StepResult", "step_ms": 1.0, "outputs": [3]},
        {"type": "GenerateReq", "rid": "a", "input_ids": [1, 2], "sampling": {}},
        {"type": "GenerateReq", "rid": "a", "input_ids": b"\x01\x00\x00", "sampling": {}},
    ],
)
def test_malformed_messages_are_value_errors(wire):
    with pytest.raises(ValueError):
        decode(msgpack.packb(wire))


def test_long_prompts_round_trip_packed():
    """A 64K-id prompt, ids across the whole int32 range a vocabulary can use, comes back as
    the read-only int32 array the engine takes; ids that are no int32 cannot be sent."""
    ids = [0, 1, 255, 256, 65_535, 65_536, 2**31 - 1] + list(range(0, 2**31 - 1, 32_771))[:65_000]
    back = decode(encode(GenerateReq("long", ids, SAMPLING)))
    assert back.input_ids.dtype == np.int32 and back.input_ids.tolist() == ids
    assert not back.input_ids.flags.writeable  # a view of the message's bytes
    unsendable = [
        ([1, 2**31], OverflowError),
        ([1, -(2**31) - 1], OverflowError),
        ([1, 2.0], TypeError),
        ([1, "2"], TypeError),
        ([None], TypeError),
    ]
    for bad, error in unsendable:
        with pytest.raises(error):
            encode(GenerateReq("bad", bad, SAMPLING))


def test_only_messages_are_sent():
    with pytest.raises(TypeError):
        encode(SAMPLING)


def test_api_process_imports_no_torch():
    """Every module of the API process, and the CLI parsing ``serve``, without torch."""
    code = """
import importlib, pkgutil, sys
import breakgraph.server
from breakgraph.cli import build_parser
build_parser().parse_args(["serve"])
from breakgraph.server.detokenize import load_tokenizer
load_tokenizer("smollm2-135m")  # a built-in name: resolved without the model loader
for m in pkgutil.iter_modules(breakgraph.server.__path__):
    if m.name != "engine_process":  # the engine process's own module
        importlib.import_module(f"breakgraph.server.{m.name}")
assert "breakgraph.server.launch" in sys.modules
torchy = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
assert not torchy, torchy[:5]
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
