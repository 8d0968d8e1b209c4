"""The flags' value types: a value out of range is refused when the flags are parsed, before
anything loads, in argparse's one line (``must be ..., got ...``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def _number(text: str, kind: type) -> int | float:
    try:
        return kind(text)
    except ValueError:
        name = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"must be {name}, got {text!r}") from None


def _checked(kind: type, ok: Callable[[float], bool], rule: str) -> Callable[[str], int | float]:
    """A flag type parsing ``kind`` and refusing a value that is not ``ok``: "must be
    {rule}, got {text}"."""

    def parse(text: str) -> int | float:
        value = _number(text, kind)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value

    return parse


positive_int = _checked(int, lambda v: v > 0, "a positive integer")
non_negative_int = _checked(int, lambda v: v >= 0, ">= 0")
positive_float = _checked(float, lambda v: v > 0, "> 0")
non_negative_float = _checked(float, lambda v: v >= 0, ">= 0")
fraction = _checked(float, lambda v: 0 < v <= 1, "in (0, 1]")
at_least_one = _checked(float, lambda v: v >= 1, ">= 1")
