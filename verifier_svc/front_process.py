"""The verifier's front process: the splitspec.v1.Verifier gRPC server, fed by the engine process.

The engine process (`splitspec verifier`) starts it with the two local ZeroMQ endpoints it bound and the
gRPC address; it dies with the engine (splitspec.lifeline), and the engine stops when it exits. Over the
engine's endpoint come a hello (the model and the limits), then one message per step with every delta of
that step in columns (step_columns.py), which this process turns into TokenDeltas and files with the streams
they belong to; over its own it sends submissions,
aborts and what the engine counts (refusals, malformed messages). gRPC, the streams' protobuf and their
writes happen here, never on the engine's GIL.

    python -m splitspec.verifier_svc.front_process --engine ipc://... --commands ipc://... --address HOST:PORT
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import signal
import sys
import time

import zmq
import zmq.asyncio

from splitspec import event_loop, heap
from splitspec.log_format import setup_logging
from splitspec.protos import engine_link_pb2 as link
from splitspec.protos.channel import KEEPALIVE_SECONDS, KEEPALIVE_TIMEOUT_SECONDS
from splitspec.protos import verifier_pb2 as pb
from splitspec.verifier_svc import step_columns
from splitspec.verifier_svc.grpc_front import Limits, Stream, VerifierServicer, set_serving, start_server

logger = logging.getLogger("splitspec.verifier.front")
# an engine silent this long (it beats every second) is hung: as long as gRPC's keepalive gave a hung
# single-process verifier before its callers gave up on it
ENGINE_SILENCE_SECONDS = KEEPALIVE_SECONDS + KEEPALIVE_TIMEOUT_SECONDS


class LinkBackend:
    """The engine in the other process: commands out on one socket, steps in on the other."""

    def __init__(self, commands: zmq.Socket):
        self.commands = commands
        self.routes: dict[str, Stream] = {}  # live request id -> the stream its deltas go to
        self.columns = step_columns.Reader()  # a step's columns -> its TokenDeltas

    def send(self, command: link.FrontCommand) -> None:
        self.commands.send(command.SerializeToString())  # SNDHWM 0: never blocks, never drops

    def submit(self, submit: pb.SubmitRequest, params, stream: Stream) -> None:
        self.routes[submit.request_id] = stream
        self.send(link.FrontCommand(submit=submit))

    async def abort(self, request_id: str) -> None:
        self.send(link.FrontCommand(abort=pb.AbortRequest(request_id=request_id)))

    def finished(self, request_id: str) -> None:
        self.routes.pop(request_id, None)

    def file(self, step: link.StepColumns) -> None:
        for delta in self.columns.deltas(step):
            if delta.finish_reason == pb.FINISH_REASON_UNSPECIFIED:
                stream = self.routes.get(delta.request_id)
            else:
                stream = self.routes.pop(delta.request_id, None)
            if stream is not None:  # None: its stream closed and aborted it; nobody is listening
                stream.put(delta)

    def refused(self, code: str) -> None:
        self.send(link.FrontCommand(refused=code))

    def malformed(self, method: str) -> None:
        self.send(link.FrontCommand(malformed=method))


async def serve(engine_address: str, commands_address: str, address: str) -> int:
    context = zmq.asyncio.Context()
    inbound = context.socket(zmq.PULL)
    inbound.setsockopt(zmq.LINGER, 0)
    inbound.connect(engine_address)
    commands = context.socket(zmq.PUSH)
    commands.setsockopt(zmq.SNDHWM, 0)
    commands.setsockopt(zmq.LINGER, 2000)
    commands.connect(commands_address)
    backend = LinkBackend(commands)
    event_loop.print_tasks_on_sigusr2(lambda: [f"front: {len(backend.routes)} request(s) routed: "
                                               + " ".join(sorted(backend.routes)[:64])])
    first = link.EngineMessage.FromString(await inbound.recv())
    if first.WhichOneof("kind") != "hello":
        logger.error("the engine's first message was %s, not its hello", first.WhichOneof("kind"))
        return 1
    hello = first.hello
    limits = Limits(hello.info.vocab_size, hello.info.max_context_tokens, hello.kv_pages, hello.page_size,
                    hello.tree_tokens)
    servicer = VerifierServicer(backend, limits, hello.info, backend)
    try:
        server, health = await start_server(servicer, address)
    except (OSError, RuntimeError) as exc:  # grpc raises RuntimeError when it cannot bind
        backend.send(link.FrontCommand(started=link.FrontStarted(error=f"gRPC on {address}: {exc}")))
        await asyncio.sleep(0.5)  # LINGER delivers it
        return 2
    backend.send(link.FrontCommand(started=link.FrontStarted()))
    heap.freeze("verifier front")
    heard, serving = time.monotonic(), False
    while True:
        if not await inbound.poll(1000):
            silent = time.monotonic() - heard
            if silent > ENGINE_SILENCE_SECONDS and servicer.unavailable is None:
                logger.error("the engine has sent nothing for %.0f s (stopped or wedged): its streams end with "
                             "UNAVAILABLE and new ones are refused until it answers", silent)
                servicer.set_unavailable("UNAVAILABLE: the verifier's engine stopped answering")
                await set_serving(health, False)
            continue
        message = link.EngineMessage.FromString(await inbound.recv())
        heard = time.monotonic()
        if servicer.unavailable is not None:
            logger.warning("the engine answers again; serving")
            servicer.set_unavailable(None)
            await set_serving(health, serving)
        kind = message.WhichOneof("kind")
        if kind == "step":
            backend.file(message.step)
        elif kind == "serving" and message.serving:
            serving = True
            await set_serving(health)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m splitspec.verifier_svc.front_process", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", required=True, help="The engine's step endpoint (ZeroMQ PUSH there, PULL here).")
    parser.add_argument("--commands", required=True, help="The engine's command endpoint (PUSH here, PULL there).")
    parser.add_argument("--address", required=True, help="Where the gRPC server listens (HOST:PORT).")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # as every service: `kill -USR1` prints the stacks
    return event_loop.run(serve(args.engine, args.commands, args.address))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
