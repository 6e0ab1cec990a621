"""`splitspec verifier`'s service: the target model and the step loop behind the splitspec.v1.Verifier gRPC API (the
command's description and flags: flags.py).

Two processes: this one (the engine: the model, the step loop on its own thread (worker.EngineWorker),
the drafter pool, the metrics) and the front it starts (front_process.py: the gRPC server, the streams
and their protobuf), so that gRPC's work never takes the engine's GIL; each step's deltas cross in one
message (engine_link.py). --disable-frontend-multiprocessing serves gRPC on this process's event loop
instead (LocalBackend below: a step's deltas cross from the engine thread in one hand-off). The service
itself (grpc_front.py) is the same either way.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading

from splitspec import engine_args, event_loop, heap, model_flags, speculation
from splitspec.log_format import setup_logging
from splitspec.protos import engine_link_pb2 as link
from splitspec.protos import verifier_pb2 as pb
from splitspec.runtime.curve import CurveError, ServerKeys, server_keys
from splitspec.verifier_svc import step_columns
from splitspec.verifier_svc.adaptive import verify_tree_sizes
from splitspec.verifier_svc.engine import Engine
from splitspec.verifier_svc.flags import build_parser  # noqa: F401  (cli.py finds a command's parser in its module)
from splitspec.verifier_svc.grpc_front import Limits, NoCounts, Stream, VerifierServicer, set_serving, start_server
from splitspec.verifier_svc.stats_log import StatsLog
from splitspec.verifier_svc.warmup import warm_up
from splitspec.verifier_svc.worker import EngineWorker, Submission

logger = logging.getLogger("splitspec.verifier")


class StreamRouter:
    """The worker's publish with --disable-frontend-multiprocessing: on the engine thread, a step's deliveries are
    written as columns (step_columns.py, as for the front process: a snapshot of each request's counts as of this
    step) and the step crosses to the event loop in one call, which builds the TokenDeltas and files each with its
    stream."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.columns = step_columns.Reader()  # used on the event loop only

    def publish(self, deliveries) -> None:
        columns = link.StepColumns()
        step_columns.write(deliveries, columns)
        if columns.request_ids:
            streams = {submission.client_id: submission.stream for submission, _ in deliveries}
            self.loop.call_soon_threadsafe(self._file, columns, streams)

    def _file(self, columns, streams: dict) -> None:
        for delta in self.columns.deltas(columns):
            streams[delta.request_id].put(delta)


class LocalBackend:
    """The engine on a thread of this process (--disable-frontend-multiprocessing)."""

    def __init__(self, worker: EngineWorker, stream_interval: int = 1):
        self.worker, self.stream_interval = worker, stream_interval
        self.submissions: dict[str, Submission] = {}  # live request id -> its submission

    def submit(self, submit: pb.SubmitRequest, params, stream: Stream) -> None:
        submission = Submission(submit.request_id, list(submit.prompt_ids), params, submit.speculate, stream=stream,
                                interval=submit.stream_interval or self.stream_interval)
        self.submissions[submit.request_id] = submission
        self.worker.submit(submission)

    async def abort(self, request_id: str) -> None:
        submission = self.submissions.pop(request_id, None)
        if submission is not None:  # waits until the engine took it (its last delta is on the way)
            await asyncio.get_running_loop().run_in_executor(None, self.worker.abort, submission)

    def finished(self, request_id: str) -> None:
        self.submissions.pop(request_id, None)


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


def make_drafter(args: argparse.Namespace, settings: speculation.Speculation | None, runner, registry, model_id: str,
                 curve: ServerKeys | None):
    """(drafter client, speculation config) for the resolved Speculation: the pool of drafter processes at
    --drafter-bind-addr, or the algorithm drafting in this process (none without --speculative-algorithm)."""
    if not (args.drafter_bind_addr and settings is not None):
        return engine_args.in_process_drafter(settings, target=runner)
    from splitspec.verifier_svc.drafter_pool import DrafterPool
    from splitspec.verifier_svc.metrics import PoolMetrics

    from splitspec.draft_models import capture_for
    from splitspec.protos.step_limits import verifier_receive_limit
    from splitspec.runtime.tensor_plane import device_identity
    s = settings
    capture_for(runner, s.hidden_state_layers)
    # trees for every request that can run at once (each holds a KV page at least)
    max_requests = args.max_running_requests or runner.kv_cache.num_pages
    max_message = verifier_receive_limit(max_requests, s.num_draft_tokens, s.num_bets)
    return DrafterPool(args.drafter_bind_addr, s.algorithm, runner.config.vocab_size, draft_model=s.draft_model,
                       timeout=args.drafter_timeout_ms / 1000, heartbeat_timeout=args.drafter_heartbeat_timeout,
                       hidden_state_layers=s.hidden_state_layers,
                       metrics=PoolMetrics(registry, model_id) if registry is not None else None,
                       overlap=s.overlap, num_bets=s.num_bets, device=device_identity(runner.device),
                       overlap_max_bs=s.overlap_max_bs, tensor_device=runner.device,
                       ipc_buffer_bytes=args.drafter_ipc_buffer_mb << 20, curve=curve,
                       max_message_bytes=max_message), speculation.spec_config(s)


