"""Metrics fed at every engine step, kept as plain numbers and turned into Prometheus families only when scraped.

prometheus_client's metrics take a lock and walk a few calls per observation: the verifier's per-step metrics (a dozen
counters, an accept length per speculating request, a time per phase, the loop's parts) cost the engine thread ~80 us
a drafted step at batch 16 on a 2-core CI machine, every step, in the host work a small target's GPU step waits on.
A Tally is fed by one thread (the engine's) with dict and list updates; a scrape (another thread) reads them, each
family's numbers copied in one C call under the GIL, so a scrape never sees a histogram's buckets half-updated (its
sum may trail its counts by one observation). The families and their samples are those prometheus_client's own
Counter, Gauge and Histogram expose (`_total`, `_bucket`/`_count`/`_sum`), without `_created`.
"""

from __future__ import annotations

from bisect import bisect_left

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString


class TallyCounter:
    """values: extra label values (a tuple, () without extra labels) -> count; exported from 0 at creation."""

    def __init__(self):
        self.values: dict[tuple, float] = {(): 0.0}

    def inc(self, amount: float = 1.0, key: tuple = ()) -> None:
        self.values[key] = self.values.get(key, 0.0) + amount


class TallyGauge:
    """values: extra label values -> value; exported from its first set (values[()] = x sets it too)."""

    def __init__(self):
        self.values: dict[tuple, float] = {}

    def set(self, value: float, key: tuple = ()) -> None:
        self.values[key] = value


class TallyHistogram:
    """series: extra label values -> [bucket counts (len(bounds) + 1: the last is past every bound), sum]."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = tuple(sorted(bounds))
        self.series: dict[tuple, list] = {}

    def _series(self, key: tuple) -> list:
        series = self.series.get(key)
        if series is None:
            series = self.series[key] = [[0] * (len(self.bounds) + 1), 0.0]
        return series

    def observe(self, value: float, key: tuple = ()) -> None:
        series = self._series(key)
        series[0][bisect_left(self.bounds, value)] += 1  # le: the first bound at or above the value
        series[1] += value

    def observe_all(self, values, key: tuple = ()) -> None:
        """observe() of each value (a step's accept lengths), the series looked up once."""
        if not values:
            return
        series = self._series(key)
        counts, bounds = series[0], self.bounds
        for value in values:
            counts[bisect_left(bounds, value)] += 1
        series[1] += sum(values)


class Tally:
    """A Collector of counters, gauges and histograms fed by one thread; every family carries the constant labels
    (e.g. model_name) first, then its own."""

    def __init__(self, registry: CollectorRegistry, prefix: str, const: dict[str, str]):
        self.prefix, self.const = prefix, const
        self._families: list[tuple[str, str, str, tuple[str, ...], object]] = []  # (kind, name, doc, labels, tally)
        self._registry = registry

    def counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> TallyCounter:
        return self._add("counter", name, doc, labels, TallyCounter())

    def gauge(self, name: str, doc: str) -> TallyGauge:
        return self._add("gauge", name, doc, (), TallyGauge())

    def histogram(self, name: str, doc: str, buckets: tuple[float, ...], labels: tuple[str, ...] = ()) -> TallyHistogram:
        return self._add("histogram", name, doc, labels, TallyHistogram(buckets))

    def _add(self, kind, name, doc, labels, tally):
        if labels and kind != "histogram":  # a labelled family has no sample until its first labelled update
            tally.values = {}
        self._families.append((kind, self.prefix + name, doc, tuple(labels), tally))
        return tally

    def register(self) -> None:
        """Into the registry, once every family is declared (the registry checks names against describe())."""
        self._registry.register(self)

    def describe(self):
        return [self._family(kind, name, doc, labels) for kind, name, doc, labels, _ in self._families]

    def _family(self, kind, name, doc, labels):
        names = [*self.const, *labels]
        if kind == "counter":
            return CounterMetricFamily(name, doc, labels=names)
        if kind == "gauge":
            return GaugeMetricFamily(name, doc, labels=names)
        return HistogramMetricFamily(name, doc, labels=names)

    def collect(self):
        const = list(self.const.values())
        for kind, name, doc, labels, tally in self._families:
            family = self._family(kind, name, doc, labels)
            if kind == "histogram":
                for key, (counts, total) in list(tally.series.items()):
                    counts = list(counts)
                    cumulative, buckets = 0, []
                    for bound, count in zip((*tally.bounds, float("inf")), counts):
                        cumulative += count
                        buckets.append((floatToGoString(bound), cumulative))
                    family.add_metric([*const, *key], buckets, total)
            else:
                for key, value in list(tally.values.items()):
                    family.add_metric([*const, *key], value)
            yield family
