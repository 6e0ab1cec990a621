"""The CUDA-IPC tensor plane (runtime.tensor_plane): its ring protocol on any device, and the mapping of a
verifier's buffer into another process on a GPU (skipped without CUDA).

The ring: tensors go to offsets past everything the drafter has not acknowledged; a tensor that does not
fit travels in a frame; acknowledging frees room; the envelope's TensorMeta carries offsets through the
wire format."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from splitspec import lifeline
from splitspec.runtime.tensor_plane import ALIGN, CudaIpcPlane, CudaIpcReader, FramePlane, TensorError


def reader_over(plane: CudaIpcPlane, device="cpu") -> CudaIpcReader:
    """A reader of the plane's own buffer in this process (the mapping is what the GPU test covers)."""
    reader = CudaIpcReader.__new__(CudaIpcReader)
    reader.buffer, reader.device, reader.consumed, reader.frames = plane.buffer, torch.device(device), 0, FramePlane()
    return reader


def through_the_wire(infos):
    """TensorInfos as the verifier writes them into a VerifierMessage and the drafter reads them back."""
    from splitspec.drafter_svc import convert as drafter_convert
    from splitspec.protos import step_pb2
    from splitspec.verifier_svc import convert as verifier_convert

    message = step_pb2.VerifierMessage()
    message.tensors.extend(verifier_convert._tensor_metas(infos))
    return drafter_convert.tensor_infos(step_pb2.VerifierMessage.FromString(message.SerializeToString()))


def test_the_ring_places_acknowledges_and_falls_back_to_frames():
    plane = CudaIpcPlane("cpu", 4 * ALIGN)
    reader = reader_over(plane)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 20, generator=g).bfloat16()  # 120 bytes: one slot
    b = torch.randn(50, generator=g)  # 200 bytes: one slot
    big = torch.randn(300, generator=g)  # 1200 bytes: more than the ring
    infos, frames = plane.pack([("hidden_states", "r0", a), ("hidden_states", "r1", b), ("x", "r2", big)])
    assert [i.buffer_offset for i in infos] == [0, ALIGN, -1] and len(frames) == 1
    got = {rid: t for _, rid, t in reader.unpack(through_the_wire(infos), frames)}
    assert torch.equal(got["r0"], a) and torch.equal(got["r1"], b) and torch.equal(got["r2"], big)
    assert reader.consumed == infos[1].buffer_end == ALIGN + 200
    # unacknowledged: two more slots fit, the third does not (it would overwrite r0's bytes)
    infos, frames = plane.pack([(n, "r", a) for n in "pqs"])
    assert [i.buffer_offset for i in infos] == [2 * ALIGN, 3 * ALIGN, -1] and len(frames) == 1
    plane.acknowledge(reader.consumed)  # the drafter copied r0 and r1 out: their slots are free again
    infos, frames = plane.pack([("t", "r", b)])
    assert [i.buffer_offset for i in infos] == [0] and not frames
    plane.acknowledge(10**9)  # an acknowledgement past what was written is ignored
    assert plane.consumed == ALIGN + 200


def test_a_reader_refuses_offsets_outside_its_buffer():
    plane = CudaIpcPlane("cpu", 2 * ALIGN)
    infos, frames = plane.pack([("hidden_states", "r0", torch.ones(4))])
    bad = [type(infos[0])(i.name, i.dtype, (1000,), -1, i.request_id, i.buffer_offset, i.buffer_end) for i in infos]
    with pytest.raises(TensorError):
        reader_over(plane).unpack(bad, frames)
    misaligned = [type(infos[0])(i.name, i.dtype, i.shape, -1, i.request_id, 4, i.buffer_end) for i in infos]
    with pytest.raises(TensorError):
        reader_over(plane).unpack(misaligned, frames)


CHILD = r"""
import hashlib, json, sys
import torch
from splitspec.runtime.tensor_plane import CudaIpcReader, TensorInfo
spec = json.loads(sys.stdin.read())
fields = {k: bytes.fromhex(v) if k in ("handle", "ref_counter_handle", "event_handle") else v for k, v in spec["fields"].items()}
reader = CudaIpcReader(fields, spec["device"])
infos = [TensorInfo(**i) for i in spec["infos"]]
out = {rid: [str(t.device), hashlib.sha256(t.cpu().view(torch.uint8).numpy().tobytes()).hexdigest()]
       for _, rid, t in reader.unpack(infos, [])}
print(json.dumps({"tensors": out, "consumed": reader.consumed}))
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CUDA IPC maps GPU memory between processes)")
def test_another_process_maps_the_buffer_and_copies_tensors_to_its_gpu():
    """The drafter's side in its own process (CUDA IPC cannot map into the process that exported): it
    maps the verifier's buffer on its index of that GPU and copies each tensor to its own device (the
    last GPU: another one where there are two), byte for byte."""
    import dataclasses
    import hashlib

    plane = CudaIpcPlane("cuda:0", 1 << 20)
    g = torch.Generator(device="cuda").manual_seed(1)
    tensors = {"r0": torch.randn(6, 12288, device="cuda", generator=g).bfloat16(),
               "r1": torch.randn(2, 4096, device="cuda", generator=g)}
    infos, frames = plane.pack([("hidden_states", rid, t) for rid, t in tensors.items()])
    assert not frames and all(i.buffer_offset >= 0 for i in infos)
    fields = {k: v.hex() if isinstance(v, bytes) else v for k, v in plane.export().items()}
    target = f"cuda:{torch.cuda.device_count() - 1}"
    spec = {"fields": fields, "device": target, "infos": [dataclasses.asdict(i) for i in infos]}
    child = lifeline.run([sys.executable, "-c", CHILD], input=json.dumps(spec), capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-3000:]
    result = json.loads(child.stdout.strip().splitlines()[-1])
    for rid, t in tensors.items():
        assert result["tensors"][rid] == [target, hashlib.sha256(t.cpu().view(torch.uint8).numpy().tobytes()).hexdigest()]
    assert result["consumed"] == infos[-1].buffer_end
