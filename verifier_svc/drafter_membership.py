"""The drafter pool's membership (a mixin of DrafterPool, under its lock): drafters register (a session each,
the overlap and the CUDA-IPC buffer they get), heartbeat, are declared dead when they stop (their steps
fault, their requests re-pin on the next ask), and requests are pinned to the least-loaded live drafter."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from splitspec.runtime.tensor_plane import CudaIpcPlane
from splitspec.verifier_svc import convert
from splitspec.verifier_svc.drafter_client import DRAFT_FAULT

logger = logging.getLogger("splitspec.verifier_svc.drafter_pool")


@dataclass
class Drafter:
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


class DrafterMembership:
    """Registration, heartbeats, death and pinning; the state is DrafterPool's (its __init__)."""

    def _pin(self, request_id: str, repin: bool) -> Drafter | None:
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
        grammar, prompt_tokens = self._grammars.get(request_id, (None, 0))
        self._send(drafter, convert.open_request(self.epoch, drafter.session, request_id, self._history[request_id], infos,
                                                 grammar, prompt_tokens), frames)
        return drafter

    def _plane(self, drafter: Drafter):
        return drafter.ipc if drafter.ipc is not None and drafter.ipc_ready else self.plane

    def _offer_ipc(self, drafter: Drafter, register) -> dict | None:
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

    def _declare_dead(self, drafter: Drafter, why: str) -> None:
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
        drafter = Drafter(identity, sender.name, sender.instance_epoch, next(self._sessions), register.capacity,
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

    def _gauge_pinned(self, drafter: Drafter) -> None:
        if self.metrics is not None:
            self.metrics.pinned.labels(drafter=drafter.name).set(len(drafter.pinned))
