"""The load-adaptive policy's timing statistics (verifier_svc/adaptive.py): the buckets its timings are kept by, and
the recent median and mean it reads them as."""

from __future__ import annotations

import math
import statistics


def token_bucket(tokens: int) -> int:
    """Quarter-octave bucket of a token count."""
    return round(4 * math.log2(max(tokens, 1)))


def batch_bucket(batch: int) -> int:
    """Power-of-two bucket of a batch size."""
    return max(batch - 1, 0).bit_length()


class Recent:
    """The median of the last few observations: a pause (a page fault, a collection) does not move it, a change
    of load does within a few steps. Observations older than `stale` steps when a new one comes are dropped: a
    budget not used for a while is judged by what it costs now, not by its first (warming-up) steps."""

    __slots__ = ("values", "count", "last", "_median")
    WINDOW = 9

    def __init__(self):
        self.values: list[float] = []
        self.count = 0
        self.last = 0  # the policy's step of the newest observation
        self._median: float | None = None

    def add(self, x: float, step: int = 0, stale: int = 0) -> None:
        if stale and step - self.last > stale:
            self.values.clear()
        self.count += 1
        self.last = step
        self.values.append(x)
        del self.values[: -self.WINDOW]
        self._median = None

    def add_run(self, xs: list[float], step: int, stale: int = 0) -> None:
        """add(xs[i], step + i, stale) for every i, at once (a run of consecutive steps: only the first can find the
        values before it stale)."""
        self.add(xs[0], step, stale)
        if len(xs) > 1:
            self.values.extend(xs[1:])
            del self.values[: -self.WINDOW]
            self.count += len(xs) - 1
            self.last = step + len(xs) - 1

    def add_same(self, xs: list[float], step: int, stale: int = 0) -> None:
        """add(x, step, stale) for every x, at once (steps that did not move the policy's step count)."""
        self.add_run(xs, step, stale)
        self.last = step

    @property
    def value(self) -> float:
        if self._median is None:
            self._median = statistics.median(self.values)
        return self._median


class Cycle(Recent):
    """The mean whole-cycle seconds of the last few decode steps at one budget and load. A mean, not a median: a
    stall that hits two steps in five (a collection, a drafter's hiccup) is part of what the budget costs."""

    __slots__ = ()
    WINDOW = 32

    @property
    def value(self) -> float:
        return sum(self.values) / len(self.values)
