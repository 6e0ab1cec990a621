"""A request's numbers as JSON has them, checked under strict types (gateway/protocol.py's models): a finite float
in its range, an integer in its range (JSON has one number type: 3.0 is the integer 3, as JSON Schema says; 3.5,
`true` and "3" are not integers), and a list of such integers (token ids) checked by pydantic's own code."""

from __future__ import annotations

from typing import Annotated

from pydantic import BeforeValidator, Field

FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32: the wire's floats are 32-bit


def number(low: float, high: float, *, positive: bool = False):
    """A finite number in [low, high]; positive: above zero as a float32 too (a smaller one would reach the
    verifier as 0)."""
    return Annotated[float, Field(ge=FLOAT32_TINY if positive else low, le=high), Field(allow_inf_nan=False)]


def _integral(value):
    """JSON has one number type: 3.0 is the integer 3 (as JSON Schema says); 3.5 is not an integer."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def integer(low: int, high: int):
    """An integer in [low, high] (3.0 is 3)."""
    return Annotated[int, Field(ge=low, le=high), BeforeValidator(_integral)]


def _integral_items(value):
    """_integral over a list's items, in one call: a list of ints alone (a prompt's token ids, the usual case) is
    passed on as it is, checked by pydantic's own code (a Python validator per item cost ~130 calls a prompt)."""
    if isinstance(value, list) and set(map(type, value)) - {int}:
        return [_integral(v) for v in value]
    return value


def integers(low: int, high: int, **field):
    """A list of integers in [low, high] (3.0 is 3, as for integer)."""
    return Annotated[list[Annotated[int, Field(ge=low, le=high)]], Field(**field), BeforeValidator(_integral_items)]
