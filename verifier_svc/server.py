"""`splitspec verifier`: the target model and the step loop behind the splitspec.v1.Verifier gRPC API.

The engine runs on its own thread (worker.EngineWorker); each Generate stream is an asyncio task that
validates submissions, hands them to the worker and yields the deltas the worker delivers: a step's
deltas cross from the engine thread in one hand-off (StreamRouter), and each stream writes everything
waiting for it as one message. A bad
request gets an error delta naming the problem (INVALID_ARGUMENT: ...) and its stream keeps serving
the others; a stream that closes aborts its unfinished requests.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from splitspec import engine_args
from splitspec.protos import channel
from splitspec.protos import verifier_pb2 as pb
from splitspec.protos import verifier_pb2_grpc as pb_grpc
from splitspec.runtime import args as runtime_args
from splitspec.runtime.curve import CurveError, ServerKeys, server_keys
from splitspec.verifier_svc import convert
from splitspec.verifier_svc.engine import Engine, verify_tree_sizes
from splitspec.verifier_svc.worker import EngineWorker, Submission

logger = logging.getLogger("splitspec.verifier")
SERVICE_NAME = "splitspec.v1.Verifier"


class Validator:
    """Checks a submission against the model's limits; returns an error message or None."""

    def __init__(self, vocab_size: int, max_context: int, worker: EngineWorker):
        self.vocab_size, self.max_context, self.worker = vocab_size, max_context, worker

    def check(self, submit: pb.SubmitRequest):
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
        if params.max_new_tokens < 1:
            return None, "INVALID_ARGUMENT: max_new_tokens must be at least 1"
        total = len(submit.prompt_ids) + params.max_new_tokens
        if total > self.max_context:
            return None, (f"INVALID_ARGUMENT: prompt ({len(submit.prompt_ids)} tokens) + max_new_tokens "
                          f"({params.max_new_tokens}) = {total} exceeds the context of {self.max_context} tokens")
        if self.worker.pages_needed(len(submit.prompt_ids), params.max_new_tokens) > self.worker.engine.runner.kv_cache.num_pages:
            return None, "RESOURCE_EXHAUSTED: the request alone needs more KV cache than the server has (--max-total-tokens)"
        return params, None


class Stream:
    """One Generate call's deltas waiting to be written: the router appends whole steps, the call writes
    everything waiting as one GenerateServerMessage."""

    def __init__(self):
        self.pending: list = []  # TokenDelta, or a Malformed / None from the reader
        self.wake = asyncio.Event()

    def put(self, item) -> None:
        self.pending.append(item)
        self.wake.set()

    async def take(self) -> list:
        await self.wake.wait()
        self.wake.clear()
        items, self.pending = self.pending, []
        return items


