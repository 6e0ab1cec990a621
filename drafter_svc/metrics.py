"""A drafter process's own Prometheus metrics, served on `splitspec drafter --metrics-port`.

The verifier measures each drafter from the outside (splitspec:drafter_round_trip_seconds,
splitspec:drafter_requests_pinned, ... labelled `drafter`); these are what only the drafter knows: the
requests it holds, its compute per step and batch size, its draft KV cache, its session resets and
the messages it dropped, and its process's CPU and memory. Every sample carries `drafter` (its pool
name) and `algorithm`. Prometheus finds the endpoint through the verifier's HTTP service discovery
(GET /sd/drafters on the verifier's metrics port), which lists every registered drafter's endpoint.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from splitspec.metrics_http import labelled


class DrafterMetrics:
    def __init__(self, registry: CollectorRegistry, name: str, algorithm: str, draft_model: str, device: str):
        labels = {"drafter": name, "algorithm": algorithm}
        ProcessCollector(registry=registry)  # process_cpu_seconds_total, process_resident_memory_bytes, ...

        def make(kind, metric, doc, extra=(), **kwargs):
            bound = labelled(kind, registry, metric, doc, extra, labels, **kwargs)
            return bound if extra else bound.labels()

        info = make(Gauge, "drafter_info", "1, labelled with what the drafter runs.", extra=("draft_model", "device"))
        info.labels(draft_model=draft_model or "", device=str(device)).set(1)
        self.registered = make(Gauge, "drafter_registered", "1 while registered with a verifier, else 0.")
        self.held = make(Gauge, "drafter_held_requests", "Requests this drafter holds (opened, not released).")
        self.steps = make(Counter, "drafter_steps", "Draft requests answered (one per verifier step that asked this drafter).")
        self.batch = make(Histogram, "drafter_step_batch_size", "Requests drafted together in one step.",
                          buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024))
        self.compute = make(Histogram, "drafter_compute_seconds",
                            "Time from reading a draft request to sending its trees (the drafter's own clock).",
                            buckets=(1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1))
        self.proposed = make(Counter, "drafter_proposed_tokens", "Draft tokens proposed (tree nodes below the roots).")
        self.trees = make(Counter, "drafter_trees", "Draft trees sent.")
        self.bets = make(Counter, "drafter_bets", "Bet trees sent (overlap: drafted while the verifier verifies).")
        self.registrations = make(Counter, "drafter_registrations_accepted", "Registrations the verifier accepted.")
        self.resets = make(Counter, "drafter_session_resets",
                           "Sessions given up, by reason (verifier_silent, verifier_restarted, unknown_session).",
                           extra=("reason",))
        self.dropped = make(Counter, "drafter_dropped_messages",
                            "Messages from the verifier that could not be used, by reason: unreadable, unexpected_kind, "
                            "stale (for another session), tensors (unreadable hidden states), request_state (a request "
                            "that cannot follow; reopened), error (a failure handling it). Logged; stale ones at debug.",
                            extra=("reason",))
        for reason in ("unreadable", "unexpected_kind", "stale", "tensors", "request_state", "error"):
            self.dropped.labels(reason=reason)  # every series exists from the start, at 0
        self.superseded = make(Counter, "drafter_superseded_asks",
                               "Asks answered without a tree because a newer ask for the same request was already "
                               "waiting (this drafter fell behind; the verifier had stopped waiting for them).")
        self.grammar_compiles = make(Counter, "drafter_grammar_compiles",
                                     "Constrained requests' grammars compiled here, by outcome (ok, error): each opened "
                                     "request's once (xgrammar's cache makes a repeated grammar a lookup).",
                                     extra=("outcome",))
        self.constrained_trees = make(Counter, "drafter_constrained_trees",
                                      "Trees of constrained requests (structured outputs), by guided: yes (drafted to the "
                                      "grammar), no (its grammar still compiling here, or not usable here).",
                                      extra=("guided",))
        self.grammar_cut = make(Counter, "drafter_grammar_cut_tokens",
                                "Drafted tokens cut from constrained requests' trees because their grammar forbids them.")
        self.kv_usage = make(Gauge, "drafter_kv_cache_usage", "Share of the draft model's KV pages in use (0 without a draft model).")
        self.bytes = make(Counter, "drafter_wire_bytes", "Bytes on the step channel, by direction (received, sent).",
                          extra=("direction",))

