"""The gateway's side of the verifier's gRPC API: one long-lived Generate stream carries every request's
submission and abort one way and the per-step token deltas the other (grpc.aio).

Submissions queued while the stream was writing, or while the handlers the event loop had ready ran (up to
GATHER_YIELDS passes of the loop, no new pass after GATHER_SECONDS; a handler that begins once a submission has
waited TURN_SECONDS first lets the writer send it: VerifierClient.turn), go out together as one SubmitBatch
message, so the verifier sees requests that arrived together as one batch (gRPC writes a stream's messages one at a
time, each costing the gateway's CPU: a message per request would spread a burst over its own writes). Deltas are
routed to each request's queue by id. When the stream breaks (the verifier died or restarted), every request on it
ends with an error event (the HTTP side turns it into a 503) and the next submission opens a new stream.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitspec.protos import channel
from splitspec.protos import verifier_pb2 as pb
from splitspec.protos import verifier_pb2_grpc as pb_grpc
from splitspec.protos.deltas import merge_delta, mergeable

logger = logging.getLogger("splitspec.gateway")
SERVICE = "splitspec.v1.Verifier"
BATCH_BYTES = channel.MAX_MESSAGE_BYTES // 4  # submissions sent as one SubmitBatch hold at most this many bytes
# a submission waits up to this many passes of the event loop, and this long, for the submissions of handlers already
# under way to join its write: a burst of arrivals goes as a few SubmitBatch writes, not one write each (on a 2-core
# CPU, 20 bursts of 32: 596 writes -> 141-154, the burst reaching the engine 1.0-1.3 -> 0.8-0.9 ms a request); an idle
# gateway's passes are empty (~10 us each)
GATHER_YIELDS, GATHER_SECONDS = 8, 0.002
# a handler that begins once a submission has waited this long lets the writer send it first (VerifierClient.turn): a
# burst the gateway takes within it goes as one batch (splitting it would cost the engine a step of its own), a longer
# one reaches the engine while the gateway still takes the rest (a 64-request wave took ~25-45 ms on the H200's host).
# SPLITSPEC_GATEWAY_TURN_MS sets it (0: no turn, a burst goes once the gateway has taken it all), for measuring how a
# deployment's bursts are best split (docs/performance.md)
TURN_SECONDS = float(os.environ.get("SPLITSPEC_GATEWAY_TURN_MS", "8")) / 1000
# a step's deltas are handed to their streams this many at a time, the event loop taking its sockets in between: a
# wave's last step ends 64 streams at once, and their clients' next requests were taken only once every one of the 64
# answers had been written. SPLITSPEC_GATEWAY_FANOUT (0: the whole step at once) for measuring it
FANOUT = int(os.environ.get("SPLITSPEC_GATEWAY_FANOUT", "2"))


class VerifierUnavailable(Exception):
    """The verifier cannot be reached or is not serving."""


class StreamBroken:
    """Put on a request's queue when its stream failed: code is the gRPC status name."""

    def __init__(self, code: str, details: str):
        self.code, self.details = code, details


class DeltaQueue(asyncio.Queue):
    """A request's deltas as they wait for its handler: a delta that arrives while an unfinished one still waits is
    merged into it (tokens and logprobs appended in order, the latest counts and finish: protos/deltas.py), as the
    verifier's front merges what waits for the gateway. A handler that falls behind (its client reads slowly, the
    event loop is busy) catches up in one event of many tokens instead of one event per step (vLLM's API server
    merges outputs the same way)."""

    def _put(self, item) -> None:
        if self._queue and isinstance(item, pb.TokenDelta) and mergeable(self._queue[-1]):
            merge_delta(self._queue[-1], item)
            return
        self._queue.append(item)


