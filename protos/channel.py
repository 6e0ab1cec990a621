"""How the gateway and the verifier keep their gRPC connection honest: both ends send HTTP/2 keepalive pings
and close a connection whose pings go unanswered, so that a verifier that hangs (SIGSTOP, a wedged host) or
a network path cut without a reset ends the gateway's requests with an error in about
KEEPALIVE_SECONDS + KEEPALIVE_TIMEOUT_SECONDS instead of never, and a gateway that vanishes the same way has
its requests aborted on the verifier (their KV pages freed) just as fast. The server accepts pings that often
(gRPC's default would answer them with GOAWAY "too_many_pings")."""

from __future__ import annotations

KEEPALIVE_SECONDS = 10
KEEPALIVE_TIMEOUT_SECONDS = 5
MAX_MESSAGE_BYTES = 64 << 20  # a long prompt's token ids in one SubmitRequest; a step's deltas for a full batch

_KEEPALIVE = [
    ("grpc.keepalive_time_ms", KEEPALIVE_SECONDS * 1000),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_SECONDS * 1000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_SECONDS * 1000),  # else gRPC waits 60 s for any ping's answer
]


def client_options() -> list[tuple[str, int]]:
    # reconnect backoff capped at 1 s (gRPC's default grows to 120 s): a gateway started before a verifier that
    # spends minutes loading and capturing CUDA graphs connects within 1 s of its serving, not up to 2 min later
    return [*_KEEPALIVE, ("grpc.http2.max_pings_without_data", 0), ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES), ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000)]


def server_options() -> list[tuple[str, int]]:
    return [*_KEEPALIVE, ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_SECONDS * 1000 // 2),
            ("grpc.http2.max_ping_strikes", 0), ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
