"""The tensor data plane behind the step channel's message header (ARCHITECTURE.md §4).

A message carries a protobuf envelope plus tensors. The envelope names each tensor (TensorInfo: name,
request, dtype, shape, frame index); the plane decides how the bytes travel. `FramePlane` puts them in
ZeroMQ frames after the envelope, zero-copy on the way out (a CPU tensor's buffer is the frame) and
one view per frame on the way in. `CudaIpcPlane` (the verifier's side) and `CudaIpcReader` (the
drafter's) move them through a buffer on the verifier's GPU that a drafter on the same host maps once:
a step's tensors are copied into it on the device, the envelope says where, and the drafter copies them
out to its own GPU (over NVLink or PCIe; the same GPU works too); nothing touches the host. The buffer is
a ring: the drafter acknowledges what it has copied (buffer_consumed), the verifier writes only over
acknowledged bytes, and a tensor that does not fit travels in a frame instead.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where tensors are: a drafter of no hidden states (NGRAM) never imports torch
    import torch

# the dtypes that travel, by name (torch's without "torch.")
DTYPES = ("float32", "float16", "bfloat16", "int32", "int64", "uint8", "int8", "bool")


@functools.cache
def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a name in DTYPES."""
    import torch

    return getattr(torch, name)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # torch dtype name without "torch."
    shape: tuple[int, ...]
    frame: int  # index among the frames after the envelope (-1: in the CUDA-IPC buffer)
    request_id: str = ""
    buffer_offset: int = -1  # byte offset in the CUDA-IPC buffer (-1: in a frame)
    buffer_end: int = 0  # the sender's running count of bytes written once this tensor is in the buffer


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
        import torch

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
        import torch

        tensors = []
        for info in infos:
            if info.dtype not in DTYPES:
                raise TensorError(f"tensor {info.name!r}: unknown dtype {info.dtype!r}")
            if not 0 <= info.frame < len(frames):
                raise TensorError(f"tensor {info.name!r}: frame {info.frame} missing ({len(frames)} frames came)")
            if any(d < 0 for d in info.shape):
                raise TensorError(f"tensor {info.name!r}: negative shape {info.shape}")
            dtype = torch_dtype(info.dtype)
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


ALIGN = 256  # tensors start at multiples of this in the CUDA-IPC buffer


