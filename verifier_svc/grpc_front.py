"""The splitspec.v1.Verifier gRPC service: Generate streams, Abort, GetModelInfo.

Each Generate stream is an asyncio task that validates submissions, hands them to a backend and yields
the deltas the backend files with it, everything waiting written as one message. A bad request gets an
error delta naming the problem (INVALID_ARGUMENT: ...) and its stream keeps serving the others; a stream
that closes aborts its unfinished requests.

The backend is the engine: in another process (front_process.LinkBackend, the default: this module then
runs in the verifier's front process, and the engine's step loop never shares a GIL with it) or on a
thread of this one (server.LocalBackend, --disable-frontend-multiprocessing).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Protocol

import grpc

from splitspec.step_log import StepLog
from splitspec.protos import verifier_pb2 as pb
from splitspec.protos.deltas import merge_delta, mergeable
from splitspec.verifier_svc import convert

logger = logging.getLogger("splitspec.verifier")
SERVICE_NAME = "splitspec.v1.Verifier"


@dataclass(frozen=True)
class Limits:
    """What a submission is checked against: the model's vocabulary and context, and the KV cache."""

    vocab_size: int
    max_context: int
    kv_pages: int
    page_size: int
    tree_tokens: int  # a request's tree beyond its output (root included)

    def pages_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        """KV pages a request needs at its longest (prompt + output + one tree): it must fit alone."""
        return -(-(prompt_len + max_new_tokens + self.tree_tokens) // self.page_size)

    def check(self, submit: pb.SubmitRequest):
        """(SamplingParams, None), or (None, 'CODE: what is wrong')."""
        if not submit.request_id:
            return None, "INVALID_ARGUMENT: request_id is empty"
        if not submit.prompt_ids:
            return None, "INVALID_ARGUMENT: the prompt is empty"
        bad = [t for t in submit.prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            return None, f"INVALID_ARGUMENT: token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
        try:
            params = convert.sampling_params(submit.sampling)
        except ValueError as exc:
            return None, f"INVALID_ARGUMENT: {exc}"
        bad = [t for t, _ in params.logit_bias if t >= self.vocab_size]
        if bad:
            return None, f"INVALID_ARGUMENT: logit_bias token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
        if params.max_new_tokens < 1 and params.prompt_logprobs is None:
            return None, "INVALID_ARGUMENT: max_new_tokens must be at least 1 (0 only with prompt_logprobs)"
        total = len(submit.prompt_ids) + params.max_new_tokens
        if total > self.max_context:
            return None, (f"INVALID_ARGUMENT: prompt ({len(submit.prompt_ids)} tokens) + max_new_tokens "
                          f"({params.max_new_tokens}) = {total} exceeds the context of {self.max_context} tokens")
        if self.pages_needed(len(submit.prompt_ids), params.max_new_tokens) > self.kv_pages:
            return None, "RESOURCE_EXHAUSTED: the request alone needs more KV cache than the server has (--max-total-tokens)"
        return params, None


class Stream:
    """One Generate call's deltas waiting to be written: the backend files each step's, the call writes everything
    waiting as one GenerateServerMessage. A request's deltas that wait together are merged into one (its tokens and
    logprobs in order, its latest counts and finish): a writer that fell behind, when the gateway reads slower than
    the engine decodes, catches up in fewer and larger deltas instead of one per step per request (vLLM's API server
    merges its outputs the same way). (--stream-interval holds tokens before they get here: worker.Submission.due.)"""

    def __init__(self):
        # what waits to be written, in order: a TokenDelta under its request id (merged into while it waits), any
        # other item (a Malformed / None from the reader, or Unavailable) under a key of its own
        self.pending: dict = {}
        self.wake = asyncio.Event()

    def put(self, item) -> None:
        key = item.request_id if isinstance(item, pb.TokenDelta) else object()
        waiting = self.pending.get(key)
        if waiting is not None:
            if mergeable(waiting):
                merge_delta(waiting, item)  # tokens and logprobs appended, the latest counts and finish
                return
            key = object()  # a finished request's last delta waits and its id came back: not merged
        self.pending[key] = item
        self.wake.set()

    async def take(self) -> list:
        await self.wake.wait()
        self.wake.clear()
        items, self.pending = list(self.pending.values()), {}
        return items


class Backend(Protocol):
    """The engine as the service sees it."""

    def submit(self, submit: pb.SubmitRequest, params, stream: Stream) -> None:
        """Start a validated request; its deltas go to stream.put (on the event loop)."""

    async def abort(self, request_id: str) -> None:
        """Stop a live request (its last delta, finish reason ABORT, still goes to its stream)."""

    def finished(self, request_id: str) -> None:
        """The request's last delta reached its stream."""


class Counts(Protocol):
    """Where refusals and malformed messages are counted: the engine's metrics (EngineMetrics), directly or
    across the link (LinkBackend)."""

    def refused(self, code: str) -> None: ...

    def malformed(self, method: str) -> None: ...


class NoCounts:
    def refused(self, code: str) -> None:
        pass

    def malformed(self, method: str) -> None:
        pass


class VerifierServicer:
    def __init__(self, backend: Backend, limits: Limits, info: pb.ModelInfo, counts: Counts):
        self.backend, self.limits, self.info, self.counts = backend, limits, info, counts
        self.step_log = StepLog.from_env("front")  # SPLITSPEC_STEP_LOG: when each submission reached this front
        self.live_ids: set[str] = set()  # every stream's unfinished requests (ids must be unique among them)
        self.streams: set[Stream] = set()
        self.unavailable: str | None = None  # why the engine cannot serve now ("UNAVAILABLE: ..."), else None

    def set_unavailable(self, reason: str | None) -> None:
        """The engine stopped answering (reason): every open stream ends with UNAVAILABLE (the gateway's
        requests fail fast, as with a hung server) and new ones are refused; None: it answers again."""
        self.unavailable = reason
        if reason is not None:
            for stream in self.streams:
                stream.put(Unavailable(reason))

    async def Generate(self, request_iterator, context):
        if self.unavailable is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.unavailable)
        stream = Stream()
        self.streams.add(stream)
        live: set[str] = set()
        reading = True

        async def read():
            nonlocal reading
            try:
                async for message in request_iterator:
                    if isinstance(message, Malformed):  # this stream ends with the status; nobody else's
                        stream.put(message)
                        break
                    kind = message.WhichOneof("kind")
                    if kind in ("submit", "submits"):
                        for submit in [message.submit] if kind == "submit" else message.submits.requests:
                            if self.step_log is not None:
                                self.step_log.hop("front_received")
                            self._submit(submit, live, stream)
                    elif kind == "abort" and message.abort.request_id in live:
                        await self.backend.abort(message.abort.request_id)
            finally:
                reading = False
                stream.put(None)

        reader = asyncio.create_task(read())
        try:
            while reading or live:
                deltas = []
                for item in await stream.take():
                    if item is None:
                        continue
                    if isinstance(item, Malformed):
                        await refuse_malformed(item, context)
                    if isinstance(item, Unavailable):
                        await context.abort(grpc.StatusCode.UNAVAILABLE, item.reason)
                    if item.finish_reason != pb.FINISH_REASON_UNSPECIFIED and item.request_id in live:
                        live.discard(item.request_id)
                        self.live_ids.discard(item.request_id)
                        self.backend.finished(item.request_id)
                    deltas.append(item)
                if deltas:  # every delta that waited, in one message (one write)
                    yield pb.GenerateServerMessage(deltas=deltas)
        finally:
            reader.cancel()
            self.streams.discard(stream)
            for request_id in list(live):  # the stream went away: abort what it left running
                await self.backend.abort(request_id)
                self.live_ids.discard(request_id)

    def _submit(self, submit: pb.SubmitRequest, live: set[str], stream: Stream) -> None:
        params, problem = self.limits.check(submit)
        if problem is None and self.unavailable is not None:
            problem = self.unavailable
        if problem is None and submit.request_id in self.live_ids:
            problem = f"INVALID_ARGUMENT: request_id {submit.request_id!r} is already running"
        if problem is not None:
            logger.info("refused request %r: %s", submit.request_id, problem)
            self.counts.refused(problem.split(":", 1)[0])
            stream.put(convert.error(submit.request_id, problem))
            return
        live.add(submit.request_id)
        self.live_ids.add(submit.request_id)
        self.backend.submit(submit, params, stream)

    async def Abort(self, request, context):
        await refuse_malformed(request, context)
        if request.request_id not in self.live_ids:
            return pb.AbortResponse(found=False)
        await self.backend.abort(request.request_id)
        return pb.AbortResponse(found=True)

    async def GetModelInfo(self, request, context):
        await refuse_malformed(request, context)
        return self.info


@dataclass
class Unavailable:
    """In a stream's queue: the engine stopped answering; the call ends with UNAVAILABLE."""

    reason: str


@dataclass
class Malformed:
    """A request message that did not decode, in place of the message (so the call can end with
    INVALID_ARGUMENT naming it; a parser that raises gets a bare UNKNOWN, or a stream that just ends)."""

    message_type: str
    error: str


async def refuse_malformed(request, context) -> None:
    if isinstance(request, Malformed):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"a malformed {request.message_type}: {request.error}")


