"""A request's body, read and parsed in the API process: size-limited, JSON checked for
depth, and the large prompts of ids parsed straight into int32-ready arrays.

Prompts run to 64K+ ids. Their common shapes (one flat prompt of ints, or a batch of them)
go through simdjson, which hands each prompt over as one int64 buffer; every other body
goes through orjson, with arrays of plain ints converted in one C pass (``IntList``).
"""

from __future__ import annotations

import array
import asyncio
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import orjson
from fastapi import Request

from breakgraph.common.codec import IdArray, IdList
from breakgraph.server.errors import APIError

try:  # simdjson hands a prompt's ids over as one int64 buffer (no Python int per id)
    import simdjson
except ImportError:  # every body goes to orjson
    simdjson = None

MAX_JSON_DEPTH = 32  # no request shape nests deeper than ~5; deeper bodies are refused
_CONTAINERS = frozenset((list, dict))  # the container types orjson produces
OFF_LOOP_BYTES = 64 << 10
R = TypeVar("R")


async def read_body(request: Request, limit_bytes: int) -> bytes:
    """The raw body, refused (413) as soon as it is known to exceed ``limit_bytes``."""
    too_large = APIError(
        f"the request body exceeds {limit_bytes} bytes (--max-request-bytes)", status=413
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit_bytes:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit_bytes:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def off_loop_if_large(raw: bytes, fn: Callable[..., R], *args: Any) -> R:
    """``fn(*args)``, in a worker thread when the body is large enough for its parsing and
    tokenization to stall the event loop (and with it every other client)."""
    if len(raw) < OFF_LOOP_BYTES:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


def parse_json(raw: bytes) -> Any:
    """A JSON body; malformed JSON, invalid UTF-8, lone surrogates, numbers out of a double's
    range and nesting deeper than MAX_JSON_DEPTH are all a 400."""
    body = _parse_prompt_body(raw)
    if body is not None:
        return body
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        if "depth" in str(e):  # orjson's own recursion limit (1024 in recent versions)
            raise APIError(f"the JSON body nests deeper than {MAX_JSON_DEPTH} levels") from None
        raise APIError(f"malformed JSON body: {e}") from None
    _check_depth(body)
    return body


class IntList(IdList):
    """A JSON array that the parser found to hold plain ints only (no bool), with their
    values as int64 (``values``, converted in the same C pass that checked them):
    ``check_input_ids`` checks only the range of a 64K-id prompt, and hands the array on
    with its int32 bytes (no copy: the parser made it)."""

    values: np.ndarray


_SIMDJSON = threading.local()  # a parser per thread (off_loop_if_large's threads)


def _parse_prompt_body(raw: bytes) -> dict[str, Any] | None:
    """The common large bodies, an object whose only arrays are its ``input_ids``: one flat
    prompt of ints (the whole body holds one ``[`` and one ``"input_ids"``), or a batch of
    them (one ``[`` more per prompt, each holding ints), parsed by simdjson: each prompt's
    ids come out as one int64 array (an ``IdArray``), not 64K Python ints converted and
    checked one by one. None for any other body, or one that simdjson refuses or might read
    otherwise than orjson (a bool, float or 64-bit-overflowing id, a repeated key, an empty
    prompt): ``parse_json`` parses it with orjson, whose errors name the problem."""
    if simdjson is None or raw[:1] != b"{" or raw.count(b'"input_ids"') != 1:
        return None  # (a body orjson refuses, such as one led by a BOM, goes to orjson)
    brackets = raw.count(b"[")
    if brackets != 1 and not _batch_of_arrays(raw):
        return None
    parser = getattr(_SIMDJSON, "parser", None)
    if parser is None:
        parser = _SIMDJSON.parser = simdjson.Parser()
    try:
        doc = parser.parse(raw)
        if not isinstance(doc, simdjson.Object):
            return None
        keys = list(doc.keys())
        ids = doc.get("input_ids")
        if len(set(keys)) != len(keys) or not isinstance(ids, simdjson.Array) or not len(ids):
            return None
        if brackets == 1:
            prompts: IdArray | list[IdArray] = IdArray(_int64(ids))
        else:  # every '[' is input_ids' or one of its rows': no other array, nothing deeper
            rows = [ids[i] for i in range(len(ids))]
            if brackets != 1 + len(rows) or not all(
                isinstance(r, simdjson.Array) and len(r) for r in rows
            ):
                return None
            prompts = [IdArray(_int64(r)) for r in rows]
            del rows  # (views into the parser's document, as below)
        body: dict[str, Any] = {}
        for key in keys:
            if key != "input_ids":
                value = doc[key]
                body[key] = value.as_dict() if isinstance(value, simdjson.Object) else value
        del doc, ids  # the parser is reused: nothing may point into its document
    except (ValueError, TypeError, KeyError, RuntimeError, UnicodeDecodeError):
        return None
    _check_depth(body)
    body["input_ids"] = prompts
    return body


def _int64(array: Any) -> np.ndarray:
    """A simdjson array of ints as int64, copied out of the parser's document (as_buffer
    flattens nested arrays: the caller's bracket count rules them out)."""
    return np.frombuffer(array.as_buffer(of_type="i"), dtype=np.int64)


def _batch_of_arrays(raw: bytes) -> bool:
    """Whether ``input_ids``' value opens with ``[`` then ``[`` (whitespace aside): a batch
    of prompts, worth simdjson's parse; a quick look before any parsing."""
    at = raw.find(b"[", raw.find(b'"input_ids"'))
    return at >= 0 and raw[at + 1 : at + 64].lstrip()[:1] == b"["


def int_values(items: list) -> np.ndarray | None:
    """``items`` as int64 in one C pass, or None unless all are plain ints. ``array('q')``
    refuses floats, strings, None, containers and ints past 64 bits; a bool it takes for 0
    or 1, so only the items that came out 0 or 1 (few in a prompt) are looked at again."""
    try:
        arr = np.frombuffer(array.array("q", items), dtype=np.int64)
    except (TypeError, OverflowError):
        return None
    for i in np.flatnonzero((arr == 0) | (arr == 1)).tolist():
        if type(items[i]) is bool:
            return None
    return arr


def _check_depth(body: Any) -> None:
    """Raise past MAX_JSON_DEPTH; arrays of plain ints inside containers become IntList."""
    stack = [(body, 1)] if isinstance(body, list | dict) else []
    while stack:
        obj, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise APIError(f"the JSON body nests deeper than {MAX_JSON_DEPTH} levels")
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        types = {*map(type, obj.values() if isinstance(obj, dict) else obj)}
        if _CONTAINERS.isdisjoint(types):
            continue  # only scalars (a prompt of 64K ids): one pass in C, not a Python loop
        for key, child in items:
            if type(child) is list and child and (arr := int_values(child)) is not None:
                obj[key] = IntList(child)  # scalars only: nothing deeper to check
                obj[key].values = arr
            elif isinstance(child, list | dict):
                stack.append((child, depth + 1))
