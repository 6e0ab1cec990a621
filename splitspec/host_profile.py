"""Where a serving loop's host time goes: with SPLITSPEC_PROFILE_HOST=PREFIX in its environment, a service's
loop thread (the verifier's engine loop, a drafter's message loop) runs under cProfile and writes
PREFIX.<name>.<pid>.prof (pstats format) every few seconds and when it ends, so a killed process leaves its
last dump behind. Read it with `python -m pstats FILE` (sort tottime, stats 40). Off unless the variable is set:
a profiled loop runs a few times slower in Python code, so its timings are for proportions, not speed."""

from __future__ import annotations

import cProfile
import os
import time

ENV = "SPLITSPEC_PROFILE_HOST"
DUMP_EVERY_S = 5.0


class HostProfile:
    """Call start() on the loop's thread, tick() once per iteration, stop() at its end; no-ops when off."""

    def __init__(self, name: str):
        prefix = os.environ.get(ENV)
        self.path = f"{prefix}.{name}.{os.getpid()}.prof" if prefix else None
        self.profiler = cProfile.Profile() if prefix else None
        self._dumped = 0.0

    def start(self) -> None:
        if self.profiler is not None:
            self._dumped = time.monotonic()
            self.profiler.enable()

    def tick(self, idle: bool = False) -> None:
        """idle: the loop is about to wait for work; what it did since the last dump is written now."""
        if self.profiler is not None and (idle or time.monotonic() - self._dumped >= DUMP_EVERY_S):
            self._dump()
            self.profiler.enable()

    def stop(self) -> None:
        if self.profiler is not None:
            self._dump()

    def _dump(self) -> None:
        self.profiler.disable()
        self.profiler.dump_stats(self.path)  # the totals so far: each dump replaces the last
        self._dumped = time.monotonic()
