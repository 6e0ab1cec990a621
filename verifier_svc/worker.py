"""The engine's thread: it owns the Engine, takes submissions and aborts from a queue, steps while
there is work, and hands each step's deltas to the streams that asked for them: all of a step's deltas in
one hand-off (`publish`), so the engine thread pays one call per step, not one per request (the server's
publish crosses to the event loop once; the protobuf and the streams' writes happen there).

With overlap (on a GPU), a step's metrics and deltas are published while the next step's forward runs on
the device (the engine calls back right after queueing it), not between the two steps, so that host work is
hidden under the GPU's; they are published at once when no step follows (idle, or a step without a forward),
and before any abort or failure is delivered, so a stream's deltas keep their order.

Submissions join the engine's waiting queue at once; the engine admits them as pages allow and
preempts when the pool runs dry, so a request only has to fit alone (the server checks that).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from splitspec.device_profile import served_selector
from splitspec.host_profile import HostProfile
from splitspec.step_log import StepLog
from splitspec.sync_debug import SyncCounter
from splitspec.verifier_svc.engine import Engine
from splitspec.verifier_svc.stats_log import StatsLog
from splitspec.verifier_svc.step_watchdog import STALL_SECONDS, StepWatchdog
from splitspec.verifier_svc.step_types import Request, StepEvent

logger = logging.getLogger(__name__)


@dataclass
class Submission:
    client_id: str
    prompt_ids: list[int]
    params: object  # SamplingParams
    speculate: bool
    deliver: Callable[[Request, StepEvent], None] | None = None  # the default publish calls it with each delta
    request: Request | None = None
    stream: object = None  # the server's: which Generate stream the deltas go to
    first: bool = True  # no delta sent yet (the first carries the prompt's counts and the seed)
    received: float = 0.0  # perf_counter() when it reached the worker
    # (verify steps, fallbacks) as the last delta with counts had them: a delta carries the request's speculation counts
    # on its first and last and whenever they moved since (step_columns.write)
    counts_sent: tuple[int, int] | None = None
    preemptions_sent: int = 0  # the request's preemption count as the last delta that carried one had it
    interval: int = 1  # tokens per delta (--stream-interval, or the submission's own): see due()
    held: list[int] = field(default_factory=list)  # tokens not yet in a delta (interval above 1)
    held_logprobs: list = field(default_factory=list)  # their logprobs, when the request asked for them

    def due(self, event: StepEvent) -> tuple[list[int], list | None] | None:
        """The tokens (and their logprobs) this step's delta carries, with those held before, or None while they are
        held: with an interval above 1 a delta goes once that many tokens have gathered, and the first and the last
        (a finish, an error) at once. A held step costs the publisher a list extend, not a delta."""
        if not self.held and (self.interval <= 1 or self.first or event.finish_reason is not None):
            return event.new_token_ids, event.logprobs
        self.held += event.new_token_ids
        if event.logprobs:
            self.held_logprobs += event.logprobs
        if len(self.held) < self.interval and event.finish_reason is None:
            return None
        tokens, logprobs, self.held, self.held_logprobs = self.held, self.held_logprobs or None, [], []
        return tokens, logprobs


Delivery = tuple[Submission, StepEvent]


def deliver_each(deliveries: list[Delivery]) -> None:
    """The default publish: each submission's own deliver (in-process users and tests)."""
    for submission, event in deliveries:
        submission.deliver(submission.request, event)


_STOP = object()  # EngineWorker.stop's wake-up in the inbox


@dataclass
class _Abort:
    submission: Submission
    done: threading.Event = field(default_factory=threading.Event)
    found: bool = False


def pin_engine_thread() -> None:
    """SPLITSPEC_ENGINE_CPUS=0,8 (a cpulist, as taskset takes it): the calling thread (the engine's) runs on
    those CPUs only; an experiment's knob, for whether the engine thread loses time to processes sharing its core."""
    spec = os.environ.get("SPLITSPEC_ENGINE_CPUS", "").strip()
    if not spec:
        return
    cpus = set()
    for part in spec.split(","):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    os.sched_setaffinity(0, cpus)  # pid 0: this thread alone
    logger.info("engine thread %d pinned to CPUs %s", threading.get_native_id(), sorted(cpus))