def grammar_compiler(model_dir, vocab_size: int, eos: set[int]):
    """Structured outputs' compiler over the target's tokenizer (runtime/grammar.py): it loads nothing until the
    first request with a grammar (then xgrammar and the tokenizer, on its own thread); where that fails, such
    requests end with an error naming why."""
    from splitspec.runtime.grammar import Compiler

    return Compiler.for_model(str(model_dir), vocab_size, eos)


def check_intervals(args: argparse.Namespace) -> None:
    """--stream-interval, --decode-log-interval and --watchdog-timeout, refused before the model loads when they
    cannot be honoured."""
    for flag, value, least, what in (("--stream-interval", args.stream_interval, 1, "at least 1 token"),
                                     ("--decode-log-interval", args.decode_log_interval, 0, "0 (no lines) or more steps"),
                                     ("--watchdog-timeout", args.watchdog_timeout, 0, "0 (never) or more seconds")):
        if value < least:
            raise SystemExit(f"splitspec verifier: {flag} {value}: must be {what}")


def serve(args: argparse.Namespace, settings: speculation.Speculation | None, curve: ServerKeys | None = None) -> int:
    from splitspec.runtime.config import eos_token_ids
    from splitspec.runtime.runner import ModelRunner

    check_intervals(args)
    if args.enable_metrics and args.metrics_port is None:
        args.metrics_port = args.port + 1
    model_dir = model_flags.resolve_model(args)
    runner = ModelRunner.load(model_flags.runtime_config(args, model_dir))
    # the context served (--context-length may pass the model's own): what the graphs, and an in-process drafter's, hold
    runner.context_length = context = context_length(args, runner.config.max_position_embeddings)
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
    drafter, spec = make_drafter(args, settings, runner, registry, model_id, curve)
    if registry is not None:  # Prometheus finds the drafters' own endpoints through GET /sd/drafters
        pool = drafter if args.drafter_bind_addr and args.speculative_algorithm else None
        start_metrics_server(registry, args.host, args.metrics_port,
                             json_routes={"/sd/drafters": pool.scrape_targets if pool is not None else list})
        logger.info("metrics on http://%s:%d/metrics, drafter discovery at /sd/drafters", args.host, args.metrics_port)
    # after the drafter chose the layers to capture; before serving: decode, and the trees it will verify
    runner.capture_cuda_graphs(tree_nodes=verify_tree_sizes(spec if args.speculative_algorithm else None))
    from splitspec.verifier_svc.prefix_cache import PrefixCache

    cache = None if args.disable_radix_cache else PrefixCache(runner.kv_cache.allocator, runner.kv_cache.page_size)
    overlap = runner.device.type == "cuda" and not args.disable_overlap_schedule
    engine = Engine(runner, drafter, spec, eos, engine_args.scheduler_config(args), prefix_cache=cache,
                    grammars=grammar_compiler(model_dir, runner.config.vocab_size, eos)
                    if args.grammar_backend == "xgrammar" else None,
                    overlap_schedule=(overlap or args.async_scheduling) and not args.disable_overlap_schedule)
    if runner.device.type == "cuda" and not args.skip_server_warmup:
        warm_up(engine)
    heap.freeze("verifier")
    info = pb.ModelInfo(model_id=model_id, model_path=str(model_dir),
                        vocab_size=runner.config.vocab_size, max_context_tokens=context,
                        eos_token_ids=sorted(eos), speculative_algorithm=args.speculative_algorithm or "",
                        speculative_num_draft_tokens=spec.num_draft_tokens if drafter else 0)
    kv = runner.kv_cache
    limits = Limits(runner.config.vocab_size, context, runner.request_pages, kv.page_size, engine.spec.num_draft_tokens)
    address = f"{args.host}:{args.port}"

    def ready() -> None:
        if args.wait_for_drafters and hasattr(drafter, "wait_for_drafters"):
            logger.info("waiting for %d drafters to register at %s", args.wait_for_drafters, drafter.address)
            while not drafter.wait_for_drafters(args.wait_for_drafters, 5.0):
                logger.info("%d of %d drafters registered", drafter.num_alive, args.wait_for_drafters)
        logger.info("verifier serving %s on %s: %s %s, KV cache %d pages x %d tokens, speculation %s, prefix cache %s, "
                    "gRPC %s", info.model_id, address, runner.device, str(kv.dtype).removeprefix("torch."), kv.num_pages,
                    kv.page_size, (info.speculative_algorithm or "off")
                    + (f" (drafters at {drafter.address})" if hasattr(drafter, "address") else ""),
                    "off" if cache is None else "on",
                    "on this process" if args.disable_frontend_multiprocessing else "in its front process")

    if args.disable_frontend_multiprocessing:
        return event_loop.run(serve_here(engine, metrics, overlap, info, limits, address, ready, args.stream_interval,
                                         StatsLog(args.decode_log_interval), args.watchdog_timeout))
    return serve_with_front(args, engine, metrics, overlap, info, limits, address, ready)


