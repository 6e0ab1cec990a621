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
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field

from splitspec.protos.step_limits import verifier_receive_limit
from splitspec.runtime.curve import Authorizer, HandshakeMonitor, ServerKeys, Throttle, make_server
from splitspec.runtime.tensor_plane import CudaIpcPlane, FramePlane, frame_bytes
from splitspec.runtime.tree import DraftTree
from splitspec.verifier_svc import convert
from splitspec.verifier_svc.drafter_client import DRAFT_FAULT, DraftAsk, DrafterClient

logger = logging.getLogger(__name__)


@dataclass
class _Drafter:
    identity: bytes
    name: str
    instance_epoch: int
    session: int
    capacity: int
    max_nodes: int
    last_seen: float
    metrics_target: str | None = None  # host:port of its Prometheus endpoint, when it serves one
    algorithm: str = ""
    device: str = ""  # "cuda:<GPU UUID>" or "cpu" (Register.device)
    overlap: bool = False  # ask it for bets (its drafting overlaps verification)
    ipc: CudaIpcPlane | None = None  # the CUDA-IPC buffer offered to it (it shares this host and sees our GPU)
    ipc_ready: bool = False  # it mapped the buffer: tensors go through it
    alive: bool = True
    pinned: set[str] = field(default_factory=set)
    missed_at: float = 0.0  # when it last let a deadline pass

    @property
    def load(self) -> float:
        return len(self.pinned) / self.capacity

    @property
    def unresponsive(self) -> bool:
        """It let a deadline pass and nothing came from it since (not even a heartbeat): steps do not wait
        for it (its requests decode plain tokens) until it is heard from, or declared dead and its requests
        move. A drafter cut off behind a silent network costs one deadline, not one per step."""
        return self.missed_at > self.last_seen


@dataclass
class _Step:
    drafter: _Drafter
    budgets: dict[str, int]  # request id -> max nodes
    sent_at: float
    queued_ns: int = 0  # wall clock: queued for the I/O thread, and on the wire (transport timing, one host)
    flushed_ns: int = 0


OVERLAP_MODES = ("auto", "on", "off")


