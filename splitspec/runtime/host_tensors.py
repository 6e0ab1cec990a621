"""Python ints as host tensors, fast: a speculative step turns several lists of a few hundred ints into tensors
(slots, positions, token ids, page indices and index lists) on the engine's thread, whose host time bounds the step."""

from __future__ import annotations

import array

import torch

_TYPECODES = {torch.long: "q", torch.int32: "i"}


def host_tensor(values, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A flat sequence of Python ints as a host tensor of dtype (int64 or int32): the ints packed by the array module
    and the tensor made over its buffer (which the tensor keeps alive), ~3.5x faster than torch.tensor(list) for a
    few hundred ints. TypeError for anything but ints; OverflowError for an int the dtype cannot hold."""
    if not len(values):
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(array.array(_TYPECODES[dtype], values), dtype=dtype)


def copy_to_host(tensor: torch.Tensor) -> tuple[torch.Tensor, "torch.cuda.Event | None"]:
    """(host tensor, event) for a copy started without waiting: a device tensor goes into pinned memory behind an
    event (synchronize it before reading the host tensor); a host tensor is returned as is, with no event."""
    if not tensor.is_cuda:
        return tensor, None
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return host, copied
