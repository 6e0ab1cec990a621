"""The only verifier module that touches generated protobuf classes: wire <-> internal types."""

from __future__ import annotations

from splitspec.protos import verifier_pb2 as pb
from splitspec.runtime.sampling_params import SamplingParams
from splitspec.verifier_svc.engine import Request, SpecStats

FINISH_REASONS = {None: pb.FINISH_REASON_UNSPECIFIED, "stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
                  "abort": pb.FINISH_REASON_ABORT, "error": pb.FINISH_REASON_ERROR}


def sampling_params(wire: pb.SamplingParams) -> SamplingParams:
    """Raises ValueError naming the bad value."""
    return SamplingParams(
        temperature=wire.temperature, top_p=wire.top_p if wire.top_p else 1.0, top_k=wire.top_k if wire.top_k else -1,
        seed=wire.seed if wire.HasField("seed") else None, max_new_tokens=wire.max_new_tokens,
        ignore_eos=wire.ignore_eos, stop_token_ids=tuple(wire.stop_token_ids),
    )


def speculation(stats: SpecStats) -> pb.SpeculationCounts:
    return pb.SpeculationCounts(verify_steps=stats.verify_steps, draft_tokens=stats.draft_tokens,
                                accepted_tokens=stats.accepted_tokens,
                                accepted_per_position=stats.accepted_per_position, fallbacks=stats.fallbacks)


def status_code(message: str) -> int:
    """The gRPC status code number an error message names ("INVALID_ARGUMENT: ..." -> 3); INTERNAL otherwise."""
    import grpc

    name = message.split(":", 1)[0].strip()
    code = grpc.StatusCode.__members__.get(name, grpc.StatusCode.INTERNAL)
    return code.value[0]


def delta(client_id: str, request: Request | None, token_ids: list[int], finish_reason: str | None,
          first: bool, error: str = "") -> pb.TokenDelta:
    message = pb.TokenDelta(request_id=client_id, token_ids=token_ids, finish_reason=FINISH_REASONS[finish_reason],
                            error=error, error_code=status_code(error) if error else 0)
    if request is not None:
        message.speculation.CopyFrom(speculation(request.stats))
        message.num_preemptions = request.num_preemptions
        if first or finish_reason is not None:
            message.prompt_tokens = len(request.prompt_ids)
            message.cached_prompt_tokens = request.cached_tokens
        if first:
            message.seed = request.params.seed or 0
    return message


def error(client_id: str, message: str) -> pb.TokenDelta:
    return pb.TokenDelta(request_id=client_id, finish_reason=pb.FINISH_REASON_ERROR, error=message,
                         error_code=status_code(message))