class DrafterPool(DrafterClient):
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
        self._bet_waits: dict[int, tuple[_Drafter, dict[str, int], set[str]]] = {}
        self.metrics = metrics
        self.epoch = secrets.randbits(63) or 1
        self.plane = FramePlane()
        self.tensor_device, self.ipc_buffer_bytes = tensor_device, ipc_buffer_bytes
        self._ipc_planes: dict[str, CudaIpcPlane] = {}  # drafter name -> its CUDA-IPC buffer
        self._ipc_worked: dict[str, bool] = {}  # drafter name -> some session of it mapped the buffer
        self.curve = curve
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
        self._wake_lock = threading.Lock()
        self._wake_pending = False  # one queued wake-up is enough
        self._flushed = threading.Event()  # set by the I/O thread whenever it has sent everything queued
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._filed_ns = 0  # wall clock of the last filed reply or bets (transport timing)
        self._cond = threading.Condition()
        self._drafters: dict[int, _Drafter] = {}  # session -> live drafter
        self._sessions = itertools.count(1)
        self._step_ids = itertools.count(1)
        self._pins: dict[str, _Drafter | None] = {}
        self._history: dict[str, list[int]] = {}
        self._pending: dict[int, _Step] = {}
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

    def open(self, request_id: str, prompt_ids: list[int]) -> None:
        with self._cond:
            self._history[request_id] = list(prompt_ids)
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
        groups: dict[int, tuple[_Drafter, list]] = {}
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
                step = self._pending[step_id] = _Step(drafter, {a.request_id: a.max_nodes for a in group}, now, time.time_ns())
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

    def _match_bet(self, drafter: _Drafter, ask: DraftAsk) -> int:
        """Overlap (under self._cond): wait for the bets on the request's last tree (drafted while it was
        verified), and file the one whose outcome came true as its next tree; its index + 1, or 0."""
        request_id = ask.request_id
        step_id = self._bet_step.get(request_id)
        if step_id is None:
            return 0
        step = self._pending.get(step_id)
        deadline = (step.sent_at if step is not None else time.monotonic()) + (0 if drafter.unresponsive else self.timeout)
        waited = False
        while request_id in self._bet_waits.get(step_id, (None, {}, ()))[1]:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self._cond.wait(remaining)
            waited = True
        if waited:
            self._time_wake()
        self._bet_step.pop(request_id, None)
        bets = self._bets.pop(request_id, None)
        if bets is None:  # late (or its drafter died): draft afresh; bets that come later are dropped
            self._bet_waits.get(step_id, (None, {}, ()))[1].pop(request_id, None)
            self._tally("bets_late")
            self._count_bet(drafter, "late")
            return 0
        outcome = tuple(ask.new_tokens)
        for index, (bet_outcome, tree) in enumerate(bets):
            if bet_outcome == outcome:
                self._results[request_id] = tree.first(ask.max_nodes)
                self._tally("bet_hits")
                self._count_bet(drafter, "hit")
                return index + 1
        self._tally("bet_misses")
        self._count_bet(drafter, "miss")
        return 0

    def _forget_bets(self, request_id: str) -> None:
        step_id = self._bet_step.pop(request_id, None)
        self._bets.pop(request_id, None)
        if step_id is not None:
            self._bet_waits.get(step_id, (None, {}, ()))[1].pop(request_id, None)

    def _tally(self, key: str) -> None:
        self.stats.extra[key] = self.stats.extra.get(key, 0) + 1

    def _count_bet(self, drafter: _Drafter, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.bets.labels(drafter=drafter.name, outcome=outcome).inc()

    def collect(self, request_ids: list[str]) -> dict[str, DraftTree | None | object]:
        """Waits until every asked tree is filed or its ask is --drafter-timeout-ms old."""
        with self._cond:
            def awaited(request_id: str) -> _Step | None:  # its tree is due from a drafter worth waiting for
                step = self._pending.get(self._step_of.get(request_id))
                return step if step is not None and not step.drafter.unresponsive else None

            sent = [step.sent_at for step in map(awaited, request_ids) if step is not None]
            deadline = max(sent, default=time.monotonic()) + self.timeout
            waited = False
            while any(awaited(r) is not None for r in request_ids):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
                waited = True
            if waited:
                self._time_wake()
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
    def _pin(self, request_id: str, repin: bool) -> _Drafter | None:
        live = [d for d in self._drafters.values() if len(d.pinned) < d.capacity]
        if not live:
            self._pins[request_id] = None
            return None
        drafter = min(live, key=lambda d: (d.load, len(d.pinned), d.name))
        self._pins[request_id] = drafter
        drafter.pinned.add(request_id)
        self._gauge_pinned(drafter)
        if repin and self.metrics is not None:
            self.metrics.repins.inc()
        if repin:
            logger.info("re-pinned %s to drafter %s", request_id, drafter.name)
        tensors = []
        if self.needs_hidden_states and self._hidden_history.get(request_id):
            import torch

            tensors = [("hidden_states", request_id, torch.cat(self._hidden_history[request_id]))]
        infos, frames = self._plane(drafter).pack(tensors)
        self._send(drafter, convert.open_request(self.epoch, drafter.session, request_id, self._history[request_id], infos),
                   frames)
        return drafter

    def _plane(self, drafter: _Drafter):
        return drafter.ipc if drafter.ipc is not None and drafter.ipc_ready else self.plane

    def _offer_ipc(self, drafter: _Drafter, register) -> dict | None:
        """A CUDA-IPC buffer for a drafter that sees this verifier's GPU (so shares its host); None otherwise
        or when it cannot be made (logged: frames still work)."""
        device = self.tensor_device
        if not self.ipc_buffer_bytes or device is None or str(device).split(":")[0] != "cuda" \
                or self.device not in register.visible_gpus:
            return None
        if self._ipc_worked.get(drafter.name) is False and drafter.name in self._ipc_planes:
            return None  # a process of this name was offered one and never mapped it: frames
        try:
            # one buffer per drafter name, reused by its next sessions: a process killed while it maps the buffer
            # never releases torch's count of its mappings, so a buffer dropped then would never be freed
            plane = self._ipc_planes.get(drafter.name)
            if plane is None:
                plane = self._ipc_planes[drafter.name] = CudaIpcPlane(device, self.ipc_buffer_bytes)
            plane.reset()
            drafter.ipc = plane
            self._ipc_worked.setdefault(drafter.name, False)
            return plane.export()
        except Exception:  # noqa: BLE001 (no memory, IPC unsupported): frames
            logger.exception("could not offer drafter %s a CUDA-IPC buffer; its tensors go in frames", drafter.name)
            drafter.ipc = None
            return None

    def _declare_dead(self, drafter: _Drafter, why: str) -> None:
        if not drafter.alive:
            return
        logger.warning("drafter %s is gone (%s); its %d requests move to other drafters", drafter.name, why,
                       len(drafter.pinned))
        drafter.alive = False
        self._drafters.pop(drafter.session, None)
        drafter.pinned.clear()
        self._gauge_pinned(drafter)
        for step_id, step in list(self._pending.items()):
            if step.drafter is drafter:
                for request_id in step.budgets:
                    if self._step_of.get(request_id) == step_id:
                        self._results[request_id] = DRAFT_FAULT
                        self._count_drop(drafter.name, "drafter_gone")
                del self._pending[step_id]
                self._expired.append(step_id)
        for step_id, (owner, _, _) in list(self._bet_waits.items()):
            if owner is drafter:
                del self._bet_waits[step_id]
        if drafter.ipc is not None:  # its next session gets the buffer again, emptied
            drafter.ipc, drafter.ipc_ready = None, False
            if self.metrics is not None:
                self.metrics.cuda_ipc.labels(drafter=drafter.name).set(0)
        if self.metrics is not None:
            self.metrics.alive.set(len(self._drafters))
        self._cond.notify_all()

    # the I/O thread ----------------------------------------------------------------------------------
    def _send(self, drafter: _Drafter, message, frames=(), step: _Step | None = None) -> None:
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

    def _count_handshake_failures(self) -> None:
        """Connections refused in the ZeroMQ handshake (they never registered): counted by reason, logged
        (at most once per reason every 10 s)."""
        refused_keys = self._authorizer.refused if self._authorizer is not None else None
        for failure in self._handshakes.read():
            self.handshake_failures[failure.reason] += 1
            if self.metrics is not None:
                self.metrics.handshake_failures.labels(reason=failure.reason).inc()
            key = refused_keys.popleft() if failure.reason == "unauthorized" and refused_keys else None
            held = self._handshake_log.allow(failure.reason, time.monotonic())
            if held is not None:
                logger.warning("a connection to the step channel failed its handshake (%s): %s%s%s", failure.reason,
                               failure.detail, f" (its key: {key.decode()})" if key else "",
                               f"; {held} more since the last report" if held else "")

    def _check_heartbeats(self) -> None:
        now = time.monotonic()
        with self._cond:
            for drafter in list(self._drafters.values()):
                if now - drafter.last_seen > self.heartbeat_timeout:
                    self._declare_dead(drafter, f"no heartbeat for {now - drafter.last_seen:.1f} s")

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

    def _peer_host(self, frame) -> str:
        """The address a message came from (its TCP peer); 127.0.0.1 for ipc/inproc peers (this host)."""
        if not self.address.startswith("tcp://"):
            return "127.0.0.1"
        try:
            return frame.get("Peer-Address")
        except Exception:  # noqa: BLE001 (libzmq without message metadata)
            return ""

    def _register(self, identity: bytes, message, peer_host: str = "") -> None:
        register, sender = message.register, message.sender
        problem = None
        if register.algorithm != self.algorithm:
            problem = f"this verifier speculates with {self.algorithm}, the drafter runs {register.algorithm or 'nothing'}"
        elif self.draft_model is not None and register.draft_model != self.draft_model:
            problem = f"this verifier expects draft model {self.draft_model or '(none)'!r}, the drafter has {register.draft_model!r}"
        elif register.vocab_size not in (0, self.vocab_size):
            problem = f"the drafter's vocabulary has {register.vocab_size} tokens, the target's {self.vocab_size}"
        elif tuple(register.hidden_state_layers) != self.hidden_state_layers:
            problem = (f"the drafter needs hidden states {list(register.hidden_state_layers)}, this verifier captures "
                       f"{list(self.hidden_state_layers) or 'none'} (-1 = the final normed state, else layer inputs)")
        elif register.capacity < 1 or not sender.name:
            problem = "a drafter needs a name and a capacity of at least one request"
        if problem is not None:
            logger.error("refused drafter %s: %s", sender.name or "?", problem)
            if self.metrics is not None:
                self.metrics.registrations.labels(outcome="refused").inc()
            self._send_raw(identity, convert.register_reply(self.epoch, 0, False, problem, self.heartbeat_timeout))
            return
        for other in list(self._drafters.values()):
            if other.identity == identity and other.instance_epoch == sender.instance_epoch:
                # a repeated Register (ours crossed its retry): answer with the session it already has
                self._send(other, convert.register_reply(self.epoch, other.session, True, "", self.heartbeat_timeout))
                return
            if other.name == sender.name:  # the same name again: a restarted drafter
                self._declare_dead(other, "it registered again")
        host = register.metrics_host or peer_host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        target = f"{host}:{register.metrics_port}" if register.metrics_port and host else None
        drafter = _Drafter(identity, sender.name, sender.instance_epoch, next(self._sessions), register.capacity,
                           register.max_tree_nodes, time.monotonic(), target, register.algorithm, register.device)
        # a drafter on the verifier's own device (its GPU, by UUID; or this host's CPUs) takes what it bets with
        # from the verification: auto overlaps only with drafters elsewhere
        local = peer_host in ("127.0.0.1", "::1", "localhost") or peer_host.startswith("::ffff:127.")
        shares = register.device == self.device and (register.device.startswith("cuda:") or local)
        wanted = self.overlap == "on" or (self.overlap == "auto" and not shares)
        drafter.overlap = register.bets and self.num_bets > 0 and wanted  # only drafters that bet are asked to
        self._drafters[drafter.session] = drafter
        logger.info("drafter %s joined (%s on %s, capacity %d, session %d%s, overlap %s); %d alive", drafter.name,
                    register.algorithm, register.device or "?", drafter.capacity, drafter.session,
                    f", metrics at {target}" if target else "",
                    f"on, {self.num_bets} bets" if drafter.overlap else "off", len(self._drafters))
        if self.metrics is not None:
            self.metrics.registrations.labels(outcome="accepted").inc()
            self.metrics.alive.set(len(self._drafters))
        self._send(drafter, convert.register_reply(self.epoch, drafter.session, True, "", self.heartbeat_timeout,
                                                   self._offer_ipc(drafter, register)))
        self._cond.notify_all()

    def _file_reply(self, drafter: _Drafter, reply) -> None:
        if drafter.ipc is not None:  # a late reply still acknowledges what the drafter copied out
            drafter.ipc.acknowledge(reply.buffer_consumed)
        step = self._pending.get(reply.step_id)
        if step is None or step.drafter is not drafter:
            late = reply.step_id in self._expired
            self._drop(drafter.name, "late" if late else "stale", f"reply to step {reply.step_id}")
            return
        del self._pending[reply.step_id]
        if self.metrics is not None:
            self.metrics.round_trip.labels(drafter=drafter.name).observe(time.monotonic() - step.sent_at)
            if math.isfinite(reply.draft_seconds) and reply.draft_seconds >= 0:
                self.metrics.draft_seconds.labels(drafter=drafter.name).observe(reply.draft_seconds)
        self._tally("round_trips")
        self.stats.extra["round_trip_seconds"] = self.stats.extra.get("round_trip_seconds", 0.0) + time.monotonic() - step.sent_at
        self._time_transport("reply", step, reply)
        if math.isfinite(reply.draft_seconds) and reply.draft_seconds >= 0:
            self._tally("reply_steps")
            self.stats.extra["reply_seconds"] = self.stats.extra.get("reply_seconds", 0.0) + reply.draft_seconds
        answered = set()
        for wire in reply.trees:
            request_id = wire.request_id
            if request_id not in step.budgets or request_id in answered:
                self._drop(drafter.name, "wrong_request", f"step {reply.step_id} did not ask for {request_id!r}")
                continue
            answered.add(request_id)
            problem = convert.tree_problem(wire, step.budgets[request_id], self.vocab_size)
            if problem is not None:
                self._drop(drafter.name, "invalid_tree", f"{request_id}: {problem}")
                tree = DRAFT_FAULT
            else:
                tree = DraftTree(tuple(wire.tokens), tuple(wire.parents))
            if self._step_of.get(request_id) == reply.step_id:
                self._results[request_id] = tree
        for request_id in reply.unknown_request_ids:  # its open got lost: open it again next ask
            if request_id in step.budgets and self._pins.get(request_id) is drafter:
                logger.warning("drafter %s lost request %s; opening it again", drafter.name, request_id)
                drafter.pinned.discard(request_id)
                self._pins[request_id] = None
                if self._step_of.get(request_id) == reply.step_id:
                    self._results[request_id] = DRAFT_FAULT
                answered.add(request_id)
        for request_id in step.budgets:
            if request_id not in answered and self._step_of.get(request_id) == reply.step_id:
                self._results[request_id] = None  # nothing to propose
        self._cond.notify_all()

    def _time_transport(self, kind: str, step: _Step | None, message) -> None:
        """Where a round trip's time went, by wall clocks (meaningful when the drafter shares this host's
        clock): queued -> on the wire (this pool's I/O thread), -> arrived at the drafter, -> its answer
        left, -> filed here. Sums per kind in stats.extra (transport_<kind>_<leg>_seconds)."""
        now = time.time_ns()
        legs = {"in": (message.sent_unix_ns, now)}
        if step is not None and step.flushed_ns:
            legs.update(queue=(step.queued_ns, step.flushed_ns), out=(step.flushed_ns, message.received_unix_ns),
                        drafter=(message.received_unix_ns, message.sent_unix_ns))
        if not (message.received_unix_ns and message.sent_unix_ns):
            return
        extra = self.stats.extra
        extra[f"transport_{kind}_count"] = extra.get(f"transport_{kind}_count", 0) + 1
        for leg, (begin, end) in legs.items():
            key = f"transport_{kind}_{leg}_seconds"
            extra[key] = extra.get(key, 0.0) + (end - begin) / 1e9
        self._filed_ns = now

    def _time_wake(self) -> None:
        """After waiting for a filing: how long the engine thread took to wake after the I/O thread filed."""
        if self._filed_ns:
            self._tally("transport_wakes")
            extra = self.stats.extra
            extra["transport_wake_seconds"] = extra.get("transport_wake_seconds", 0.0) + (time.time_ns() - self._filed_ns) / 1e9

    def _file_bets(self, drafter: _Drafter, message) -> None:
        """A step's bets (overlap): checked like trees, filed for the requests still waiting for them."""
        due = self._bet_waits.get(message.step_id)
        if due is None or due[0] is not drafter:
            self._drop(drafter.name, "late" if message.step_id in self._expired or due is None else "stale",
                       f"bets for step {message.step_id}")
            return
        del self._bet_waits[message.step_id]
        self._time_transport("bets", None, message)
        if math.isfinite(message.draft_seconds) and message.draft_seconds >= 0:  # the drafter's clock
            self._tally("bet_steps")
            self.stats.extra["bet_seconds"] = self.stats.extra.get("bet_seconds", 0.0) + message.draft_seconds
        budgets = due[1]
        filed: dict[str, list] = {r: [] for r in budgets if self._bet_step.get(r) == message.step_id}
        for wire in message.bets:
            request_id = wire.request_id
            if request_id not in budgets:
                if request_id in due[2]:  # asked, and since finished, re-pinned or given up on (a late bet, counted then)
                    continue
                self._drop(drafter.name, "wrong_request", f"step {message.step_id} did not ask bets for {request_id!r}")
                continue
            outcome = list(wire.outcome)
            # a bet is the next step's tree, whose budget is not known yet (an adaptive budget moves between
            # steps): bounded here by what the drafter registered, cut to that step's budget when it comes true
            problem = convert.tree_problem(wire.tree, max(budgets[request_id], drafter.max_nodes), self.vocab_size)
            if problem is None and (not outcome or len(outcome) > budgets[request_id]
                                    or any(not 0 <= t < self.vocab_size for t in outcome)):
                problem = f"an outcome of {len(outcome)} tokens"
            if problem is None and wire.tree.tokens[0] != outcome[-1]:
                problem = "the bet tree's root is not its outcome's last token"
            if problem is not None:
                self._drop(drafter.name, "invalid_tree", f"bet for {request_id}: {problem}")
                continue
            if request_id in filed:
                filed[request_id].append((tuple(outcome), DraftTree(tuple(wire.tree.tokens), tuple(wire.tree.parents))))
        self._bets.update(filed)
        self._cond.notify_all()

    def _gauge_pinned(self, drafter: _Drafter) -> None:
        if self.metrics is not None:
            self.metrics.pinned.labels(drafter=drafter.name).set(len(drafter.pinned))
