"""Wire <-> internal types for the verifier: the gateway's API (verifier.proto) and the drafters' step
channel (step.proto). Imports no torch (the verifier's front process uses it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from splitspec.protos import step_pb2 as step_pb
from splitspec.protos import verifier_pb2 as pb
from splitspec.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:  # the verifier's front process converts without importing the engine (torch)
    from splitspec.verifier_svc.step_types import Request, SpecStats

FINISH_REASONS = {None: pb.FINISH_REASON_UNSPECIFIED, "stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
                  "abort": pb.FINISH_REASON_ABORT, "error": pb.FINISH_REASON_ERROR}


def sampling_params(wire: pb.SamplingParams) -> SamplingParams:
    """Raises ValueError naming the bad value."""
    return SamplingParams(
        temperature=wire.temperature, top_p=wire.top_p if wire.top_p else 1.0, top_k=wire.top_k if wire.top_k else -1,
        seed=wire.seed if wire.HasField("seed") else None, max_new_tokens=wire.max_new_tokens,
        ignore_eos=wire.ignore_eos, stop_token_ids=tuple(wire.stop_token_ids),
        frequency_penalty=wire.frequency_penalty, presence_penalty=wire.presence_penalty,
        repetition_penalty=wire.repetition_penalty if wire.HasField("repetition_penalty") else 1.0,
        logprobs=wire.top_logprobs if wire.HasField("top_logprobs") else None,
        logit_bias=tuple(sorted(wire.logit_bias.items())), min_p=wire.min_p, min_tokens=wire.min_tokens,
        prompt_logprobs=wire.prompt_logprobs if wire.HasField("prompt_logprobs") else None,
        grammar=(wire.grammar_kind, wire.grammar) if wire.grammar_kind else None,
    )


def fill_speculation(message: pb.SpeculationCounts, stats: SpecStats) -> None:
    message.verify_steps, message.draft_tokens = stats.verify_steps, stats.draft_tokens
    message.accepted_tokens, message.fallbacks = stats.accepted_tokens, stats.fallbacks
    message.accepted_per_position[:] = stats.accepted_per_position


def status_code(message: str) -> int:
    """The gRPC status code number an error message names ("INVALID_ARGUMENT: ..." -> 3); INTERNAL otherwise."""
    import grpc

    name = message.split(":", 1)[0].strip()
    code = grpc.StatusCode.__members__.get(name, grpc.StatusCode.INTERNAL)
    return code.value[0]


def _logprobs(entries) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(logprob=lp.logprob, top_token_ids=[t for t, _ in lp.top], top_logprobs=[v for _, v in lp.top])
            for lp in entries]


def fill_delta(message: pb.TokenDelta, client_id: str, request: Request | None, token_ids: list[int],
               finish_reason: str | None, first: bool, error: str = "", logprobs=None, prompt_logprobs=None,
               counts: bool = True) -> None:
    """A delta for one request, written into message in place: the part of a step's delta that its columns do not
    hold (step_columns.py: a request's first and last, errors, logprobs), or a whole one. counts False: the
    speculation counts stay out (unchanged since the last delta that carried them: step_columns.write)."""
    message.request_id = client_id
    message.token_ids.extend(token_ids)
    if finish_reason is not None:
        message.finish_reason = FINISH_REASONS[finish_reason]
    if error:
        message.error, message.error_code = error, status_code(error)
    if logprobs:
        message.logprobs.extend(_logprobs(logprobs))
    if prompt_logprobs:
        message.prompt_logprobs.extend(_logprobs(prompt_logprobs))
    if request is not None:
        if counts:
            fill_speculation(message.speculation, request.stats)
        message.num_preemptions = request.num_preemptions
        if first or finish_reason is not None:
            message.prompt_tokens = len(request.prompt_ids)
            message.cached_prompt_tokens = request.cached_tokens
        if first:
            message.seed = request.params.seed or 0


def error(client_id: str, message: str) -> pb.TokenDelta:
    return pb.TokenDelta(request_id=client_id, finish_reason=pb.FINISH_REASON_ERROR, error=message,
                         error_code=status_code(message))


# the step channel (verifier side) ------------------------------------------------------------------


class WireError(ValueError):
    """A drafter's envelope that cannot be read."""


def parse_drafter(data: bytes) -> step_pb.DrafterMessage:
    message = step_pb.DrafterMessage()
    try:
        message.ParseFromString(data)
    except Exception as exc:  # noqa: BLE001 (protobuf's DecodeError and friends)
        raise WireError(f"unreadable envelope ({len(data)} bytes): {exc}") from None
    if not message.HasField("sender") or message.WhichOneof("kind") is None:
        raise WireError("envelope without sender or content")
    return message


def tree_problem(wire: step_pb.WireTree, max_nodes: int, vocab_size: int) -> str | None:
    """What is wrong with a tree from the wire, or None: node 0 the root, every other node's parent an
    earlier node (so no cycles), at most max_nodes nodes, every token inside the vocabulary."""
    if len(wire.tokens) > max_nodes:  # before copying anything a hostile peer sent
        return f"{len(wire.tokens)} nodes, the budget is {max_nodes}"
    tokens, parents = list(wire.tokens), list(wire.parents)
    if not tokens or len(tokens) != len(parents):
        return f"{len(tokens)} tokens for {len(parents)} parents"
    if parents[0] != -1:
        return "node 0 is not the root"
    bad = next((i for i, p in enumerate(parents[1:], start=1) if not 0 <= p < i), None)
    if bad is not None:
        return f"node {bad} has parent {parents[bad]} (parents must be earlier nodes)"
    if any(not 0 <= t < vocab_size for t in tokens):
        return f"a token outside the vocabulary [0, {vocab_size})"
    return None


def _verifier_message(epoch: int, session: int, **kind) -> step_pb.VerifierMessage:
    message = step_pb.VerifierMessage(verifier_epoch=epoch, session=session)
    for name, value in kind.items():
        getattr(message, name).CopyFrom(value)
    return message


def register_reply(epoch: int, session: int, accepted: bool, reason: str, heartbeat_timeout: float,
                   cuda_ipc: dict | None = None):
    """cuda_ipc: CudaIpcBuffer fields (runtime.tensor_plane.CudaIpcPlane.export) to offer."""
    reply = step_pb.RegisterReply(accepted=accepted, reason=reason, session=session,
                                  heartbeat_timeout_seconds=heartbeat_timeout)
    if cuda_ipc is not None:
        reply.cuda_ipc.CopyFrom(step_pb.CudaIpcBuffer(**cuda_ipc))
    return _verifier_message(epoch, session, register_reply=reply)


def heartbeat_reply(epoch: int, session: int, known: bool):
    return _verifier_message(epoch, session, heartbeat_reply=step_pb.HeartbeatReply(known=known))


def _tensor_metas(infos) -> list:
    return [step_pb.TensorMeta(name=t.name, dtype=t.dtype, shape=list(t.shape), frame=max(t.frame, 0), request_id=t.request_id,
                               in_buffer=t.buffer_offset >= 0, buffer_offset=max(t.buffer_offset, 0),
                               buffer_end=t.buffer_end)
            for t in infos]


def open_request(epoch: int, session: int, request_id: str, token_ids: list[int], tensors=(),
                 grammar: tuple[str, str] | None = None, prompt_tokens: int = 0):
    """grammar: a constrained request's (kind, text), which the drafter follows; prompt_tokens: how many of the
    sequence's tokens are its prompt."""
    kind, text = grammar or ("", "")
    message = _verifier_message(epoch, session, open=step_pb.OpenRequest(
        request_id=request_id, token_ids=token_ids, grammar_kind=kind, grammar=text, prompt_tokens=prompt_tokens))
    message.tensors.extend(_tensor_metas(tensors))
    return message


def draft_request(epoch: int, session: int, step_id: int, asks, tensors=()):
    """asks: (DraftAsk, bet taken (index + 1, or 0), bets wanted)."""
    message = _verifier_message(epoch, session, draft=step_pb.DraftRequest(step_id=step_id, asks=[
        step_pb.DraftAsk(request_id=a.request_id, new_token_ids=a.new_tokens, max_nodes=a.max_nodes, bet_taken=taken,
                         num_bets=bets) for a, taken, bets in asks]))
    message.tensors.extend(_tensor_metas(tensors))
    return message


def release(epoch: int, session: int, request_ids: list[str]):
    return _verifier_message(epoch, session, release=step_pb.ReleaseRequest(request_ids=request_ids))
