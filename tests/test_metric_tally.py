"""splitspec.metric_tally exposes what prometheus_client's own metrics expose for the same updates (samples, labels,
values, help and types; `_created` aside), so the verifier's per-step metrics read the same from a scrape."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from splitspec.metric_tally import Tally
from splitspec.metrics_http import metrics_text

BUCKETS = (1e-4, 5e-4, 1e-3, 0.01, 0.1, 1, 2.5)


def families(registry: CollectorRegistry) -> dict:
    """name -> (type, help, sorted samples), without _created (a family of its own in the text format)."""
    out = {}
    for family in text_string_to_metric_families(metrics_text(registry).decode()):
        if family.name.endswith("_created"):
            continue
        samples = sorted((s.name, tuple(sorted(s.labels.items())), s.value) for s in family.samples
                         if not s.name.endswith("_created"))
        out[family.name] = (family.type, family.documentation, samples)
    return out


def test_a_tally_scrapes_as_prometheus_clients_metrics_do():
    const = {"model_name": "demo"}
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    counter = Counter("splitspec:things", "Things counted.", ["model_name"], registry=theirs)
    by_reason = Counter("splitspec:ends", "Ends by reason.", ["model_name", "reason"], registry=theirs)
    gauge = Gauge("splitspec:level", "A level.", ["model_name"], registry=theirs)
    histogram = Histogram("splitspec:seconds", "Seconds by phase.", ["model_name", "phase"], buckets=BUCKETS,
                          registry=theirs)
    lengths = Histogram("splitspec:lengths", "Lengths.", ["model_name"], buckets=(1, 2, 3, 4, 8), registry=theirs)
    tally = Tally(ours, "splitspec:", const)
    t_counter, t_by_reason = tally.counter("things", "Things counted."), tally.counter("ends", "Ends by reason.", ("reason",))
    t_gauge = tally.gauge("level", "A level.")
    t_histogram = tally.histogram("seconds", "Seconds by phase.", BUCKETS, ("phase",))
    t_lengths = tally.histogram("lengths", "Lengths.", (1, 2, 3, 4, 8))
    tally.register()
    rng = random.Random(5)
    counter.labels(**const)  # a counter is exported at 0 before its first increment, as the tally's is
    for _ in range(300):
        amount = rng.choice([0, 1, 7])
        counter.labels(**const).inc(amount)
        t_counter.inc(amount)
        reason = rng.choice(["stop", "length", "abort"])
        by_reason.labels(**const, reason=reason).inc()
        t_by_reason.inc(1, (reason,))
        level = rng.randint(0, 50)
        gauge.labels(**const).set(level)
        t_gauge.set(level)
        phase = rng.choice(["verify", "draft"])
        seconds = rng.choice([1e-4, 1e-3, 2.5, 10.0, rng.random() * 0.02])  # bounds themselves fall in their bucket
        histogram.labels(**const, phase=phase).observe(seconds)
        t_histogram.observe(seconds, (phase,))
        step = [rng.randint(1, 9) for _ in range(rng.randint(0, 16))]
        for length in step:
            lengths.labels(**const).observe(length)
        t_lengths.observe_all(step)
    theirs_families, ours_families = families(theirs), families(ours)
    assert ours_families.keys() == theirs_families.keys() and len(ours_families) == 5
    for name, (kind, doc, samples) in theirs_families.items():
        ours_kind, ours_doc, ours_samples = ours_families[name]
        assert (ours_kind, ours_doc) == (kind, doc), name
        assert [s[:2] for s in ours_samples] == [s[:2] for s in samples], name
        for a, b in zip(ours_samples, samples):
            assert abs(a[2] - b[2]) <= 1e-9 * max(1.0, abs(b[2])), (name, a, b)
