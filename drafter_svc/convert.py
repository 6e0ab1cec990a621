"""The only drafter module that touches generated protobuf classes: step-channel wire <-> internal types."""

from __future__ import annotations

import time

from splitspec.protos import step_pb2 as pb
from splitspec.runtime.tensor_plane import TensorInfo
from splitspec.runtime.tree import DraftTree


def envelope(name: str, epoch: int, session: int, **kind) -> pb.DrafterMessage:
    message = pb.DrafterMessage(sender=pb.DrafterIdentity(name=name, instance_epoch=epoch, session=session))
    for field, value in kind.items():
        getattr(message, field).CopyFrom(value)
    return message


def register(algorithm: str, draft_model: str, vocab_size: int, layers: list[int], capacity: int, max_nodes: int,
             metrics_port: int = 0, metrics_host: str = "", device: str = "", bets: bool = False,
             visible_gpus: list[str] = ()) -> pb.Register:
    return pb.Register(algorithm=algorithm, draft_model=draft_model, vocab_size=vocab_size, hidden_state_layers=layers,
                       capacity=capacity, max_tree_nodes=max_nodes, metrics_port=metrics_port, metrics_host=metrics_host,
                       device=device, bets=bets, visible_gpus=visible_gpus)


def heartbeat(num_requests: int, steps: int, cuda_ipc_ready: bool = False, buffer_consumed: int = 0) -> pb.Heartbeat:
    return pb.Heartbeat(num_requests=num_requests, steps=steps, cuda_ipc_ready=cuda_ipc_ready, buffer_consumed=buffer_consumed)


def cuda_ipc_fields(buffer: pb.CudaIpcBuffer) -> dict:
    """RegisterReply.cuda_ipc as runtime.tensor_plane.CudaIpcReader takes it."""
    return {f: getattr(buffer, f) for f in ("device", "handle", "size_bytes", "offset_bytes", "ref_counter_handle",
                                             "ref_counter_offset", "event_handle", "event_sync_required")}


def draft_reply(step_id: int, trees: list[tuple[str, DraftTree]], seconds: float, unknown: list[str],
                received_ns: int = 0, buffer_consumed: int = 0) -> pb.DraftReply:
    """received_ns: the wall clock when the DraftRequest arrived; the reply is stamped as it is built."""
    reply = pb.DraftReply(step_id=step_id, draft_seconds=seconds, unknown_request_ids=unknown, received_unix_ns=received_ns,
                          buffer_consumed=buffer_consumed,
                          trees=[pb.WireTree(request_id=r, tokens=t.tokens, parents=t.parents) for r, t in trees])
    reply.sent_unix_ns = time.time_ns()
    return reply


def draft_bets(step_id: int, bets: list[tuple[str, object]], seconds: float, received_ns: int = 0) -> pb.DraftBets:
    """bets: (request id, base.Bet)."""
    message = pb.DraftBets(step_id=step_id, draft_seconds=seconds, received_unix_ns=received_ns, bets=[
        pb.WireBet(request_id=r, outcome=b.outcome, tree=pb.WireTree(request_id=r, tokens=b.tree.tokens, parents=b.tree.parents))
        for r, b in bets])
    message.sent_unix_ns = time.time_ns()
    return message


def parse_verifier(data: bytes) -> pb.VerifierMessage:
    message = pb.VerifierMessage()
    message.ParseFromString(data)
    return message


def tensor_infos(message: pb.VerifierMessage) -> list[TensorInfo]:
    return [TensorInfo(t.name, t.dtype, tuple(t.shape), -1 if t.in_buffer else t.frame, t.request_id,
                       t.buffer_offset if t.in_buffer else -1, t.buffer_end) for t in message.tensors]
