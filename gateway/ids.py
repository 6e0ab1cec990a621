"""Ids that must not repeat (a response's id, its requests' ids on the verifier's stream), drawn without a system call
each: uuid4 reads os.urandom every time, ~5% of the gateway's CPU per request under a burst (py-spy, this 2-core CPU).
A random tag per process (drawn again in a forked child), then a counter."""

from __future__ import annotations

import itertools
import os

_tag = os.urandom(8).hex()
_counter = itertools.count(1)


def _new_process() -> None:
    global _tag, _counter
    _tag, _counter = os.urandom(8).hex(), itertools.count(1)


os.register_at_fork(after_in_child=_new_process)


def process_tag() -> str:
    """16 hex digits, random, this process's."""
    return _tag


def unique_hex() -> str:
    """32 hex digits (uuid4().hex's shape): this process's tag, then its count of ids so far."""
    return f"{_tag}{next(_counter):016x}"
