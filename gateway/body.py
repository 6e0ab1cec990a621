"""A request body as JSON, refused with a clear reason when the parser cannot hold it.

Python's parser accepts what JSON (RFC 8259) does not, and fails in ways that are not JSONDecodeError:
nesting deep enough to exhaust the interpreter's stack (RecursionError), integers past Python's digit
limit (ValueError), the literals NaN and Infinity, and escapes of lone UTF-16 surrogates ("\\ud800"), which
become a str that cannot be encoded again (the tokenizer and every JSON response would fail on it). Each of
these is a `BodyError` with a message for the client (the gateway answers 400), never a 5xx.
"""

from __future__ import annotations

import json

MAX_DEPTH = 128  # arrays and objects inside each other; a JSON schema in a request is far shallower


class BodyError(ValueError):
    """The body is not JSON that a request can be made of; str(error) says why."""


def _no_constant(name: str):
    raise BodyError(f"{name} is not a JSON value")


def parse_body(data: bytes, max_depth: int = MAX_DEPTH):
    """The JSON value of `data` (UTF-8), checked for depth and lone surrogates."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BodyError(f"the body is not UTF-8: {exc}") from None
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise BodyError(f"the body nests arrays or objects deeper than {max_depth} levels") from None
    except BodyError:
        raise
    except ValueError as exc:  # JSONDecodeError, and integers longer than Python's digit limit
        raise BodyError(f"the body is not valid JSON: {exc}") from None
    # the walk only where it can find something: decoded UTF-8 holds no lone surrogate (only a \\u escape makes one),
    # and a value nests no deeper than the text's brackets could
    if "\\u" in text or text.count("[") + text.count("{") > max_depth:
        check_value(value, max_depth)
    return value


def check_value(value, max_depth: int = MAX_DEPTH) -> None:
    """Walks a parsed value without recursion: at most max_depth levels, every string (keys too) encodable."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            _check_text(item)
        elif isinstance(item, (list, dict)):
            if depth > max_depth:
                raise BodyError(f"the body nests arrays or objects deeper than {max_depth} levels")
            if isinstance(item, dict):
                for key in item:
                    _check_text(key)
                children = item.values()
            else:
                children = item
            stack.extend((child, depth + 1) for child in children if isinstance(child, (str, list, dict)))


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BodyError(f"a string in the body holds a lone surrogate ({text[exc.start:exc.end]!r} at {exc.start}); "
                        "it is not Unicode text") from None