class CudaIpcPlane(TensorPlane):
    """The verifier's side of the CUDA-IPC plane for one drafter: a ring buffer on its GPU, exported once
    (`export()`, sent in RegisterReply.cuda_ipc). pack() copies each tensor that fits into the unacknowledged
    part of the ring on the device (from the GPU, or from the host) and waits for the copies, so that the
    message can leave; the rest go into frames (FramePlane)."""

    name = "cuda-ipc"

    def __init__(self, device, size_bytes: int):
        import torch

        self.device = torch.device(device)
        self.size = int(size_bytes) // ALIGN * ALIGN
        if self.size <= 0:
            raise ValueError(f"a CUDA-IPC buffer of {size_bytes} bytes: at least {ALIGN}")
        self.buffer = torch.zeros(self.size, dtype=torch.uint8, device=self.device)
        self.reset()
        self.frames = FramePlane()
        self.bytes_in_buffer = 0
        self.bytes_in_frames = 0

    def reset(self) -> None:
        """Empty, for a new reader (a drafter's next session)."""
        self.written = 0  # running count of bytes placed (a place that would wrap skips to the start)
        self.consumed = 0  # what the drafter has acknowledged copying out

    def export(self) -> dict:
        """The CudaIpcBuffer fields: torch's CUDA IPC share of the buffer's storage."""
        (_, handle, size, offset, ref_handle, ref_offset, event_handle,
         event_sync) = self.buffer.untyped_storage()._share_cuda_()
        return {"device": device_identity(self.device), "handle": handle, "size_bytes": size, "offset_bytes": offset,
                "ref_counter_handle": ref_handle, "ref_counter_offset": ref_offset, "event_handle": event_handle or b"",
                "event_sync_required": bool(event_sync)}

    def acknowledge(self, consumed: int) -> None:
        if self.consumed < consumed <= self.written:
            self.consumed = consumed

    def _place(self, nbytes: int) -> tuple[int, int] | None:
        """(offset, running end) of nbytes in the ring past everything unacknowledged; None when full."""
        start = -(-self.written // ALIGN) * ALIGN
        offset = start % self.size
        if offset + nbytes > self.size:  # does not fit before the end: skip to the start
            start += self.size - offset
            offset = 0
        end = start + nbytes
        if nbytes > self.size or end - self.consumed > self.size:
            return None
        self.written = end
        return offset, end

    def pack(self, tensors):
        import torch

        infos, frames, copied = [], [], False
        for name, request_id, tensor in tensors:
            dtype = str(tensor.dtype).removeprefix("torch.")
            if dtype not in DTYPES:
                raise TensorError(f"tensor {name!r}: dtype {dtype} cannot travel")
            data = tensor.detach().contiguous().reshape(-1)
            nbytes = data.numel() * data.element_size()
            place = self._place(nbytes) if nbytes else None
            if place is None:
                _, extra = self.frames.pack([(name, request_id, tensor)])
                infos.append(TensorInfo(name, dtype, tuple(tensor.shape), len(frames), request_id))
                frames += extra
                self.bytes_in_frames += nbytes
                continue
            offset, end = place
            self.buffer[offset : offset + nbytes].copy_(data.view(torch.uint8), non_blocking=True)
            copied = True
            self.bytes_in_buffer += nbytes
            infos.append(TensorInfo(name, dtype, tuple(tensor.shape), -1, request_id, offset, end))
        if copied and self.device.type == "cuda":  # the drafter reads as soon as the message arrives
            torch.cuda.current_stream(self.device).synchronize()
        return infos, frames

    def unpack(self, infos, frames):
        raise TensorError("the verifier does not receive through its CUDA-IPC buffer")


class CudaIpcReader:
    """The drafter's side: the verifier's buffer mapped into this process (on this process's index of that
    GPU), read into `device`."""

    def __init__(self, fields: dict, device):
        import torch

        identity = fields["device"]
        index = local_cuda_index(identity)
        if index is None:
            raise TensorError(f"the verifier's GPU {identity} is not visible to this process")
        torch.cuda._lazy_init()
        storage = torch.UntypedStorage._new_shared_cuda(
            index, fields["handle"], fields["size_bytes"], fields["offset_bytes"], fields["ref_counter_handle"],
            fields["ref_counter_offset"], fields["event_handle"], fields["event_sync_required"])
        self.buffer = torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}").set_(
            storage, 0, (fields["size_bytes"],), (1,))
        self.device = torch.device(device)
        self.consumed = 0
        self.frames = FramePlane()

    def unpack(self, infos: list[TensorInfo], frames: list) -> list[tuple[str, str, torch.Tensor]]:
        """Like TensorPlane.unpack; tensors in the buffer come back on `device` (copies: the verifier reuses
        the buffer once they are acknowledged)."""
        import torch

        out, copied = [], False
        for info in infos:
            if info.buffer_offset < 0:
                out += self.frames.unpack([info], frames)
                continue
            if info.dtype not in DTYPES:
                raise TensorError(f"tensor {info.name!r}: unknown dtype {info.dtype!r}")
            dtype = torch_dtype(info.dtype)
            numel = 1
            for d in info.shape:
                numel *= d
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            if any(d < 0 for d in info.shape) or info.buffer_offset % ALIGN or info.buffer_offset + nbytes > self.buffer.numel():
                raise TensorError(f"tensor {info.name!r}: {nbytes} bytes at {info.buffer_offset} do not lie in the buffer")
            raw = self.buffer[info.buffer_offset : info.buffer_offset + nbytes]
            out.append((info.name, info.request_id, raw.view(dtype).reshape(info.shape).to(self.device, copy=True)))
            copied = True
            self.consumed = max(self.consumed, info.buffer_end)
        if copied:  # copied out before acknowledging
            for device in {self.buffer.device, self.device}:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
        return out


def visible_gpus() -> list[str]:
    """device_identity of every GPU this process sees."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [device_identity(f"cuda:{i}") for i in range(torch.cuda.device_count())]


def local_cuda_index(identity: str) -> int | None:
    """This process's index of the GPU named "cuda:<UUID>", or None."""
    for i, name in enumerate(visible_gpus()):
        if name == identity:
            return i
    return None


def device_identity(device) -> str:
    """A device as the step channel names it: "cuda:<GPU UUID>" (the same GPU whatever CUDA_VISIBLE_DEVICES
    each process has) or "cpu"."""
    if not str(device).startswith("cuda"):  # "cpu", torch.device("cpu"): no torch needed to name them
        return str(device).split(":")[0]
    import torch

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
