"""A step that runs far longer than steps do (a kernel compiling on its first use, a device that hangs, a lock)
leaves the engine silent: every stream waits and the front reports the engine wedged, without saying why. The
watchdog looks at the engine thread every few seconds and, once per such step, logs where it is: its Python stack
(e.g. FlashInfer's JIT build, a CUDA synchronize, a drafter's wait)."""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback

logger = logging.getLogger("splitspec.verifier")

STALL_SECONDS = 20.0


class StepWatchdog(threading.Thread):
    """Watches a worker whose `step_began` is the perf_counter() time its current step began (None between
    steps) and whose `ident` is its thread's."""

    def __init__(self, worker, threshold_s: float = STALL_SECONDS, interval_s: float | None = None):
        super().__init__(name="engine-watchdog", daemon=True)
        self.worker, self.threshold = worker, threshold_s
        self.interval = interval_s if interval_s is not None else max(threshold_s / 4, 0.05)
        self.stopped = threading.Event()
        self.reports = 0

    def run(self) -> None:
        reported = None
        while not self.stopped.wait(self.interval):
            began = self.worker.step_began
            if began is None or began == reported:
                continue
            elapsed = time.perf_counter() - began
            if elapsed < self.threshold:
                continue
            frame = sys._current_frames().get(self.worker.ident)
            stack = "".join(traceback.format_stack(frame)[-16:]) if frame is not None else "(the thread is gone)\n"
            logger.warning("an engine step has run for %.0f s (every stream waits for it); the engine thread is at:\n%s",
                           elapsed, stack.rstrip())
            reported = began
            self.reports += 1

    def stop(self) -> None:
        self.stopped.set()
