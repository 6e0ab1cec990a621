"""The engine's thread: it owns the Engine, takes submissions and aborts from a queue, steps while
there is work, and hands each step's deltas to the streams that asked for them.

Admission reserves each request's worst case (prompt + max_new_tokens + one draft tree, in pages), so
the engine never runs out of pages mid-step; a request that does not fit waits until others finish.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from splitspec.verifier_svc.engine import Engine, Request, StepEvent

logger = logging.getLogger(__name__)


@dataclass
class Submission:
    client_id: str
    prompt_ids: list[int]
    params: object  # SamplingParams
    speculate: bool
    deliver: Callable[[Request, StepEvent], None]  # called on the worker thread with each delta
    request: Request | None = None
    reserved_pages: int = 0


@dataclass
class _Abort:
    submission: Submission
    done: threading.Event = field(default_factory=threading.Event)
    found: bool = False


class EngineWorker(threading.Thread):
    def __init__(self, engine: Engine, metrics=None):
        super().__init__(name="engine", daemon=True)
        self.engine, self.metrics = engine, metrics
        self.inbox: queue.Queue = queue.Queue()
        self.pending: list[Submission] = []  # accepted, waiting for pages
        self.live: dict[str, Submission] = {}  # engine request id -> submission
        self.finished: dict[str, Submission] = {}  # ended this step, delta not yet delivered
        self.reserved_pages = 0

    def pages_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        kv = self.engine.runner.kv_cache
        return kv.pages_for(prompt_len + max_new_tokens + self.engine.spec.num_draft_tokens)

    def submit(self, submission: Submission) -> None:
        self.inbox.put(submission)

    def abort(self, submission: Submission, timeout: float = 30.0) -> bool:
        command = _Abort(submission)
        self.inbox.put(command)
        command.done.wait(timeout)
        return command.found

    def run(self) -> None:
        while True:
            self._drain(block=not self.engine.has_work and not self._admit_ready())
            self._admit()
            if self.engine.has_work:
                try:
                    events = self.engine.step()
                except Exception as exc:  # never hang the streams: end every live request with the error
                    logger.exception("engine step failed; ending the %d running requests", len(self.live))
                    self._fail_all(f"INTERNAL: the engine step failed: {exc}")
                    continue
                for event in events:
                    self._settle(event)
                if self.metrics is not None:  # before delivery, so a client never sees newer tokens than metrics
                    self.metrics.observe(self.engine, len(self.pending))
                for event in events:
                    self._deliver(event)

    def _admit_ready(self) -> bool:
        return bool(self.pending) and self._fits(self.pending[0])

    def _fits(self, submission: Submission) -> bool:
        return self.reserved_pages + submission.reserved_pages <= self.engine.runner.kv_cache.num_pages

    def _drain(self, block: bool) -> None:
        try:
            item = self.inbox.get(block=block)
            while True:
                self._handle(item)
                item = self.inbox.get_nowait()
        except queue.Empty:
            return

    def _handle(self, item) -> None:
        if isinstance(item, Submission):
            item.reserved_pages = self.pages_needed(len(item.prompt_ids), item.params.max_new_tokens)
            self.pending.append(item)
            return
        submission = item.submission
        if submission in self.pending:
            self.pending.remove(submission)
            item.found = True
            submission.deliver(None, StepEvent(submission.client_id, [], "abort"))
        elif submission.request is not None and self.engine.abort(submission.request):
            item.found = True
            self._finish(submission)
            submission.deliver(submission.request, StepEvent(submission.request.request_id, [], "abort"))
        if item.found and self.metrics is not None:
            self.metrics.finished.labels(**self.metrics.labels, finished_reason="abort").inc()
            self.metrics.observe_state(self.engine, len(self.pending))
        item.done.set()

    def _admit(self) -> None:
        while self.pending and self._fits(self.pending[0]):
            submission = self.pending.pop(0)
            self.reserved_pages += submission.reserved_pages
            submission.request = self.engine.add_request(submission.prompt_ids, submission.params, submission.speculate)
            self.live[submission.request.request_id] = submission

    def _fail_all(self, message: str) -> None:
        for submission in list(self.live.values()):
            self.engine.abort(submission.request)
            submission.request.finish_reason = "error"
            self._finish(submission)
            submission.deliver(submission.request, StepEvent(submission.request.request_id, [], "error", message))

    def _settle(self, event: StepEvent) -> None:
        """Release a finished request's page reservation (before anyone hears it finished)."""
        submission = self.live.get(event.request_id)
        if submission is not None and event.finish_reason is not None:
            self._finish(submission)
            self.finished[event.request_id] = submission

    def _deliver(self, event: StepEvent) -> None:
        submission = self.live.get(event.request_id) or self.finished.pop(event.request_id, None)
        if submission is not None:
            submission.deliver(submission.request, event)

    def _finish(self, submission: Submission) -> None:
        if self.live.pop(submission.request.request_id, None) is not None:
            self.reserved_pages -= submission.reserved_pages
