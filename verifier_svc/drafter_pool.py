"""The drafter pool: the verifier's ZeroMQ DrafterClient (ARCHITECTURE.md §2, §4).

The verifier binds one ROUTER socket (--drafter-bind-addr); `splitspec drafter` processes connect,
register and heartbeat. One I/O thread owns the socket: it answers registrations and heartbeats,
declares a drafter dead when its heartbeats stop, and files draft replies. The engine thread calls
open / request / collect / release; what it sends goes through a queue to the I/O thread.

    engine thread                    I/O thread                         drafters
    open(r)      -> pin r to the least loaded live drafter, OpenRequest  ->  d1
    request(asks)-> one DraftRequest per drafter (step id)               ->  d1, d2
    collect(ids) <- trees filed by step id, or DRAFT_FAULT at the deadline <- DraftReply
    release(r)   -> ReleaseRequest                                       ->  d1

Nothing a drafter does can fail, stall or change a request: a reply that is late, unreadable, from an
unknown or old session, for a step or request it was not asked, or with an invalid tree is dropped,
counted and logged, and that request decodes a plain token that step. Requests of a dead drafter are
re-pinned (re-opened with their full token history) on the next ask, or continue unspeculated while
no drafter is alive. Drafters join and leave at any time.

With CURVE keys (--zmq-curve-secret-key, --zmq-curve-authorized-keys; runtime/curve.py) the socket is a
CURVE server in a context of its own, whose ZAP handler admits only the authorized drafters' keys. A
connection refused in the handshake (an unknown key, a drafter without CURVE) never delivers a message,
so it never registers; the socket's monitor reports it, and it is logged and counted by reason.

DrafterPool is this module (the engine thread's calls, the I/O thread) and three mixins over its state:
drafter_membership (registration, heartbeats, death, pinning), drafter_bets (overlap's bets) and
drafter_replies (filing and timing the drafters' replies).
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import secrets
import threading
import time

from splitspec.protos.step_limits import verifier_receive_limit
from splitspec.runtime.curve import Authorizer, HandshakeMonitor, ServerKeys, Throttle, make_server
from splitspec.runtime.tensor_plane import CudaIpcPlane, FramePlane, frame_bytes
from splitspec.runtime.tree import DraftTree
from splitspec.verifier_svc import convert
from splitspec.verifier_svc.drafter_bets import OverlapBets
from splitspec.verifier_svc.drafter_client import DRAFT_FAULT, DraftAsk, DrafterClient
from splitspec.verifier_svc.drafter_membership import Drafter, DrafterMembership
from splitspec.verifier_svc.drafter_replies import DraftReplies, Step

logger = logging.getLogger(__name__)


OVERLAP_MODES = ("auto", "on", "off")


class DrafterPool(DrafterMembership, OverlapBets, DraftReplies, DrafterClient):
    def __init__(self, bind: str, algorithm: str, vocab_size: int, draft_model: str | None = None,
                 timeout: float = 0.5, heartbeat_timeout: float = 2.0, metrics=None,
                 hidden_state_layers: tuple[int, ...] = (), overlap: str = "auto", num_bets: int = 0,
                 device: str = "cpu", overlap_max_bs: int = 8, tensor_device=None, ipc_buffer_bytes: int = 0,
                 curve: ServerKeys | None = None, max_message_bytes: int = verifier_receive_limit(4096, 64, 2)):
        """overlap (--speculative-overlap): ask drafters for bets on the outcome of the tree being verified,
        num_bets per request, so that when one comes true the next tree is ready when verification ends;
        auto: every drafter that does not share the verifier's device (device: "cuda:<UUID>" or "cpu"; a CPU
        drafter on this host shares its cores); and only for steps of at most overlap_max_bs requests per
        drafter, since bets multiply a drafter's work by num_bets. tensor_device (the verifier's torch device)
        and ipc_buffer_bytes > 0: a drafter that sees this GPU (it shares the host) is offered a CUDA-IPC
        buffer of that size for the hidden states (runtime.tensor_plane.CudaIpcPlane) instead of frames.
        curve: the verifier's CURVE keys and the drafters' it admits (None: no CURVE, as before).
        max_message_bytes: the largest frame a drafter may send (protos.step_limits.verifier_receive_limit of the
        verifier's limits); a drafter sending more is disconnected before the frame is allocated."""
        import zmq

        super().__init__()
        self.zmq = zmq
        # EAGLE-style drafters: every token after a request's first travels with the target's hidden
        # state(s) before it (raw frames through the tensor plane); the pool keeps them for re-pins.
        # hidden_state_layers: what the verifier captures (-1: the final normed state; else layer inputs)
        self.hidden_state_layers = tuple(hidden_state_layers)
        self.needs_hidden_states = bool(hidden_state_layers)
        self._hidden_history: dict[str, list] = {}
        self.algorithm, self.vocab_size, self.draft_model = algorithm, vocab_size, draft_model
        self.timeout, self.heartbeat_timeout = timeout, heartbeat_timeout
        if overlap not in OVERLAP_MODES:
            raise ValueError(f"--speculative-overlap {overlap!r}: expected one of {', '.join(OVERLAP_MODES)}")
        self.overlap, self.num_bets, self.device = overlap, max(num_bets, 0), device
        self.overlap_max_bs = overlap_max_bs
        self._bet_step: dict[str, int] = {}  # request -> the step whose DraftBets carries bets on its current tree
        self._bets: dict[str, list[tuple[tuple[int, ...], DraftTree]]] = {}  # request -> (outcome, tree), filed
        # step -> (drafter, {request: budget} still due, every request it asked bets for)
        self._bet_waits: dict[int, tuple[Drafter, dict[str, int], set[str]]] = {}
        self.metrics = metrics
        self.epoch = secrets.randbits(63) or 1
        self.plane = FramePlane()
        self.tensor_device, self.ipc_buffer_bytes = tensor_device, ipc_buffer_bytes
        self._ipc_planes: dict[str, CudaIpcPlane] = {}  # drafter name -> its CUDA-IPC buffer
        self._ipc_worked: dict[str, bool] = {}  # drafter name -> some session of it mapped the buffer
        self.curve = curve
        self._bind(bind, curve, max_message_bytes)
        self._wake_lock = threading.Lock()
        self._wake_pending = False  # one queued wake-up is enough
        self._flushed = threading.Event()  # set by the I/O thread whenever it has sent everything queued
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._filed_ns = 0  # wall clock of the last filed reply or bets (transport timing)
        self._cond = threading.Condition()
        self._drafters: dict[int, Drafter] = {}  # session -> live drafter
        self._sessions = itertools.count(1)
        self._step_ids = itertools.count(1)
        self._pins: dict[str, Drafter | None] = {}
        self._history: dict[str, list[int]] = {}
        self._grammars: dict[str, tuple[tuple[str, str], int]] = {}  # a constrained request's grammar, prompt length
        self._pending: dict[int, Step] = {}
        self._step_of: dict[str, int] = {}
        self._results: dict[str, object] = {}
        self._expired: collections.deque[int] = collections.deque(maxlen=4096)  # steps given up on
        self._stopping = False
        self._thread = threading.Thread(target=self._io_loop, name="drafter-pool", daemon=True)
        self._thread.start()
        logger.info("drafter pool for %s bound at %s (deadline %.0f ms, heartbeat timeout %.1f s, %s)", algorithm,
                    self.address, timeout * 1000, heartbeat_timeout,
                    f"CURVE, {len(curve.authorized)} authorized drafter key(s) in {curve.authorized_dir}"
                    if curve is not None else "no CURVE")

    def _bind(self, bind: str, curve: ServerKeys | None, max_message_bytes: int) -> None:
        """The ROUTER socket bound at `bind` (a CURVE server with curve, in a context of its own whose ZAP handler
        admits the authorized drafters), its handshake monitor, and the I/O thread's wake-up pair."""
        zmq = self.zmq
        self._context = self._authorizer = None
        if curve is None:
            context = zmq.Context.instance()
        else:  # a context of its own: its ZAP handler (one per context) is this pool's, bound before the socket
            context = self._context = zmq.Context()
            self._authorizer = Authorizer(context, curve)
        self.handshake_failures: collections.Counter[str] = collections.Counter()  # reason -> connections refused
        self._handshake_log = Throttle()
        self._router = context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an undeliverable message raises instead of vanishing
        self._router.setsockopt(zmq.SNDHWM, 100_000)
        self._router.setsockopt(zmq.RCVHWM, 100_000)
        self._router.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)  # replies are trees: a peer sending more is cut off
        self.max_message_bytes = max_message_bytes
        if curve is not None:
            make_server(self._router, curve)
        self._handshakes = HandshakeMonitor(self._router, "verifier", curve is not None)
        self._router.bind(bind)
        self.address = self._router.getsockopt(zmq.LAST_ENDPOINT).decode()
        wake = f"inproc://drafter-pool-wake-{id(self)}"
        self._wake_in = context.socket(zmq.PAIR)
        self._wake_in.bind(wake)
        self._wake_out = context.socket(zmq.PAIR)
        self._wake_out.connect(wake)

    # what the engine calls ---------------------------------------------------------------------------
    @property
    def num_alive(self) -> int:
        with self._cond:
            return len(self._drafters)

    def scrape_targets(self) -> list[dict]:
        """Prometheus HTTP service discovery (http_sd_configs) of the live drafters' /metrics endpoints:
        one target group per drafter, its pool name, algorithm and session as __meta_splitspec_* labels
        (for relabelling; the drafters' samples carry their own `drafter` label)."""
        with self._cond:
            return [{"targets": [d.metrics_target],
                     "labels": {"__meta_splitspec_drafter": d.name, "__meta_splitspec_algorithm": d.algorithm,
                                "__meta_splitspec_session": str(d.session)}}
                    for d in sorted(self._drafters.values(), key=lambda d: d.name) if d.metrics_target]

    def wait_for_drafters(self, count: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self._drafters) < count:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def open(self, request_id: str, prompt_ids: list[int], grammar: tuple[str, str] | None = None,
             prompt_tokens: int = 0) -> None:
        with self._cond:
            self._history[request_id] = list(prompt_ids)
            if grammar is not None:  # sent with every (re)open: the drafter follows the output with its matcher
                self._grammars[request_id] = (grammar, prompt_tokens)
            if self.needs_hidden_states:
                self._hidden_history[request_id] = []
            self._pins[request_id] = None
            self._pin(request_id, repin=False)

    def request(self, asks: list[DraftAsk]) -> None:
        self._flushed.clear()
        if self._request(asks):
            # hand the GIL to the I/O thread until the asks are on the wire: otherwise they wait for this thread's
            # next blocking call (the next step's collect, or the end of its verify), and the drafter idles meanwhile
            self._flushed.wait(0.005)

    def _request(self, asks: list[DraftAsk]) -> int:
        """Files the asks and queues their DraftRequests; how many were queued."""
        groups: dict[int, tuple[Drafter, list]] = {}
        later = []  # (history, index, GPU rows): host copies made after the sends are queued
        sent = 0
        with self._cond:
            for ask in asks:
                history = self._history.get(ask.request_id)
                if history is None:
                    continue
                history.extend(ask.new_tokens)
                hidden = None
                drafter = self._pins.get(ask.request_id)
                ipc = drafter is not None and drafter.alive and drafter.ipc_ready
                if self.needs_hidden_states and ask.new_tokens:  # one host copy, kept for re-pins
                    hidden = ask.hidden.detach()
                    rows = self._hidden_history[ask.request_id]
                    if ipc and hidden.is_cuda:  # the GPU rows go through the buffer; the host copy once they left
                        later.append((rows, len(rows), hidden))
                        rows.append(None)
                    else:
                        hidden = hidden.to("cpu")
                        rows.append(hidden)
                self._results.pop(ask.request_id, None)
                self._step_of.pop(ask.request_id, None)
                new_tokens = ask.new_tokens
                taken = 0
                if drafter is None or not drafter.alive:
                    self._forget_bets(ask.request_id)
                    drafter = self._pin(ask.request_id, repin=drafter is not None)
                    new_tokens = []  # the open carried the whole history
                elif ask.max_nodes >= 2:
                    taken = self._match_bet(drafter, ask)
                if drafter is None:
                    self._results[ask.request_id] = DRAFT_FAULT  # no drafter alive: decode plainly
                    continue
                bets = self.num_bets if drafter.overlap and ask.max_nodes >= 2 else 0
                if hidden is not None and hidden.is_cuda and not drafter.ipc_ready:  # re-pinned meanwhile: frames
                    hidden = hidden.to("cpu")
                groups.setdefault(drafter.session, (drafter, []))[1].append(
                    (DraftAsk(ask.request_id, new_tokens, ask.max_nodes, hidden if new_tokens else None), taken, bets))
            for drafter, entries in groups.values():  # a large batch: no bets (they would outlast verification)
                if sum(1 for e in entries if e[0].max_nodes >= 2) > self.overlap_max_bs:
                    entries[:] = [(a, taken, 0) for a, taken, _ in entries]
            now = time.monotonic()
            for session, (drafter, entries) in groups.items():
                if not drafter.alive:  # it died while we waited for bets: these requests decode plainly this step
                    for ask, taken, _ in entries:  # (a taken bet's tree stays: any tree is safe to verify)
                        if not taken:
                            self._results[ask.request_id] = DRAFT_FAULT
                    continue
                group = [a for a, _, _ in entries]
                step_id = next(self._step_ids)
                step = self._pending[step_id] = Step(drafter, {a.request_id: a.max_nodes for a in group}, now, time.time_ns())
                for ask, taken, bets in entries:
                    if not taken:  # a taken bet's tree is filed already
                        self._step_of[ask.request_id] = step_id
                    if bets:
                        self._bet_step[ask.request_id] = step_id
                        due = self._bet_waits.setdefault(step_id, (drafter, {}, set()))
                        due[1][ask.request_id] = ask.max_nodes
                        due[2].add(ask.request_id)
                infos, frames = self._plane(drafter).pack([("hidden_states", a.request_id, a.hidden) for a in group
                                                           if a.hidden is not None])
                nbytes = sum(a.hidden.numel() * a.hidden.element_size() for a in group if a.hidden is not None)
                if nbytes and self.metrics is not None:  # whichever plane carried them
                    self.metrics.hidden_bytes.labels(drafter=drafter.name).inc(nbytes)
                    self.metrics.hidden_bytes_per_step.labels(drafter=drafter.name).observe(nbytes)
                self._send(drafter, convert.draft_request(self.epoch, session, step_id, entries, infos), frames, step)
                sent += 1
            for rows, index, hidden in later:
                rows[index] = hidden.to("cpu")
        return sent

    def _tally(self, key: str) -> None:
        self.stats.extra[key] = self.stats.extra.get(key, 0) + 1

    def collect(self, request_ids: list[str]) -> dict[str, DraftTree | None | object]:
        """Waits until every asked tree is filed or its ask is --drafter-timeout-ms old."""
        with self._cond:
            def awaited(request_id: str) -> Step | None:  # its tree is due from a drafter worth waiting for
                step = self._pending.get(self._step_of.get(request_id))
                return step if step is not None and not step.drafter.unresponsive else None

            sent = [step.sent_at for step in map(awaited, request_ids) if step is not None]
            deadline = max(sent, default=time.monotonic()) + self.timeout
            self._wait_while(lambda: any(awaited(r) is not None for r in request_ids), deadline)
            trees = {}
            for request_id in request_ids:
                if request_id in self._results:
                    trees[request_id] = self._results.pop(request_id)
                    continue
                step_id = self._step_of.pop(request_id, None)
                step = self._pending.get(step_id)
                if step is None:
                    trees[request_id] = None  # not asked
                    continue
                trees[request_id] = DRAFT_FAULT  # the deadline passed (or its drafter is unresponsive)
                self._count_drop(step.drafter.name, "timeout")
                if not step.drafter.unresponsive:
                    step.drafter.missed_at = time.monotonic()
                del step.budgets[request_id]
                if not step.budgets:
                    del self._pending[step_id]
                    self._expired.append(step_id)
            for tree in trees.values():
                self.stats.trees += isinstance(tree, DraftTree)
                self.stats.empty += tree is None
                self.stats.faults += tree is DRAFT_FAULT
            return trees

    def release(self, request_id: str) -> None:
        with self._cond:
            drafter = self._pins.pop(request_id, None)
            self._history.pop(request_id, None)
            self._grammars.pop(request_id, None)
            self._hidden_history.pop(request_id, None)
            self._results.pop(request_id, None)
            self._forget_ask(request_id, self._step_of.pop(request_id, None))
            self._forget_bets(request_id)
            if drafter is not None and drafter.alive:
                drafter.pinned.discard(request_id)
                self._gauge_pinned(drafter)
                self._send(drafter, convert.release(self.epoch, drafter.session, [request_id]))

    def _forget_ask(self, request_id: str, step_id: int | None) -> None:
        step = self._pending.get(step_id)
        if step is not None:
            step.budgets.pop(request_id, None)
            if not step.budgets:
                del self._pending[step_id]
                self._expired.append(step_id)

    def accepted(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        drafter = self._pins.get(request_id)
        if self.metrics is not None and drafter is not None:
            self.metrics.draft_tokens.labels(drafter=drafter.name).inc(num_drafts)
            self.metrics.accepted_tokens.labels(drafter=drafter.name).inc(num_accepted)

    def close(self) -> None:
        """Stop the I/O thread and close the sockets (drafters notice by silence and register again)."""
        self._stopping = True
        self._wake()
        self._thread.join(timeout=5)
        self._handshakes.close()
        for socket in (self._router, self._wake_in, self._wake_out):
            socket.close(linger=0)
        if self._authorizer is not None:
            self._authorizer.stop()
        if self._context is not None:
            self._context.destroy(linger=0)

    # pinning (under self._cond) ------------------------------------------------------------------------
    # the I/O thread ----------------------------------------------------------------------------------
    def _send(self, drafter: Drafter, message, frames=(), step: Step | None = None) -> None:
        data = message.SerializeToString()
        self._outbox.put((drafter.identity, data, list(frames), step))
        if self.metrics is not None:
            self.metrics.bytes.labels(drafter=drafter.name, direction="sent").inc(len(data) + frame_bytes(list(frames)))
        self._wake()

    def _send_raw(self, identity: bytes, message) -> None:
        self._outbox.put((identity, message.SerializeToString(), [], None))

    def _wake(self) -> None:
        """Wake the I/O thread to send what is queued (from other threads; it drains the outbox itself)."""
        if threading.current_thread() is self._thread:
            return
        with self._wake_lock:
            if self._wake_pending:
                return
            self._wake_pending = True
            try:
                self._wake_out.send(b"", self.zmq.NOBLOCK)
            except self.zmq.Again:  # a wake-up is already queued
                pass

    def _io_loop(self) -> None:
        zmq = self.zmq
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_in, zmq.POLLIN)
        poller.register(self._handshakes.socket, zmq.POLLIN)
        while not self._stopping:
            try:
                events = dict(poller.poll(timeout=50))
                if self._wake_in in events:
                    with self._wake_lock:
                        self._wake_pending = False
                        while self._wake_in.poll(0):
                            self._wake_in.recv()
                self._flush()
                if self._router in events:
                    for _ in range(1000):
                        try:
                            frames = self._router.recv_multipart(copy=False, flags=zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._receive(frames)
                    self._flush()
                if self._handshakes.socket in events:
                    self._count_handshake_failures()
                self._check_heartbeats()
            except Exception:  # the pool must outlive anything a drafter or a bug throws at it
                logger.exception("drafter pool I/O loop error; continuing")

    def _flush(self) -> None:
        zmq = self.zmq
        while True:
            try:
                identity, data, frames, step = self._outbox.get_nowait()
            except queue.Empty:
                self._flushed.set()
                return
            if step is not None:
                step.flushed_ns = time.time_ns()
            try:
                self._router.send_multipart([identity, data, *frames], copy=False, flags=zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # unreachable or backed up: what it missed cannot be replayed
                with self._cond:
                    drafter = next((d for d in self._drafters.values() if d.identity == identity), None)
                    if drafter is not None:
                        self._declare_dead(drafter, f"a message could not be delivered ({exc.strerror})")

    def _drop(self, name: str, reason: str, detail: str) -> None:
        logger.warning("dropped a message from drafter %s: %s (%s)", name, reason, detail)
        self._count_drop(name, reason)

    def _count_drop(self, name: str, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.dropped.labels(drafter=name, reason=reason).inc()

    def _receive(self, frames) -> None:
        if len(frames) < 2:
            self._drop("unknown", "malformed", "no envelope frame")
            return
        identity = frames[0].bytes
        try:
            message = convert.parse_drafter(frames[1].bytes)
        except convert.WireError as exc:
            self._drop("unknown", "malformed", str(exc))
            return
        kind = message.WhichOneof("kind")
        with self._cond:
            if kind == "register":
                self._register(identity, message, self._peer_host(frames[1]))
                return
            drafter = self._drafters.get(message.sender.session)
            if drafter is None or drafter.identity != identity or drafter.instance_epoch != message.sender.instance_epoch:
                if kind == "heartbeat":  # an old session (we declared it dead, or we restarted): start over
                    self._send_raw(identity, convert.heartbeat_reply(self.epoch, message.sender.session, known=False))
                else:
                    self._drop(message.sender.name or "unknown", "stale", f"{kind} from an unknown session {message.sender.session}")
                return
            drafter.last_seen = time.monotonic()
            if self.metrics is not None:
                self.metrics.bytes.labels(drafter=drafter.name, direction="received").inc(frame_bytes(list(frames[1:])))
            if kind == "heartbeat":
                if self.metrics is not None:
                    self.metrics.heartbeats.labels(drafter=drafter.name).inc()
                if drafter.ipc is not None:
                    drafter.ipc.acknowledge(message.heartbeat.buffer_consumed)
                    ready = message.heartbeat.cuda_ipc_ready
                    if ready != drafter.ipc_ready:
                        drafter.ipc_ready = ready
                        self._ipc_worked[drafter.name] = self._ipc_worked.get(drafter.name, False) or ready
                        if ready:
                            logger.info("drafter %s mapped its CUDA-IPC buffer (%d MiB): hidden states go through it",
                                        drafter.name, drafter.ipc.size >> 20)
                        else:
                            logger.warning("drafter %s can no longer read its CUDA-IPC buffer: hidden states go in frames",
                                           drafter.name)
                        if self.metrics is not None:
                            self.metrics.cuda_ipc.labels(drafter=drafter.name).set(int(ready))
                self._send(drafter, convert.heartbeat_reply(self.epoch, drafter.session, known=True))
            elif kind == "draft_reply":
                self._file_reply(drafter, message.draft_reply)
            elif kind == "draft_bets":
                self._file_bets(drafter, message.draft_bets)
            else:
                self._drop(drafter.name, "malformed", f"unexpected message kind {kind!r}")
