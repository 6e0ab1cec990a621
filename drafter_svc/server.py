"""`splitspec drafter`'s service: one drafting algorithm in its own process, serving a verifier over ZeroMQ
(the command's description and flags: flags.py).

This module is the connection (registration, heartbeats, the socket, message order); drafting.py is what a
request's messages make it draft.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import socket
import time

from splitspec import engine_args, heap, speculation
from splitspec.drafter_svc import convert
from splitspec.drafter_svc.base import Drafter
from splitspec.drafter_svc.flags import build_parser  # noqa: F401  (cli.py finds a command's parser in its module)
from splitspec.drafter_svc.drafting import Drafting
from splitspec.drafter_svc.grammars import RequestGrammars
from splitspec.host_profile import HostProfile
from splitspec.protos.step_limits import drafter_receive_limit
from splitspec.log_format import setup_logging
from splitspec.runtime.curve import ClientKeys, CurveError, HandshakeMonitor, Throttle, client_keys, make_client
from splitspec.runtime.tensor_plane import FramePlane, device_identity, visible_gpus

logger = logging.getLogger("splitspec.drafter")


MAX_BATCH = 1024  # messages read off the socket before handling them


class RefusedError(RuntimeError):
    """The verifier refused the registration (algorithm or model mismatch) or the handshake (CURVE)."""


def receive_limit(drafter: Drafter, hidden_state_layers) -> int:
    """The largest frame a legal verifier sends this drafter: a header, or one request's hidden states (float32 at
    most, one row per captured layer) over the longest context its model takes (at least 128 Ki tokens: a verifier
    may serve a longer --context-length than the draft's config names)."""
    runner = getattr(drafter, "runner", None)
    if not hidden_state_layers or runner is None:
        return drafter_receive_limit(0, 0)
    config = runner.config
    context = max(config.max_position_embeddings, 1 << 17)
    return drafter_receive_limit(context, 4 * len(hidden_state_layers) * config.hidden_size)


class DrafterServer(Drafting):
    def __init__(self, drafter: Drafter, address: str, name: str, capacity: int, max_nodes: int,
                 heartbeat_interval: float = 0.25, verifier_timeout: float = 5.0, draft_model: str = "",
                 vocab_size: int = 0, hidden_state_layers: tuple[int, ...] = (), metrics=None,
                 metrics_port: int = 0, metrics_host: str = "", curve: ClientKeys | None = None,
                 max_message_bytes: int | None = None, grammars: RequestGrammars | None = None):
        """curve: this drafter's CURVE keys and the verifier's public key (None: no CURVE).
        grammars: its constrained requests' grammars (grammars.py; None: drafted without them).
        max_message_bytes: the largest frame the verifier may send (default: protos.step_limits.receive_limit for
        this drafter's model); a verifier sending more is disconnected before the frame is allocated."""
        import zmq

        self.zmq = zmq
        self.drafter, self.address, self.name = drafter, address, name
        self.capacity, self.max_nodes = capacity, max_nodes
        self.heartbeat_interval, self.verifier_timeout = heartbeat_interval, verifier_timeout
        self.draft_model, self.vocab_size, self.hidden_state_layers = draft_model, vocab_size, list(hidden_state_layers)
        self.max_message_bytes = max_message_bytes or receive_limit(drafter, self.hidden_state_layers)
        self.epoch = secrets.randbits(63) or 1
        self.session = 0
        self.verifier_epoch = 0
        self.requests: set[str] = set()
        self.steps = 0
        self.dropped = 0  # messages from the verifier that could not be used
        self.plane = FramePlane()
        self.ipc = None  # runtime.tensor_plane.CudaIpcReader: the verifier's buffer, when it offered one
        self.metrics = metrics  # DrafterMetrics or None
        self.metrics_port, self.metrics_host = metrics_port, metrics_host  # told to the verifier at registration
        runner = getattr(drafter, "runner", None)
        self.device = runner.device if runner is not None else "cpu"
        self.bet_steps = 0  # steps whose bets were drafted (overlap)
        self.grammars = grammars or RequestGrammars(None, 0)
        self.received_ns = 0  # wall clock when the message being handled arrived (stamped on replies)
        self.curve = curve
        self.context = zmq.Context.instance()
        self.socket = None
        self.handshakes: HandshakeMonitor | None = None  # the socket's failed handshakes
        self.poller = None
        self._handshake_log = Throttle()
        self._behind_log = Throttle()
        self.stopping = False

    # socket ---------------------------------------------------------------------------------------
    def _connect(self) -> None:
        self._close()
        self.socket = self.context.socket(self.zmq.DEALER)
        self.socket.setsockopt(self.zmq.LINGER, 0)
        self.socket.setsockopt(self.zmq.IMMEDIATE, 1)  # nothing queues up while the verifier is away
        self.socket.setsockopt(self.zmq.MAXMSGSIZE, self.max_message_bytes)
        if self.curve is not None:
            make_client(self.socket, self.curve)
        self.handshakes = HandshakeMonitor(self.socket, "drafter", self.curve is not None)
        self.poller = self.zmq.Poller()
        self.poller.register(self.socket, self.zmq.POLLIN)
        self.poller.register(self.handshakes.socket, self.zmq.POLLIN)
        self.socket.connect(self.address)

    def _close(self) -> None:
        if self.handshakes is not None:
            self.handshakes.close()
            self.handshakes = None
        if self.socket is not None:
            self.socket.close(linger=0)
            self.socket = None

    def _check_handshakes(self) -> bool:
        """Handshakes with the verifier: True when one succeeded (time to register); a refusal (RefusedError)
        ends the drafter; other failures are logged (at most once per reason every 10 s) while ZeroMQ reconnects."""
        succeeded = self.handshakes.num_succeeded
        for failure in self.handshakes.read():
            if failure.fatal:
                raise RefusedError(f"the handshake on {self.address} failed ({failure.reason}): {failure.detail}")
            held = self._handshake_log.allow(failure.reason, time.monotonic())
            if held is not None:
                logger.warning("the handshake with the verifier at %s failed (%s): %s; retrying%s", self.address,
                               failure.reason, failure.detail, f" ({held} more since the last report)" if held else "")
        return self.handshakes.num_succeeded > succeeded

    def _send(self, **kind) -> None:
        message = convert.envelope(self.name, self.epoch, self.session, **kind)
        data = message.SerializeToString()
        try:
            self.socket.send(data, self.zmq.NOBLOCK)
        except self.zmq.Again:  # no verifier connected (yet): registration and heartbeats retry
            return
        if self.metrics is not None:
            self.metrics.bytes.labels(direction="sent").inc(len(data))

    # state ------------------------------------------------------------------------------------------
    def _reset(self, why: str, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.resets.labels(reason=reason).inc()
            self.metrics.registered.set(0)
        if self.session or self.requests:
            logger.warning("%s: dropping %d requests of session %d and registering again", why, len(self.requests), self.session)
        for request_id in self.requests:
            self.drafter.release(request_id)
        self.requests.clear()
        self.grammars.clear()
        self.session = 0
        self.ipc = None  # the next session is offered a buffer of its own

    def _heartbeat(self) -> None:
        ipc = self.ipc
        self._send(heartbeat=convert.heartbeat(len(self.requests), self.steps, ipc is not None,
                                               ipc.consumed if ipc is not None else 0))

    def _map_ipc(self, buffer) -> None:
        """Map the CUDA-IPC buffer the verifier offered and say so; failing that, tensors stay in frames."""
        from splitspec.runtime.tensor_plane import CudaIpcReader

        try:
            self.ipc = CudaIpcReader(convert.cuda_ipc_fields(buffer), self.device)
        except Exception as exc:  # noqa: BLE001 (IPC not permitted, another driver, ...): frames work
            logger.warning("could not map the verifier's CUDA-IPC buffer (%s); hidden states come in frames", exc)
            return
        logger.info("mapped the verifier's CUDA-IPC buffer on %s (%d MiB): hidden states come through it",
                    buffer.device, buffer.size_bytes >> 20)
        self._heartbeat()

    def _register(self) -> None:
        self._send(register=convert.register(self.drafter.name, self.draft_model, self.vocab_size, self.hidden_state_layers,
                                             self.capacity, self.max_nodes, self.metrics_port, self.metrics_host,
                                             device_identity(self.device), self.drafter.supports_bets,
                                             visible_gpus() if self.drafter.needs_hidden_states
                                             and str(self.device).startswith("cuda") else []))

    # loop -------------------------------------------------------------------------------------------
    def serve(self) -> None:
        """Until stop(); raises RefusedError if the verifier refuses this drafter."""
        self._connect()
        profile = HostProfile(f"drafter-{self.name}")  # SPLITSPEC_PROFILE_HOST
        profile.start()
        try:
            self._serve(profile)
        finally:
            profile.stop()
            self._close()

    def _serve(self, profile: HostProfile) -> None:
        last_register = last_heartbeat = -1e9
        last_heard = connected = time.monotonic()
        logger.info("drafter %s (%s) connecting to %s%s", self.name, self.drafter.name, self.address,
                    " (CURVE)" if self.curve is not None else "")
        while not self.stopping:
            now = time.monotonic()
            if self.session == 0 and now - last_register >= 1.0:
                self._register()
                last_register = now
            if self.session and now - last_heartbeat >= self.heartbeat_interval:
                self._heartbeat()
                last_heartbeat = now
            if self.session and now - last_heard > self.verifier_timeout:
                self._reset(f"no word from the verifier for {self.verifier_timeout:.1f} s", "verifier_silent")
                self._connect()
                last_heard = connected = now
            if not self.session and now - connected > self.verifier_timeout:
                # registrations unanswered: the connection may be held by a peer that is not the verifier (a process
                # that had the address before it, keeping its accepted connections); a fresh one finds who binds it now
                logger.debug("no answer to registration on %s for %.1f s; connecting again", self.address,
                             self.verifier_timeout)
                self._connect()
                connected = now
            profile.tick()
            events = dict(self.poller.poll(timeout=int(self.heartbeat_interval * 1000) or 1))
            if self.handshakes.socket in events and self._check_handshakes() and self.session == 0:
                self._register()  # connected: register now rather than at the next retry
                last_register = time.monotonic()
            if self.socket in events:
                batch = self._receive_waiting()
                last_heard = time.monotonic()
                for received_ns, message, frames, superseded in self._in_order(batch):
                    self.received_ns = received_ns
                    try:
                        self._handle(message, frames, superseded)
                    except RefusedError:
                        raise
                    except Exception:  # a bug or a bad message must not take the drafter down; the verifier times out
                        logger.exception("failed to handle a message from the verifier; dropped")
                        self._count_drop("error")
                    if self.session and time.monotonic() - last_heartbeat >= self.heartbeat_interval:
                        self._heartbeat()  # a long backlog: beat between its messages
                        last_heartbeat = time.monotonic()
                if self.metrics is not None:
                    self.metrics.held.set(len(self.requests))

    def stop(self) -> None:
        self.stopping = True

    def _drop(self, why: str, reason: str) -> None:
        self._count_drop(reason)
        logger.warning("dropped a message from the verifier: %s", why)

    def _count_drop(self, reason: str) -> None:
        self.dropped += 1
        if self.metrics is not None:
            self.metrics.dropped.labels(reason=reason).inc()

    def _receive_waiting(self) -> list:
        """Every message waiting on the socket (at most MAX_BATCH), each as (arrival wall clock ns, frames)."""
        batch = []
        while len(batch) < MAX_BATCH:
            try:
                frames = self.socket.recv_multipart(self.zmq.NOBLOCK, copy=False)
            except self.zmq.Again:
                break
            batch.append((time.time_ns(), frames))
            if self.metrics is not None:
                self.metrics.bytes.labels(direction="received").inc(sum(len(f) for f in frames))
        return batch

    def _in_order(self, batch: list):
        """The waiting messages, parsed, as (arrival ns, message, frames, superseded request ids), in the order
        to handle them: replies to this drafter's own registration and heartbeats first (a verifier that no
        longer knows this session makes everything queued behind it for that session stale, dropped without
        drafting), then the verifier's messages in the order it sent them. An ask for a request that a later
        waiting message asks for (or opens, or releases) again is superseded: the verifier stopped waiting
        for its tree when it sent the next one, so its new tokens are taken but no tree or bets are drafted.
        A drafter that fell behind (its CPU or GPU shared, a long stall) thus catches up in one draft per
        request rather than drafting every stale step in turn while the verifier keeps moving on."""
        control, rest = [], []
        for received_ns, frames in batch:
            try:
                message = convert.parse_verifier(frames[0].bytes)
            except Exception as exc:  # noqa: BLE001 (protobuf raises DecodeError and others)
                self._drop(f"unreadable envelope ({exc})", "unreadable")
                continue
            replies = message.WhichOneof("kind") in ("register_reply", "heartbeat_reply")
            (control if replies else rest).append((received_ns, message, frames, frozenset()))
        later: set[str] = set()  # requests that a message after the one looked at names
        skipped = 0
        for i in range(len(rest) - 1, -1, -1):
            received_ns, message, frames, _ = rest[i]
            kind = message.WhichOneof("kind")
            if kind == "draft":
                asked = {a.request_id for a in message.draft.asks}
                rest[i] = (received_ns, message, frames, asked & later)
                skipped += len(asked & later)
                later |= asked
            elif kind == "open":
                later.add(message.open.request_id)
            elif kind == "release":
                later.update(message.release.request_ids)
        if skipped:
            if self.metrics is not None:
                self.metrics.superseded.inc(skipped)
            held = self._behind_log.allow("behind", time.monotonic())
            if held is not None:
                logger.warning("fell behind the verifier: %d messages were waiting; %d stale asks get no tree (only "
                               "the newest ask of each request is drafted)%s", len(batch), skipped,
                               f"; {held} more catch-ups since the last report" if held else "")
        return control + rest

    def _handle(self, message, frames, superseded: set[str] = frozenset()) -> None:
        """One message from the verifier (parsed; frames[0] is its envelope). superseded: requests whose
        asks in it are stale (see _in_order)."""
        kind = message.WhichOneof("kind")
        if kind == "register_reply":
            reply = message.register_reply
            if not reply.accepted:
                raise RefusedError(reply.reason)
            if self.session == 0:
                self.session, self.verifier_epoch = reply.session, message.verifier_epoch
                if reply.heartbeat_timeout_seconds > 0:  # beat well inside the verifier's patience
                    self.heartbeat_interval = min(self.heartbeat_interval, reply.heartbeat_timeout_seconds / 4)
                logger.info("registered with verifier epoch %d as session %d", self.verifier_epoch, self.session)
                if self.metrics is not None:
                    self.metrics.registered.set(1)
                    self.metrics.registrations.inc()
                self.ipc = None
                if reply.HasField("cuda_ipc"):
                    self._map_ipc(reply.cuda_ipc)
            return
        if self.session == 0 or message.session != self.session:  # for an old session (or none): stale
            self._count_drop("stale")
            logger.debug("dropped a %s for session %d (this one: %d)", kind, message.session, self.session)
            return
        if message.verifier_epoch != self.verifier_epoch:
            self._reset("the verifier restarted", "verifier_restarted")
            return
        if kind == "heartbeat_reply":
            if not message.heartbeat_reply.known:
                self._reset("the verifier no longer knows this session", "unknown_session")
        elif kind == "open":
            self._open(message, frames[1:])
        elif kind == "draft":
            self._draft(message, frames[1:], superseded)
        elif kind == "release":
            for request_id in message.release.request_ids:
                self._forget(request_id)
        else:
            self._drop(f"unexpected message kind {kind!r}", "unexpected_kind")


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    try:
        curve = client_keys(args.zmq_curve_server_key, args.zmq_curve_secret_key)
    except CurveError as exc:
        print(f"splitspec drafter: error: {exc}", file=__import__("sys").stderr)
        return 2
    if args.speculative_algorithm is None:
        print("splitspec drafter: error: --speculative-algorithm is required (the algorithm this drafter runs)",
              file=__import__("sys").stderr)
        return 2
    if args.speculative_algorithm in engine_args.HIDDEN_STATE_ALGORITHMS and not args.model_path:
        print(f"splitspec drafter: error: --speculative-algorithm {args.speculative_algorithm} needs the target's "
              "--model-path (the draft shares its embedding; MTP layers live in it)", file=__import__("sys").stderr)
        return 2
    try:
        from splitspec.draft_models import build_drafter

        settings = speculation.resolve(args)  # the flags' speculation, resolved once
        max_nodes = settings.num_draft_tokens
        default_tokens = 65536 if args.mem_fraction_static is None else None
        drafter = build_drafter(settings, max_total_tokens=default_tokens)
    except (ValueError, OSError) as exc:  # FlagError, a bad checkpoint, a path that is not there
        print(f"splitspec drafter: error: {exc}", file=__import__("sys").stderr)
        return 2
    name = args.drafter_name or f"{socket.gethostname()}:{os.getpid()}"
    model_drafter = settings.kind != "ngram"
    metrics, metrics_port, metrics_host = None, 0, ""
    if args.metrics_port is not None:
        from prometheus_client import CollectorRegistry

        from splitspec.drafter_svc.metrics import DrafterMetrics
        from splitspec.metrics_http import start_metrics_server

        registry = CollectorRegistry()
        runner = getattr(drafter, "runner", None)
        metrics = DrafterMetrics(registry, name, settings.algorithm, settings.draft_model,
                                 runner.device if runner is not None else "cpu")
        try:
            http = start_metrics_server(registry, args.metrics_host, args.metrics_port)
        except OSError as exc:
            print(f"splitspec drafter: error: cannot serve metrics on {args.metrics_host}:{args.metrics_port}: {exc}",
                  file=__import__("sys").stderr)
            return 2
        metrics_port = http.server_address[1]
        metrics_host = "" if args.metrics_host in ("0.0.0.0", "::", "") else args.metrics_host
        logger.info("metrics on http://%s:%d/metrics", args.metrics_host, metrics_port)
    grammars = None
    if args.model_path:
        try:
            grammars = RequestGrammars.for_model(args.model_path, args.revision, metrics=metrics)
        except (ValueError, OSError) as exc:  # no config to read: constrained requests draft without their grammars
            logger.warning("no grammars for constrained requests (%s): they draft unguided", exc)
    server = DrafterServer(drafter, args.verifier_drafter_addr, name, args.max_running_requests, max_nodes,
                           args.heartbeat_interval, args.verifier_timeout,
                           draft_model=settings.draft_model,
                           vocab_size=drafter.vocab_size if model_drafter else 0,
                           hidden_state_layers=drafter.hidden_state_layers, metrics=metrics,
                           metrics_port=metrics_port, metrics_host=metrics_host, curve=curve, grammars=grammars)
    heap.freeze("drafter")
    try:
        server.serve()
    except RefusedError as exc:
        logger.error("the verifier refused this drafter: %s", exc)
        return 3
    except KeyboardInterrupt:
        pass
    return 0