class VerifierClient:
    def __init__(self, address: str, on_grpc_error=None, step_log=None):
        self.address = address
        self.channel = grpc.aio.insecure_channel(address, options=channel.client_options())  # keepalive: a hung
        # verifier or a silently cut path ends the stream (and its requests, with an error) within ~15 s
        self.stub = pb_grpc.VerifierStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.info: pb.ModelInfo | None = None
        self._outbox: asyncio.Queue | None = None
        self._reader: asyncio.Task | None = None
        self._queues: dict[str, DeltaQueue] = {}
        self._ids = itertools.count()
        self._on_grpc_error = on_grpc_error or (lambda code: None)
        self._step_log = step_log  # splitspec.step_log: when each submission goes to the stream
        self._unwritten_since: float | None = None  # loop time of the oldest submission the writer has not taken
        self._taken: asyncio.Event | None = None  # set (and replaced) each time the writer takes what is queued

    async def model_info(self, timeout: float = 5.0, wait_for_ready: bool = False) -> pb.ModelInfo:
        """The verifier's model info. wait_for_ready: the call waits (up to timeout) for the channel to connect
        rather than failing at once while it is between reconnect attempts."""
        self.info = await self.stub.GetModelInfo(pb.ModelInfoRequest(), timeout=timeout, wait_for_ready=wait_for_ready)
        return self.info

    async def serving(self, timeout: float = 2.0) -> bool:
        try:
            reply = await self.health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=timeout)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def new_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    async def turn(self) -> None:
        """Wait, before a new request's work, while a submission has waited more than TURN_SECONDS for the writer.

        asyncio runs every ready handler of a burst before the writer's next turn (its wake-up joins the back of the
        loop's queue), so without this the first request of a 64-request wave reached the verifier only once the
        gateway had taken all 64 (~45 ms on the H200's host; docs/performance.md, 2026-12-02), and the engine waited
        for a prefill it could have begun. Handlers beginning later than TURN_SECONDS after a queued submission
        park here: the writer sends what is queued, and they go on (re-checking) in the next pass. A long burst then
        reaches the verifier as a SubmitBatch every ~TURN_SECONDS of the gateway's work while the rest is taken."""
        if TURN_SECONDS <= 0:
            return
        loop = asyncio.get_running_loop()
        while self._unwritten_since is not None and loop.time() - self._unwritten_since > TURN_SECONDS:
            if self._taken is None:
                self._taken = asyncio.Event()
            await self._taken.wait()

    def _writer_took(self) -> None:
        """What was queued is the writer's (or the stream is gone): parked handlers go on."""
        self._unwritten_since = None
        if self._taken is not None:
            self._taken.set()
            self._taken = None

    def submit(self, request_id: str, prompt_ids: list[int], sampling: pb.SamplingParams, speculate: bool,
               stream_interval: int = 0) -> DeltaQueue:
        """Queue a submission; returns the queue its deltas (and a StreamBroken on failure) arrive on. stream_interval:
        tokens per delta (0: the verifier's --stream-interval)."""
        self._ensure_stream()
        if self._unwritten_since is None:
            self._unwritten_since = asyncio.get_running_loop().time()
        queue = DeltaQueue()
        self._queues[request_id] = queue
        self._outbox.put_nowait(pb.GenerateClientMessage(submit=pb.SubmitRequest(
            request_id=request_id, prompt_ids=prompt_ids, sampling=sampling, speculate=speculate,
            stream_interval=stream_interval)))
        return queue

    def _submissions(self, submits: list) -> pb.GenerateClientMessage:
        if self._step_log is not None:
            for _ in submits:
                self._step_log.hop("gateway_submitted")
        if len(submits) == 1:
            return pb.GenerateClientMessage(submit=submits[0])
        return pb.GenerateClientMessage(submits=pb.SubmitBatch(requests=submits))

    def abort(self, request_id: str) -> None:
        """Stop a request (client gone, stop string hit); its final ABORT delta is dropped."""
        if self._queues.pop(request_id, None) is not None and self._outbox is not None:
            self._outbox.put_nowait(pb.GenerateClientMessage(abort=pb.AbortRequest(request_id=request_id)))

    def done(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def open_requests(self) -> dict[str, int]:
        """Each request open on the stream, with how many deltas wait in its queue unread."""
        return {request_id: queue.qsize() for request_id, queue in self._queues.items()}

    def _ensure_stream(self) -> None:
        if self._reader is not None and not self._reader.done():
            return
        self._outbox = asyncio.Queue()
        self._reader = asyncio.get_running_loop().create_task(self._run(self._outbox))

    async def _run(self, outbox: asyncio.Queue) -> None:
        loop = asyncio.get_running_loop()

        async def messages():
            """What is queued when the stream can write: consecutive submissions go as one SubmitBatch (a burst of
            arrivals costs one write, not one each; gRPC writes one message at a time), aborts in their place."""
            while True:
                queued = [await outbox.get()]
                began = loop.time()
                for _ in range(GATHER_YIELDS):  # handlers the loop has ready queue theirs first: a burst, one write
                    if loop.time() - began > GATHER_SECONDS:
                        break
                    await asyncio.sleep(0)
                while not outbox.empty():
                    queued.append(outbox.get_nowait())
                self._writer_took()
                submits, size = [], 0
                for message in queued:
                    if message.WhichOneof("kind") == "submit":
                        bytes_ = message.submit.ByteSize()
                        if submits and size + bytes_ > BATCH_BYTES:  # a batch stays well inside the message limit
                            yield self._submissions(submits)
                            submits, size = [], 0
                        submits.append(message.submit)
                        size += bytes_
                        continue
                    if submits:
                        yield self._submissions(submits)
                        submits, size = [], 0
                    yield message
                if submits:
                    yield self._submissions(submits)

        call = self.stub.Generate(messages())
        code, details = "UNAVAILABLE", "the Generate stream ended"
        try:
            async for response in call:
                for i, delta in enumerate(response.deltas):
                    queue = self._queues.get(delta.request_id)
                    if queue is not None:
                        queue.put_nowait(delta)
                    if FANOUT and i % FANOUT == FANOUT - 1 and i + 1 < len(response.deltas):
                        await asyncio.sleep(0)  # these streams write, the loop polls its sockets, then the next
        except grpc.aio.AioRpcError as exc:
            code, details = exc.code().name, exc.details() or str(exc)
            logger.warning("verifier stream failed (%s: %s); %d request(s) end with an error", code, details,
                           len(self._queues))
            self._on_grpc_error(code)
        except asyncio.CancelledError:
            call.cancel()
            raise
        finally:
            if self._outbox is outbox:
                self._outbox = None
                self._writer_took()  # nothing parked waits on a stream that is gone
        broken = StreamBroken(code, details)
        for queue in self._queues.values():
            queue.put_nowait(broken)
        self._queues.clear()

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        await self.channel.close()
