"""API-side validation without a server: a 64K-id prompt is accepted with its int32 bytes,
and a bad one is a one-line 400 naming the field, the index and the value of its first bad id."""

from __future__ import annotations

import array
import enum
import re

import orjson
import pytest

from breakgraph.common import codec, messages
from breakgraph.common.messages import ModelInfo
from breakgraph.common.sampling_params import SamplingParams
from breakgraph.server.errors import APIError
from breakgraph.server.json_body import IntList, parse_json
from breakgraph.server.protocol import GenerateReqInput, check_input_ids, parse_model, prompts_of

INFO = ModelInfo("m", "LlamaForCausalLM", 256, 131_072, 64, 1 << 20, "float32", "cpu", 1)
LONG = 65_536


class _Tok(enum.IntEnum):
    A = 7


def test_a_long_valid_prompt_comes_back_with_its_int32_bytes():
    """The ids, with the bytes the engine message carries (not packed a second time)."""
    ids = [i % 256 for i in range(LONG)]
    out = check_input_ids(ids, INFO)
    assert out == ids
    assert out.packed == array.array("i", ids).tobytes() == codec._pack_int32(out)
    msg = messages.GenerateReq("r", out, SamplingParams(max_new_tokens=1))
    assert messages.decode(messages.encode(msg)).input_ids.tolist() == ids
    subclassed = [1, _Tok.A, 255]  # an int subclass is an int (not on the fast path)
    assert check_input_ids(subclassed, INFO) is subclassed


