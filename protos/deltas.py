"""Merging a request's token deltas that wait together (the verifier's front for a slow gateway, the gateway for a
slow handler): one delta with every token and logprob in order, and the latest of what a delta reports."""

from __future__ import annotations

from splitspec.protos import verifier_pb2 as pb


def mergeable(waiting) -> bool:
    """Whether later deltas may be merged into this waiting item: a request's delta that has not finished."""
    return isinstance(waiting, pb.TokenDelta) and waiting.finish_reason == pb.FINISH_REASON_UNSPECIFIED


def merge_delta(waiting: pb.TokenDelta, later: pb.TokenDelta) -> None:
    """later into waiting, as if waiting had been sent after it: token ids, logprobs (and prompt logprobs) appended
    in order; later's finish, error and counts replace waiting's (protobuf's MergeFrom alone would append the
    speculation counts' per-position list to the older one's; fields later leaves unset keep waiting's)."""
    waiting.MergeFrom(later)
    if later.HasField("speculation"):
        waiting.speculation.CopyFrom(later.speculation)
