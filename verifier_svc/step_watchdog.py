"""A step that runs far longer than steps do (a kernel compiling on its first use, a device that hangs, a lock)
leaves the engine silent: every stream waits and the front reports the engine wedged, without saying why. The
watchdog looks at the engine thread every few seconds and, once per such step, logs where it is: its Python stack
(e.g. FlashInfer's JIT build, a CUDA synchronize, a drafter's wait). A step still running after --watchdog-timeout
(SGLang's flag) ends the verifier: its streams end with an error and its deployment (`splitspec up`, compose's
restart policy) starts it again, instead of a server that holds every stream and serves nobody."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback

logger = logging.getLogger("splitspec.verifier")

STALL_SECONDS = 20.0
WATCHDOG_TIMEOUT_SECONDS = 300.0  # SGLang's default
EXIT_CODE = 70  # EX_SOFTWARE: the verifier ended itself because a step hung


class StepWatchdog(threading.Thread):
    """Watches a worker whose `step_began` is the perf_counter() time its current step began (None between
    steps) and whose `ident` is its thread's."""

    def __init__(self, worker, threshold_s: float = STALL_SECONDS, interval_s: float | None = None,
                 exit_after_s: float = 0.0):
        """exit_after_s: a step running this long ends the process (0: never)."""
        super().__init__(name="engine-watchdog", daemon=True)
        self.worker, self.threshold, self.exit_after = worker, threshold_s, exit_after_s
        shortest = min(threshold_s, exit_after_s) if exit_after_s > 0 else threshold_s
        self.interval = interval_s if interval_s is not None else max(shortest / 4, 0.05)
        self.stopped = threading.Event()
        self.reports = 0

    def run(self) -> None:
        reported = None
        while not self.stopped.wait(self.interval):
            began = self.worker.step_began
            if began is None:
                continue
            elapsed = time.perf_counter() - began
            if 0 < self.exit_after <= elapsed:
                logger.error("an engine step has run for %.0f s, past --watchdog-timeout (%g s): the verifier exits "
                             "(code %d) so that its deployment starts it again; the engine thread is at:\n%s", elapsed,
                             self.exit_after, EXIT_CODE, self._stack())
                logging.shutdown()
                os._exit(EXIT_CODE)
            if elapsed < self.threshold or began == reported:
                continue
            logger.warning("an engine step has run for %.0f s (every stream waits for it); the engine thread is at:\n%s",
                           elapsed, self._stack())
            reported = began
            self.reports += 1

    def _stack(self) -> str:
        frame = sys._current_frames().get(self.worker.ident)
        return "".join(traceback.format_stack(frame)[-16:]).rstrip() if frame is not None else "(the thread is gone)"

    def stop(self) -> None:
        self.stopped.set()