def serve_with_front(args: argparse.Namespace, engine: Engine, metrics, overlap: bool, info: pb.ModelInfo,
                     limits: Limits, address: str, ready) -> int:
    """gRPC in the front process (the default): the engine's thread here, until the front exits or a signal."""
    from splitspec.verifier_svc.engine_link import FrontLink

    front, worker = FrontLink(address, args.log_level, args.stream_interval), None
    try:
        worker = EngineWorker(engine, metrics, publish=front.publish, overlap=overlap,
                              stats=StatsLog(args.decode_log_interval), watchdog_timeout=args.watchdog_timeout)
        if metrics is not None:
            metrics.observe_state(engine)
        worker.start()
        front.start(worker, metrics, info, limits)
        ready()
        front.serving()
        return front.run()
    finally:
        front.close()
        if worker is not None:  # its loop ends before the process does
            worker.stop()


async def serve_here(engine: Engine, metrics, overlap: bool, info: pb.ModelInfo, limits: Limits, address: str,
                     ready, stream_interval: int = 1, stats: StatsLog | None = None,
                     watchdog_timeout: float = 0.0) -> int:
    """gRPC on this process's event loop (--disable-frontend-multiprocessing). SIGTERM is the loop's own callback
    here, not an exception raised wherever the main thread is: one raised inside grpc's Cython callbacks (a client's
    connection closing as the signal lands) can be swallowed there, and the verifier then never exits."""
    loop = asyncio.get_running_loop()
    terminated = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, terminated.set)
    worker = EngineWorker(engine, metrics, publish=StreamRouter(loop).publish, overlap=overlap,
                          stats=stats, watchdog_timeout=watchdog_timeout)
    if metrics is not None:
        metrics.observe_state(engine)
    worker.start()
    counts = metrics if metrics is not None else NoCounts()  # EngineMetrics counts refusals and malformed messages
    server, health = await start_server(VerifierServicer(LocalBackend(worker, stream_interval), limits, info, counts),
                                        address)
    try:
        if await _unless(terminated, _in_daemon_thread(ready)):
            return 128 + signal.SIGTERM
        await set_serving(health)
        await terminated.wait()  # only this stops the server
        return 128 + signal.SIGTERM
    finally:
        if terminated.is_set():
            logger.info("SIGTERM: the verifier stops serving")
        await server.stop(None)  # every stream ends now, as when a killed front process ends them
        worker.stop()


async def _unless(event: asyncio.Event, awaitable) -> bool:
    """Awaits awaitable unless event is set first: then True, and awaitable is cancelled."""
    work, stop = asyncio.ensure_future(awaitable), asyncio.ensure_future(event.wait())
    await asyncio.wait((work, stop), return_when=asyncio.FIRST_COMPLETED)
    work.cancel(), stop.cancel()  # either is done already
    if event.is_set():
        return True
    work.result()  # what it raised
    return False


async def _in_daemon_thread(function) -> None:
    """function() on a daemon thread: an executor's thread holds the process's exit until it returns, and ready()
    may wait for drafters that never come."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def settle(error: BaseException | None) -> None:
        if not done.done():  # not cancelled meanwhile
            done.set_exception(error) if error is not None else done.set_result(None)

    def body() -> None:
        try:
            function()
        except BaseException as exc:  # noqa: BLE001 (raised where it is awaited)
            loop.call_soon_threadsafe(settle, exc)
        else:
            loop.call_soon_threadsafe(settle, None)

    threading.Thread(target=body, name="ready", daemon=True).start()
    await done


def _terminated(signum, frame) -> None:
    raise SystemExit(128 + signum)


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    # SIGTERM (how `up` and docker stop a service) ends the process as an exception: its finally blocks run, so the gRPC
    # front process is stopped and its socket directory removed (a bare exit left one /tmp directory per stop)
    signal.signal(signal.SIGTERM, _terminated)
    try:
        model_flags.check_sglang_server_flags(args, "splitspec verifier")
        settings = speculation.resolve(args)  # the flags' speculation, resolved once, before anything loads
        curve = curve_keys(args)
        return serve(args, settings, curve)
    except (ValueError, OSError) as exc:  # FlagError, ConfigError, CheckpointError, CurveError, a path that is not there
        print(f"splitspec verifier: error: {exc}", file=sys.stderr)
        return 2
