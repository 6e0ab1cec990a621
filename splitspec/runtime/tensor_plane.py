"""The tensor data plane behind the step channel's message header (ARCHITECTURE.md §4).

A message carries a protobuf envelope plus tensors. The envelope names each tensor (TensorInfo: name,
request, dtype, shape, frame index); the plane decides how the bytes travel. `FramePlane` puts them in
ZeroMQ frames after the envelope, zero-copy on the way out (a CPU tensor's buffer is the frame) and
one view per frame on the way in. A CUDA-IPC or NCCL plane implements the same two calls, moving the
bytes between GPUs and leaving handles (or nothing) in the frames.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64,
                                                     torch.uint8, torch.int8, torch.bool)}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # torch dtype name without "torch."
    shape: tuple[int, ...]
    frame: int  # index among the frames after the envelope
    request_id: str = ""


class TensorError(ValueError):
    """Frames that do not match their description (missing, wrong size, unknown dtype)."""


class TensorPlane(ABC):
    name: str = ""

    @abstractmethod
    def pack(self, tensors: list[tuple[str, str, torch.Tensor]]) -> tuple[list[TensorInfo], list]:
        """(name, request_id, tensor) -> descriptions for the envelope and the frames to send after it."""

    @abstractmethod
    def unpack(self, infos: list[TensorInfo], frames: list) -> list[tuple[str, str, torch.Tensor]]:
        """The tensors described by infos, read from the frames that followed the envelope. Raises
        TensorError when a frame is missing or its size does not match."""


class FramePlane(TensorPlane):
    """Tensor bytes as ZeroMQ frames (the default plane; works between any two hosts)."""

    name = "zmq-frames"

    def pack(self, tensors):
        infos, frames = [], []
        for name, request_id, tensor in tensors:
            dtype = str(tensor.dtype).removeprefix("torch.")
            if dtype not in DTYPES:
                raise TensorError(f"tensor {name!r}: dtype {dtype} cannot travel")
            data = tensor.detach().to("cpu").contiguous()
            infos.append(TensorInfo(name, dtype, tuple(data.shape), len(frames), request_id))
            frames.append(memoryview(data.reshape(-1).view(torch.uint8).numpy()) if data.numel() else b"")
        return infos, frames

    def unpack(self, infos, frames):
        tensors = []
        for info in infos:
            if info.dtype not in DTYPES:
                raise TensorError(f"tensor {info.name!r}: unknown dtype {info.dtype!r}")
            if not 0 <= info.frame < len(frames):
                raise TensorError(f"tensor {info.name!r}: frame {info.frame} missing ({len(frames)} frames came)")
            if any(d < 0 for d in info.shape):
                raise TensorError(f"tensor {info.name!r}: negative shape {info.shape}")
            dtype = DTYPES[info.dtype]
            data = frames[info.frame]
            buffer = data.buffer if hasattr(data, "buffer") else data  # zmq.Frame or bytes
            numel = 1
            for d in info.shape:
                numel *= d
            expected = numel * torch.empty((), dtype=dtype).element_size()
            if len(buffer) != expected:
                raise TensorError(f"tensor {info.name!r}: frame has {len(buffer)} bytes, {info.shape} {info.dtype} needs {expected}")
            raw = torch.frombuffer(bytearray(buffer), dtype=torch.uint8) if expected else torch.empty(0, dtype=torch.uint8)
            tensors.append((info.name, info.request_id, raw.view(dtype).reshape(info.shape)))
        return tensors


def device_identity(device) -> str:
    """A device as the step channel names it: "cuda:<GPU UUID>" (the same GPU whatever CUDA_VISIBLE_DEVICES
    each process has) or "cpu"."""
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    return f"cuda:{torch.cuda.get_device_properties(device).uuid}"


def frame_bytes(frames: list) -> int:
    total = 0
    for frame in frames:
        buffer = frame.buffer if hasattr(frame, "buffer") else frame
        total += len(buffer)
    return total
