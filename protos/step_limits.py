"""The largest frame each end of the step channel takes (ZeroMQ's MAXMSGSIZE, which libzmq checks against
every frame's announced length before it allocates the frame; a peer that announces more is disconnected).

Each bound is the largest frame a legal peer sends, from what the receiving end knows of itself, with room
to spare; so a hostile or broken peer cannot make either end allocate without bound.

- The verifier receives trees (DraftReply) and bets (DraftBets): per request a tree of at most
  `max_nodes` nodes and `num_bets` bets of as many, for at most `max_requests` requests in one message.
- A drafter receives one header (a VerifierMessage) and tensor frames. The largest header is a re-pinned
  request's OpenRequest (every token id of its sequence) or a step's DraftRequest (every request's new
  tokens: at most one step's tokens); both are bounded as the gateway's gRPC messages are
  (`channel.MAX_MESSAGE_BYTES`, which holds over ten million token ids). The largest tensor frame is one
  request's hidden states over its whole context (a re-pin's history).
"""

from __future__ import annotations

from splitspec.protos.channel import MAX_MESSAGE_BYTES

FLOOR_BYTES = 1 << 20  # registration, heartbeats and small trees, whatever the counts below
REQUEST_BYTES = 512  # one request's fixed part of a message: its id (a 32-character hex), counts, metadata
NODE_BYTES = 32  # one tree node on the wire: a token and a parent (varints of at most 10 bytes each), slack


def verifier_receive_limit(max_requests: int, max_nodes: int, num_bets: int = 0) -> int:
    """MAXMSGSIZE of the verifier's ROUTER: one message of trees (and bets) for every running request."""
    per_request = (1 + max(num_bets, 0)) * (REQUEST_BYTES + max(max_nodes, 1) * NODE_BYTES)
    return FLOOR_BYTES + max(max_requests, 1) * per_request


def drafter_receive_limit(context_tokens: int, feature_bytes_per_token: int) -> int:
    """MAXMSGSIZE of a drafter's DEALER: a header, or one request's features over `context_tokens` tokens
    (`feature_bytes_per_token` 0: a drafter that takes no hidden states)."""
    return max(MAX_MESSAGE_BYTES, FLOOR_BYTES + max(context_tokens, 0) * max(feature_bytes_per_token, 0))
