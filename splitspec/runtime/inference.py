"""torch.inference_mode as a decorator that costs nothing where it is on already.

A drafted step nests several calls that each enter inference mode (the target's forward, the head's catch-up, the
draft loop's launch); each enter and exit of torch.inference_mode() costs 2-5 us of host time, on a path whose host
time is the step's time at small batch. The engine's step enters it once (Engine.step) and the calls inside check.
"""

from __future__ import annotations

import functools

import torch


def inference(fn):
    """fn run under torch.inference_mode(), entered only where it is not on already."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode():
            return fn(*args, **kwargs)

    return run