class StreamRouter:
    """The worker's publish: on the engine thread, each delivery becomes its TokenDelta (a snapshot of the
    request's counts as of this step) and the whole step crosses to the event loop in one call, which files
    each delta with its stream."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop

    def publish(self, deliveries) -> None:
        batch = []
        for submission, event in deliveries:
            batch.append((submission.stream, convert.delta(submission.client_id, submission.request, event.new_token_ids,
                                                           event.finish_reason, submission.first, event.error,
                                                           event.logprobs)))
            submission.first = False
        self.loop.call_soon_threadsafe(self._file, batch)

    @staticmethod
    def _file(batch) -> None:
        for stream, message in batch:
            stream.put(message)


class VerifierServicer(pb_grpc.VerifierServicer):
    def __init__(self, worker: EngineWorker, validator: Validator, info: pb.ModelInfo, metrics=None):
        self.worker, self.validator, self.info, self.metrics = worker, validator, info, metrics
        self.by_client_id: dict[str, Submission] = {}

    async def Generate(self, request_iterator, context):
        loop = asyncio.get_running_loop()
        stream = Stream()
        live: dict[str, Submission] = {}
        reading = True

        async def read():
            nonlocal reading
            try:
                async for message in request_iterator:
                    if isinstance(message, Malformed):  # this stream ends with the status; nobody else's
                        stream.put(message)
                        break
                    if message.WhichOneof("kind") == "submit":
                        self._submit(message.submit, live, stream)
                    elif message.WhichOneof("kind") == "abort" and message.abort.request_id in live:
                        await loop.run_in_executor(None, self.worker.abort, live[message.abort.request_id])
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
                    if item.finish_reason != pb.FINISH_REASON_UNSPECIFIED and live.pop(item.request_id, None) is not None:
                        self.by_client_id.pop(item.request_id, None)
                    deltas.append(item)
                if deltas:  # every delta that waited, in one message (one write)
                    yield pb.GenerateServerMessage(deltas=deltas)
        finally:
            reader.cancel()
            for submission in list(live.values()):  # the stream went away: abort what it left running
                await loop.run_in_executor(None, self.worker.abort, submission)
                self.by_client_id.pop(submission.client_id, None)

    def _submit(self, submit, live, stream: Stream) -> None:
        params, problem = self.validator.check(submit)
        if problem is None and (submit.request_id in live or submit.request_id in self.by_client_id):
            problem = f"INVALID_ARGUMENT: request_id {submit.request_id!r} is already running"
        if problem is not None:
            logger.info("refused request %r: %s", submit.request_id, problem)
            if self.metrics is not None:
                self.metrics.grpc_refused.labels(**self.metrics.labels, code=problem.split(":", 1)[0]).inc()
            stream.put(convert.error(submit.request_id, problem))
            return
        submission = Submission(submit.request_id, list(submit.prompt_ids), params, submit.speculate, stream=stream)
        live[submit.request_id] = submission
        self.by_client_id[submit.request_id] = submission
        self.worker.submit(submission)

    async def Abort(self, request, context):
        await refuse_malformed(request, context)
        submission = self.by_client_id.get(request.request_id)
        if submission is None:
            return pb.AbortResponse(found=False)
        found = await asyncio.get_running_loop().run_in_executor(None, self.worker.abort, submission)
        return pb.AbortResponse(found=found)

    async def GetModelInfo(self, request, context):
        await refuse_malformed(request, context)
        return self.info


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
    metrics = servicer.metrics

    def parser(message_type, method: str):
        def parse(data: bytes):
            try:
                return message_type.FromString(data)
            except Exception as exc:  # noqa: BLE001 (protobuf's DecodeError and others)
                logger.warning("a malformed %s on %s (%d bytes) ends its call: %s", message_type.DESCRIPTOR.name,
                               method, len(data), exc)
                if metrics is not None:
                    metrics.grpc_malformed.labels(**metrics.labels, method=method).inc()
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitspec verifier", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    runtime_args.add_model_args(parser)
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="Address the gRPC server binds.")
    server.add_argument("--port", type=int, default=30001, help="gRPC port.")
    server.add_argument("--served-model-name", default=None, help="Model name reported to clients (default: the model path).")
    server.add_argument("--context-length", type=int, default=None,
                        help="The longest prompt plus completion served, in tokens (default: config.json's "
                        "max_position_embeddings). Longer than the model's is refused unless "
                        "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1, as in SGLang.")
    server.add_argument("--disable-radix-cache", action="store_true",
                        help="Do not keep finished requests' KV pages for reuse by prompts that share a prefix.")
    server.add_argument("--metrics-port", type=int, default=None,
                        help="Serve Prometheus metrics on this port at /metrics (default: no metrics server).")
    server.add_argument("--disable-overlap-schedule", action="store_true",
                        help="Publish each step's tokens and metrics between steps. By default, on a GPU, they are "
                        "published while the next step's forward runs on the device (SGLang's flag name).")
    engine_args.add_scheduler_args(parser)
    engine_args.add_speculative_args(parser)
    pool = parser.add_argument_group("drafter pool (drafters in their own processes)")
    pool.add_argument("--drafter-bind-addr", default=None,
                      help="Bind the drafters' ZeroMQ endpoint here (e.g. tcp://0.0.0.0:30003) and draft with the "
                      "`splitspec drafter` processes that connect to it; without it the drafter runs in this process.")
    pool.add_argument("--drafter-timeout-ms", type=float, default=500.0,
                      help="How long a step waits for a drafter's trees; past it the request decodes a plain token that step.")
    pool.add_argument("--drafter-heartbeat-timeout", type=float, default=2.0,
                      help="Seconds without a heartbeat before a drafter is declared dead and its requests move elsewhere.")
    pool.add_argument("--drafter-ipc-buffer-mb", type=int, default=64,
                      help="A GPU verifier offers each drafter process that sees its GPU (one on the same host) a "
                      "buffer of this many MiB on that GPU, mapped through CUDA IPC, to take the hidden states "
                      "from GPU to GPU instead of in ZeroMQ frames through the host; 0: frames always.")
    pool.add_argument("--zmq-curve-secret-key", default=None, metavar="PATH",
                      help="The verifier's secret CURVE certificate (NAME.key_secret from `splitspec zmq-keys`): the "
                      "drafter endpoint encrypts the step channel and authenticates every drafter with ZeroMQ CURVE, "
                      "for drafters on other hosts. Needs --zmq-curve-authorized-keys; drafters need this "
                      "certificate's public half (NAME.key) as their --zmq-curve-server-key.")
    pool.add_argument("--zmq-curve-authorized-keys", default=None, metavar="DIR",
                      help="Directory of the drafters' public CURVE certificates (*.key): only a drafter holding the "
                      "secret half of one may connect; others are refused in the handshake, logged and counted "
                      "(splitspec:drafter_handshake_failures_total). Read at start. Needs --zmq-curve-secret-key.")
    engine_args.add_overlap_args(pool)
    pool.add_argument("--wait-for-drafters", type=int, default=0,
                      help="Report SERVING on health only once this many drafters have registered (they may join later too).")
    return parser


def context_length(args: argparse.Namespace, model_max: int) -> int:
    """--context-length, checked against the model's own (config.json's max_position_embeddings)."""
    wanted = args.context_length
    if wanted is None:
        return model_max
    if wanted < 2:
        raise SystemExit(f"splitspec verifier: --context-length {wanted}: must be at least 2 tokens")
    if wanted > model_max:
        if os.environ.get("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "").lower() not in ("1", "true"):
            raise SystemExit(f"splitspec verifier: --context-length {wanted} is longer than the model's "
                             f"{model_max} (max_position_embeddings); set SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 "
                             "to serve it anyway (outputs past the trained length may be wrong)")
        logger.warning("serving a context of %d tokens, longer than the model's %d", wanted, model_max)
    return wanted


def curve_keys(args: argparse.Namespace) -> ServerKeys | None:
    """The step channel's CURVE keys from the flags (CurveError names a bad file or a missing flag)."""
    keys = server_keys(args.zmq_curve_secret_key, args.zmq_curve_authorized_keys)
    if keys is not None and not (args.drafter_bind_addr and args.speculative_algorithm):
        raise CurveError("--zmq-curve-secret-key secures the drafter endpoint: it needs --drafter-bind-addr and "
                         "--speculative-algorithm")
    return keys