@pytest.mark.parametrize(
    "bad,words",
    [
        (-1, "token id -1 is out of range [0, 256)"),
        (256, "token id 256 is out of range [0, 256)"),
        (2**63, f"token id {2**63} is out of range [0, 256)"),  # past int64: still named, not a 500
        (True, "token id True is not an integer"),
        (1.0, "token id 1.0 is not an integer"),
        ("5", "token id '5' is not an integer"),
        (None, "token id None is not an integer"),
        ([1], "token id [1] is not an integer"),
    ],
)
@pytest.mark.parametrize("pos", [0, 1, LONG // 2, LONG - 1])
def test_the_first_bad_id_is_named_by_field_and_index(bad, words, pos):
    ids = [3] * LONG
    ids[pos] = bad
    if pos < LONG - 1:
        ids[-1] = -5  # a later bad id is not the one named
    with pytest.raises(APIError) as e:
        check_input_ids(ids, INFO, "input_ids[2]")
    assert e.value.message == f"input_ids[2][{pos}]: {words}"
    assert e.value.status == 400


def test_a_huge_bad_value_keeps_the_message_short():
    with pytest.raises(APIError) as e:
        check_input_ids([1, "x" * 10_000], INFO)
    assert e.value.message.startswith("input_ids[1]: token id 'xxx") and len(e.value.message) < 100


def test_not_a_list_and_empty():
    with pytest.raises(APIError, match="prompt must be a list of integers, got dict"):
        check_input_ids({}, INFO, "prompt")
    with pytest.raises(APIError, match="the prompt is empty"):
        check_input_ids([], INFO)


def test_depth_is_checked_inside_long_lists():
    flat = {"input_ids": [1] * LONG, "sampling_params": {"max_new_tokens": 1}}
    assert parse_json(orjson.dumps(flat)) == flat
    deep: list = [1]
    for _ in range(40):
        deep = [deep]
    for where in (0, LONG // 2, LONG):  # a nested list anywhere in a long list is still seen
        ids: list = [1] * LONG
        ids.insert(where, deep)
        with pytest.raises(APIError, match="nests deeper than 32"):
            parse_json(orjson.dumps({"input_ids": ids}))
    batch = {"input_ids": [[1] * 8192 for _ in range(8)]}
    assert parse_json(orjson.dumps(batch)) == batch


def test_bools_in_int_arrays_are_found_whatever_else_the_body_holds():
    """Int arrays are converted by array('q'), which takes a bool for 0 or 1: a bool inside
    one is still found, beside ids 0 and 1 and other bools in the body."""
    for extra in ({}, {"stream": True}, {"stream": False, "x": [True]}):
        body = parse_json(orjson.dumps({"input_ids": [[1, 0, 2], [3, 1, True], [False]], **extra}))
        clean, with_bool, only_bool = body["input_ids"]
        assert type(clean) is IntList and clean.values.tolist() == [1, 0, 2], extra
        assert type(with_bool) is list and type(only_bool) is list, extra
        with pytest.raises(APIError, match=r"input_ids\[2\]: token id True is not an integer"):
            check_input_ids(with_bool, INFO)


def test_parsed_int_arrays_skip_the_type_pass_and_leave_as_id_lists():
    """The depth check marks arrays of plain ints (IntList); check_input_ids then checks
    only their range and hands on an IdList with their int32 bytes. Arrays with a bool, a float or a nested
    array stay plain lists and meet the full check (the same 400s)."""
    body = parse_json(orjson.dumps({
        "input_ids": [[5] * LONG, [1, True], [1, 2.0], [1, [2]], [256, 3]],
        "sampling_params": {"stop_token_ids": [3, 4]},
    }))  # fmt: skip
    ints, with_bool, with_float, nested, out_of_range = body["input_ids"]
    assert type(ints) is IntList and type(out_of_range) is IntList
    assert type(body["sampling_params"]["stop_token_ids"]) is IntList
    assert all(type(x) is list for x in (with_bool, with_float, nested))
    got = check_input_ids(ints, INFO)
    assert got is ints and got == [5] * LONG and len(got.packed) == 4 * LONG  # no copy
    for ids, words in [
        (with_bool, "input_ids[1]: token id True is not an integer"),
        (with_float, "input_ids[1]: token id 2.0 is not an integer"),
        (nested, "input_ids[1]: token id [2] is not an integer"),
        (out_of_range, "input_ids[0]: token id 256 is out of range [0, 256)"),
    ]:
        with pytest.raises(APIError) as e:
            check_input_ids(ids, INFO)
        assert e.value.message == words


def test_a_single_prompt_body_parses_its_ids_as_one_array():
    """simdjson's fast path (one ``[`` in the body: a flat input_ids): the ids come out as an
    IdArray without a Python int each; check_input_ids checks their range and packs them,
    the same bytes and the same 400 as the list path."""
    from breakgraph.common.codec import IdArray
    from breakgraph.server.json_body import simdjson

    if simdjson is None:
        pytest.skip("pysimdjson not installed")
    ids = [i % 256 for i in range(LONG)]
    body = parse_json(orjson.dumps({"input_ids": ids, "stream": True,
                                    "sampling_params": {"max_new_tokens": 3, "temperature": 0}}))  # fmt: skip
    assert body["stream"] is True and body["sampling_params"] == {
        "max_new_tokens": 3,
        "temperature": 0,
    }
    got = check_input_ids(body["input_ids"], INFO)
    assert type(got) is IdArray and len(got) == LONG and got == ids
    assert got[3] == 3 and got[-2:] == ids[-2:] and got + [1] == ids + [1] and list(got) == ids
    assert got.packed == array.array("i", ids).tobytes() == codec._pack_int32(got)
    msg = messages.GenerateReq("r", got, SamplingParams(max_new_tokens=1))
    assert messages.decode(messages.encode(msg)).input_ids.tolist() == ids
    for bad, words in ((256, "input_ids[2]: token id 256 is out of range [0, 256)"),
                       (-3, "input_ids[2]: token id -3 is out of range [0, 256)")):  # fmt: skip
        fast = parse_json(orjson.dumps({"input_ids": [1, 2, bad, 4]}))["input_ids"]
        assert type(fast) is IdArray
        with pytest.raises(APIError, match=re.escape(words)):
            check_input_ids(fast, INFO)
        with pytest.raises(APIError, match=re.escape(words)):
            check_input_ids([1, 2, bad, 4], INFO)


def test_a_batch_body_parses_each_prompt_as_one_array():
    """A batch of id prompts (input_ids' rows the body's only other arrays) takes the same
    fast path, one IdArray per row: the same prompts, bytes and 400s as orjson's lists."""
    from breakgraph.common.codec import IdArray
    from breakgraph.server.json_body import simdjson

    if simdjson is None:
        pytest.skip("pysimdjson not installed")
    rows = [[i % 256 for i in range(n)] for n in (LONG, 7, 1)]
    for raw in (orjson.dumps({"input_ids": rows, "sampling_params": {"max_new_tokens": 2}}),
                b'{"rid": "x", "input_ids" : [ \n [1, 2] ,[3]]}'):  # fmt: skip
        body = parse_json(raw)
        assert all(type(r) is IdArray for r in body["input_ids"])
        req = parse_model(GenerateReqInput, body)
        prompts, is_batch = prompts_of(req, None, INFO)
        want = orjson.loads(raw)["input_ids"]
        assert is_batch and [list(p) for p in prompts] == want
        assert [p.packed for p in prompts] == [array.array("i", w).tobytes() for w in want]
    body = parse_json(orjson.dumps({"input_ids": [[1, 2], [3, 256]]}))
    with pytest.raises(APIError, match=re.escape("input_ids[1][1]: token id 256 is out of range")):
        prompts_of(parse_model(GenerateReqInput, body), None, INFO)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"input_ids": [[1, 2], [3, true]]}',  # a batch: a bool
        b'{"input_ids": [[1, 2], []]}',  # a batch: an empty prompt
        b'{"input_ids": [[1, 2], 3]}',  # a batch: a row that is an id
        b'{"input_ids": [[1, [2]], [3]]}',  # a batch: nested deeper
        b'{"input_ids": [[1, 2], [3]], "rid": "["}',  # a batch: a bracket in a string
        b'{"input_ids": [[1, 2], [3]], "sampling_params": {"stop": ["a"]}}',  # another array
        b'{"input_ids": [1, true, 3]}',  # a bool
        b'{"input_ids": [1, 2.0, 3]}',  # a float
        b'{"input_ids": [1, 18446744073709551615]}',  # past 64 bits
        b'{"input_ids": [1, 2], "input_ids": [3]}',  # a repeated key (one "input_ids" count)
        b'{"input_ids": [1, 2], "stream": true, "stream": false}',  # a repeated key
        b'{"input_ids": []}',  # empty
        b'{"input_ids": [1, 2], "sampling_params": {"stop": ["a"]}}',  # a second array
        b'{"text": "[1]", "rid": "input_ids"}',  # no input_ids array
        b'{"input_ids": [1, 2}',  # malformed
        b'\xef\xbb\xbf{"input_ids": [1, 2]}',  # a BOM (orjson refuses it)
        b'{"input_ids": [1], "rid": "\\ud800"}',  # a lone surrogate
    ],
)
def test_bodies_off_the_fast_path_parse_as_before(raw, monkeypatch):
    """Anything but a clean single prompt goes to orjson: the same dict, errors, 400s."""
    from breakgraph.server import json_body

    got = _parsed(raw)
    monkeypatch.setattr(json_body, "simdjson", None)
    assert got == _parsed(raw)


def _parsed(raw: bytes) -> tuple[str, object]:
    try:
        return "ok", parse_json(raw)
    except APIError as e:
        return "error", str(e)


def test_events_and_bodies_are_valid_json_with_non_finite_floats():
    """SSE events and whole generation bodies go through orjson: UTF-8 as it is, a -inf
    logprob (a masked token) as null, not the standard library's invalid ``-Infinity``."""
    import json

    from breakgraph.server.sse import DONE, GenerationResponse, sse

    data = {"text": "café ☕", "logprobs": [-0.5, float("-inf")], "ids": [1, 2]}
    event = sse(data)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    back = json.loads(event[len(b"data: ") :])
    assert back == {"text": "café ☕", "logprobs": [-0.5, None], "ids": [1, 2]}
    assert "café ☕".encode() in event  # not \\u-escaped
    assert json.loads(GenerationResponse(data).body) == back
    assert DONE == b"data: [DONE]\n\n"
