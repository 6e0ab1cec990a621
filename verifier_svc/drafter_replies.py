"""Filing the drafters' replies (a mixin of DrafterPool, on its I/O thread, under its lock): each tree checked
against what its step asked (an invalid one is dropped and counted: that request decodes a plain token),
filed for the engine thread's collect; a lost request re-opened; where the round trip's time went."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from splitspec.runtime.tree import DraftTree
from splitspec.verifier_svc import convert
from splitspec.verifier_svc.drafter_client import DRAFT_FAULT
from splitspec.verifier_svc.drafter_membership import Drafter, logger


@dataclass
class Step:
    """One DraftRequest in flight: its drafter, the budget of each request it asked, when it was sent."""

    drafter: Drafter
    budgets: dict[str, int]  # request id -> max nodes
    sent_at: float
    queued_ns: int = 0  # wall clock: queued for the I/O thread, and on the wire (transport timing, one host)
    flushed_ns: int = 0


class DraftReplies:
    """Replies filed and timed; the state is DrafterPool's (its __init__)."""

    def _file_reply(self, drafter: Drafter, reply) -> None:
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

    def _time_transport(self, kind: str, step: Step | None, message) -> None:
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

    def _wait_while(self, pending, deadline: float) -> None:
        """Under the lock: wait for filings while pending() holds, until the monotonic deadline; a wait's wake-up
        is timed (_time_wake)."""
        waited = False
        while pending():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self._cond.wait(remaining)
            waited = True
        if waited:
            self._time_wake()

    def _time_wake(self) -> None:
        """After waiting for a filing: how long the engine thread took to wake after the I/O thread filed."""
        if self._filed_ns:
            self._tally("transport_wakes")
            extra = self.stats.extra
            extra["transport_wake_seconds"] = extra.get("transport_wake_seconds", 0.0) + (time.time_ns() - self._filed_ns) / 1e9