class EngineWorker(threading.Thread):
    def __init__(self, engine: Engine, metrics=None, publish: Callable[[list[Delivery]], None] = deliver_each,
                 overlap: bool = False, stall_seconds: float = STALL_SECONDS, stats: StatsLog | None = None,
                 watchdog_timeout: float = 0.0):
        """stall_seconds: a step running longer has the engine thread's stack logged (StepWatchdog); watchdog_timeout:
        one running longer ends the process (0: never); stats: the log's prefill and decode lines
        (--decode-log-interval)."""
        super().__init__(name="engine", daemon=True)
        self.engine, self.metrics, self.publish, self.stats = engine, metrics, publish, stats
        self.inbox: queue.Queue = queue.Queue()
        self.live: dict[str, Submission] = {}  # engine request id -> submission
        self.overlap = overlap
        self._pending: tuple[object, list[Delivery]] | None = None  # the last step's (report, deliveries), unpublished
        self._flushed = {"metrics": 0.0, "publish": 0.0}  # seconds spent publishing since the loop last looked
        self.step_began: float | None = None  # perf_counter() at the running step's start, None between steps
        self.watchdog = StepWatchdog(self, stall_seconds, exit_after_s=watchdog_timeout)
        self._stopping, self._stopped, self._intake = False, False, threading.Lock()  # stop(): the loop's end
        self.step_log = StepLog.from_env("verifier")  # SPLITSPEC_STEP_LOG
        if overlap:
            engine.while_forward = self._flush

    def submit(self, submission: Submission) -> None:
        submission.received = time.perf_counter()
        self.inbox.put(submission)

    def abort_later(self, submission: Submission) -> None:
        """Abort without waiting: the request's last delta (abort) is published when the engine takes it."""
        self.inbox.put(_Abort(submission))

    def abort(self, submission: Submission, timeout: float = 30.0) -> bool:
        command = _Abort(submission)
        with self._intake:
            if self._stopped:  # nobody takes it: the process is ending
                return False
            self.inbox.put(command)
        command.done.wait(timeout)
        return command.found

    def stop(self, timeout: float = 10.0) -> None:
        """End the loop between two steps (the running one completes; live requests are not ended: the process is
        going) and wait for it. A process that exits while this thread runs torch work dies in libtorch's teardown
        (SIGABRT, "terminate called without an active exception"), not with its exit code."""
        self._stopping = True
        self.inbox.put(_STOP)
        if self.is_alive():
            self.join(timeout)

    def _stop_intake(self) -> None:
        """The loop's end: aborts queued or to come are answered at once (not found)."""
        with self._intake:
            self._stopped = True
            while True:
                try:
                    item = self.inbox.get_nowait()
                except queue.Empty:
                    return
                if isinstance(item, _Abort):
                    item.done.set()

    def run(self) -> None:
        clock = time.perf_counter
        profile = HostProfile("verifier")  # SPLITSPEC_PROFILE_HOST
        profile.start()
        device_profile = served_selector()  # SPLITSPEC_TORCH_PROFILE with SPLITSPEC_TORCH_PROFILE_SERVED
        pin_engine_thread()
        syncs = SyncCounter.from_env("served", report_every=256)  # SPLITSPEC_SYNC_DEBUG: a line every 256 decode steps
        if syncs is not None:
            syncs.start()
        self.watchdog.start()
        try:
            self._loop(clock, profile, device_profile, syncs)
        finally:
            self._stop_intake()

    def _loop(self, clock, profile, device_profile, syncs) -> None:
        while not self._stopping:
            busy = self.engine.has_work
            profile.tick(idle=not busy)
            start = clock()
            self._drain(block=not busy)
            if self.engine.has_work and not self._stopping:
                stepped = clock()
                self._take_flushed()  # an abort's flush during intake is intake's
                self.step_began = stepped
                if self.step_log is not None:
                    self.step_log.begin()
                try:
                    events = self.engine.step()  # with overlap, the last step's deltas went out during its forward
                except Exception as exc:  # never hang the streams: end every live request with the error
                    logger.exception("engine step failed; ending the %d running requests", len(self.live))
                    self._fail_all(f"INTERNAL: the engine step failed: {exc}")
                    continue
                finally:
                    self.step_began = None
                hidden = sum(self._take_flushed().values())
                observed = clock()
                if syncs is not None and self.engine.report.generated_tokens and not self.engine.report.prefill_tokens:
                    syncs.step()
                if self.step_log is not None:
                    self.step_log.step(stepped, observed, self.engine.report, len(self.engine.running),
                                       len(self.engine.waiting))
                self._flush()  # the last step's, if this step ran no forward to hide it under
                self._pending = (self.engine.report, self._deliveries(events))
                # the overlap schedule's step in flight hides it now; else the next step's forward will
                if not (self.overlap and self.engine.has_work) or self.engine.in_flight is not None \
                        or self.engine.fed is not None:
                    self._flush()
                if self.metrics is not None:
                    self.metrics.observe_loop({"intake": stepped - start if busy else 0.0, "step": observed - stepped - hidden,
                                               **self._take_flushed(), "hidden": hidden})
                if device_profile is not None and device_profile[1](self.engine.report):  # outside the loop's timings
                    device_profile[0].step()

    def _take_flushed(self) -> dict[str, float]:
        """Seconds spent publishing (metrics, publish) since the last call."""
        flushed, self._flushed = self._flushed, {"metrics": 0.0, "publish": 0.0}
        return flushed

    def _flush(self) -> None:
        """Publish the last step: its metrics first (a client never sees newer tokens than the metrics), then
        its deltas in one hand-off."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        report, deliveries = pending
        began = time.perf_counter()
        if self.metrics is not None:
            self.metrics.observe(self.engine, report)
        if self.stats is not None:
            self.stats.observe(self.engine, report)
        observed = time.perf_counter()
        if deliveries:
            if self.step_log is not None:
                self.step_log.published(observed, len(deliveries), sum(1 for s, e in deliveries if s.first and e.new_token_ids),
                                        sum(1 for _, e in deliveries if e.finish_reason is not None))
            self.publish(deliveries)  # a served publish also clears each submission's first
        self._flushed["metrics"] += observed - began
        self._flushed["publish"] += time.perf_counter() - observed

    def _drain(self, block: bool) -> None:
        if not block and not self.inbox.queue:  # nothing came (most steps): no lock taken, no Empty raised (~2 us)
            return
        try:
            item = self.inbox.get(block=block)
            while True:
                self._handle(item)
                item = self.inbox.get_nowait()
        except queue.Empty:
            return

    def _handle(self, item) -> None:
        if item is _STOP:
            return
        if isinstance(item, Submission):
            if self.step_log is not None:
                self.step_log.arrived(item.received, time.perf_counter())
            item.request = self.engine.add_request(item.prompt_ids, item.params, item.speculate)
            self.live[item.request.request_id] = item
            return
        self._flush()  # the last step's deltas go out before this abort's
        submission = item.submission
        if submission.request is not None and self.engine.abort(submission.request):
            item.found = True
            self._finish(submission)
            self.publish([(submission, StepEvent(submission.request.request_id, [], "abort"))])
        if item.found and self.metrics is not None:
            self.metrics.count_finished("abort")
            self.metrics.observe_state(self.engine)
        item.done.set()

    def _fail_all(self, message: str) -> None:
        self._flush()
        deliveries = []
        for submission in list(self.live.values()):
            self.engine.abort(submission.request)
            submission.request.finish_reason = "error"
            self._finish(submission)
            deliveries.append((submission, StepEvent(submission.request.request_id, [], "error", message)))
        if deliveries:
            self.publish(deliveries)

    def _deliveries(self, events: list[StepEvent]) -> list[Delivery]:
        """Each event with its submission, in order; a finished request leaves the live set (before anyone hears it
        finished). A request may have two events in one step (the step in flight landed, then the step's own
        forward's tokens and perhaps its end): both go out."""
        deliveries = []
        for event in events:
            submission = self.live.get(event.request_id)
            if submission is None:
                continue
            if event.finish_reason is not None:
                self._finish(submission)
            deliveries.append((submission, event))
        return deliveries

    def _finish(self, submission: Submission) -> None:
        self.live.pop(submission.request.request_id, None)