async def serve(args: argparse.Namespace, curve: ServerKeys | None = None) -> None:
    from splitspec.generate import eos_token_ids
    from splitspec.runtime.runner import ModelRunner

    model_dir = runtime_args.resolve_model(args)
    runner = ModelRunner.load(runtime_args.runtime_config(args, model_dir))
    eos = eos_token_ids(model_dir, runner.config.eos_token_ids, None)
    model_id = args.served_model_name or args.model_path or str(model_dir)
    metrics = registry = None
    if args.metrics_port is not None:
        from prometheus_client import CollectorRegistry, ProcessCollector

        from splitspec.metrics_http import start_metrics_server
        from splitspec.verifier_svc.metrics import EngineMetrics

        registry = CollectorRegistry()
        ProcessCollector(registry=registry)  # process_resident_memory_bytes, process_open_fds, ... (drift)
        metrics = EngineMetrics(registry, model_id)
    if args.drafter_bind_addr and args.speculative_algorithm:
        from splitspec.verifier_svc.drafter_pool import DrafterPool
        from splitspec.verifier_svc.metrics import PoolMetrics

        from splitspec.draft_models import capture_for, hidden_state_layers
        from splitspec.protos.step_limits import verifier_receive_limit
        from splitspec.runtime.tensor_plane import device_identity

        spec = engine_args.spec_config(args)
        layers = hidden_state_layers(args, runner.config)
        capture_for(runner, layers)
        # trees for every request that can run at once (each holds a KV page at least)
        max_requests = args.max_running_requests or runner.kv_cache.num_pages
        max_message = verifier_receive_limit(max_requests, spec.num_draft_tokens, engine_args.num_bets(args))
        drafter = DrafterPool(args.drafter_bind_addr, args.speculative_algorithm, runner.config.vocab_size,
                              draft_model=(args.speculative_draft_model_path or "") if args.speculative_algorithm != "NGRAM" else "",
                              timeout=args.drafter_timeout_ms / 1000, heartbeat_timeout=args.drafter_heartbeat_timeout,
                              hidden_state_layers=layers,
                              metrics=PoolMetrics(registry, model_id) if registry is not None else None,
                              overlap=engine_args.overlap_mode(args), num_bets=engine_args.num_bets(args),
                              device=device_identity(runner.device), overlap_max_bs=args.speculative_overlap_max_bs,
                              tensor_device=runner.device, ipc_buffer_bytes=args.drafter_ipc_buffer_mb << 20,
                              curve=curve, max_message_bytes=max_message)
    else:
        drafter, spec = engine_args.in_process_drafter(args, target=runner)
    if registry is not None:  # Prometheus finds the drafters' own endpoints through GET /sd/drafters
        pool = drafter if args.drafter_bind_addr and args.speculative_algorithm else None
        start_metrics_server(registry, args.host, args.metrics_port,
                             json_routes={"/sd/drafters": pool.scrape_targets if pool is not None else list})
        logger.info("metrics on http://%s:%d/metrics, drafter discovery at /sd/drafters", args.host, args.metrics_port)
    # after the drafter chose the layers to capture; before serving: decode, and the trees it will verify
    runner.capture_cuda_graphs(tree_nodes=verify_tree_sizes(spec if args.speculative_algorithm else None))
    from splitspec.verifier_svc.prefix_cache import PrefixCache

    cache = None if args.disable_radix_cache else PrefixCache(runner.kv_cache.allocator, runner.kv_cache.page_size)
    engine = Engine(runner, drafter, spec, eos, engine_args.scheduler_config(args), prefix_cache=cache)
    overlap = runner.device.type == "cuda" and not args.disable_overlap_schedule
    worker = EngineWorker(engine, metrics, publish=StreamRouter(asyncio.get_running_loop()).publish, overlap=overlap)
    if metrics is not None:
        metrics.observe_state(engine)
    worker.start()
    context = context_length(args, runner.config.max_position_embeddings)
    info = pb.ModelInfo(model_id=model_id, model_path=str(model_dir),
                        vocab_size=runner.config.vocab_size, max_context_tokens=context,
                        eos_token_ids=sorted(eos), speculative_algorithm=args.speculative_algorithm or "",
                        speculative_num_draft_tokens=spec.num_draft_tokens if drafter else 0)
    server = grpc.aio.server(options=channel.server_options())  # keepalive both ways (protos/channel.py)
    add_servicer(VerifierServicer(worker, Validator(runner.config.vocab_size, context, worker), info, metrics), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{args.host}:{args.port}"
    server.add_insecure_port(address)
    await server.start()
    await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
    if args.wait_for_drafters and hasattr(drafter, "wait_for_drafters"):
        logger.info("waiting for %d drafters to register at %s", args.wait_for_drafters, drafter.address)
        loop = asyncio.get_running_loop()
        while not await loop.run_in_executor(None, drafter.wait_for_drafters, args.wait_for_drafters, 5.0):
            logger.info("%d of %d drafters registered", drafter.num_alive, args.wait_for_drafters)
    await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    kv = runner.kv_cache
    logger.info("verifier serving %s on %s: %s %s, KV cache %d pages x %d tokens, speculation %s, prefix cache %s",
                info.model_id, address, runner.device, str(kv.dtype).removeprefix("torch."), kv.num_pages, kv.page_size,
                (info.speculative_algorithm or "off") + (f" (drafters at {drafter.address})" if hasattr(drafter, "address") else ""),
                "off" if cache is None else "on")
    await server.wait_for_termination()


def run(args: argparse.Namespace) -> int:
    runtime_args.setup_logging(args.log_level)
    try:
        runtime_args.check_sglang_server_flags(args, "splitspec verifier")
        engine_args.spec_config(args)  # flag combinations, before anything loads
        curve = curve_keys(args)
        asyncio.run(serve(args, curve))
    except (ValueError, OSError) as exc:  # FlagError, ConfigError, CheckpointError, CurveError, a path that is not there
        print(f"splitspec verifier: error: {exc}", file=sys.stderr)
        return 2
    return 0