def add_servicer(servicer: VerifierServicer, server) -> None:
    """protos' generated registration, with request parsers that log and count a message that does not
    decode (gRPC then ends that one call with a status)."""
    counts = servicer.counts

    def parser(message_type, method: str):
        def parse(data: bytes):
            try:
                return message_type.FromString(data)
            except Exception as exc:  # noqa: BLE001 (protobuf's DecodeError and others)
                logger.warning("a malformed %s on %s (%d bytes) ends its call: %s", message_type.DESCRIPTOR.name,
                               method, len(data), exc)
                counts.malformed(method)
                return Malformed(message_type.DESCRIPTOR.name, str(exc) or type(exc).__name__)
        return parse

    handlers = {
        "Generate": grpc.stream_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=parser(pb.GenerateClientMessage, "Generate"),
            response_serializer=pb.GenerateServerMessage.SerializeToString),
        "Abort": grpc.unary_unary_rpc_method_handler(
            servicer.Abort, request_deserializer=parser(pb.AbortRequest, "Abort"),
            response_serializer=pb.AbortResponse.SerializeToString),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetModelInfo, request_deserializer=parser(pb.ModelInfoRequest, "GetModelInfo"),
            response_serializer=pb.ModelInfo.SerializeToString),
    }
    assert set(handlers) == set(pb.DESCRIPTOR.services_by_name["Verifier"].methods_by_name), "protos changed"
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


async def start_server(servicer: VerifierServicer, address: str):
    """A grpc.aio server with the service and grpc.health.v1 (NOT_SERVING until set), started on address."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from splitspec.protos import channel

    server = grpc.aio.server(options=channel.server_options())  # keepalive both ways (protos/channel.py)
    add_servicer(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if server.add_insecure_port(address) == 0:
        raise OSError(f"cannot listen on {address} (is the port taken?)")
    await server.start()
    await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
    return server, health_servicer


async def set_serving(health_servicer, serving: bool = True) -> None:
    from grpc_health.v1 import health_pb2

    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    await health_servicer.set(SERVICE_NAME, status)
    await health_servicer.set("", status)
