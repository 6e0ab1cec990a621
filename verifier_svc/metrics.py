"""The verifier's Prometheus metrics (vLLM's spec-decode names, prefixed splitspec:), fed once per step
from the engine's StepReport; served on --metrics-port.

PromQL as vLLM documents it: acceptance rate = rate(accepted_tokens) / rate(draft_tokens); mean
acceptance length = 1 + rate(accepted_tokens) / rate(num_drafts); per position = per_pos / num_drafts.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from splitspec.metrics_http import PREFIX, labelled
from splitspec.verifier_svc.engine import Engine


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str):
        labels = {"model_name": model_name}
        self.labels = labels

        def counter(name, doc, extra=()):
            return Counter(PREFIX + name, doc, [*labels, *extra], registry=registry)

        def gauge(name, doc):
            return Gauge(PREFIX + name, doc, list(labels), registry=registry)

        self.num_drafts = counter("spec_decode_num_drafts", "Verify steps that checked at least one draft token.")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos", "Drafts accepted at each depth.", ("position",))
        self.fallbacks = counter("spec_decode_fallbacks", "Delivered drafts that were unusable (plain decode instead).")
        self.grammar_pruned = counter("spec_grammar_pruned_tokens", "Draft tokens a constrained request's grammar forbids, "
                                      "pruned before verification (drafted without the grammar: in a drafter process).")
        self.padding_tokens = counter("spec_verify_padding_tokens", "Filler tree nodes verified so that a batch of trees "
                                      "of different sizes replays one captured CUDA graph (their rows are not read).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that got their first token (cached included).")
        self.prefill_tokens = counter("prefill_computed_tokens", "Tokens prefilled by the target (recomputation after preemption included).")
        self.deferred_steps = counter("overlap_deferred_steps", "Plain decoding steps launched and left in flight: their "
                                      "tokens reached the host while the next step ran (the overlap schedule).")
        self.preemptions = counter("num_preemptions", "Running requests sent back to wait because the KV cache ran out of pages.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.finished = counter("request_success", "Requests that ended, by finish reason.", ("finished_reason",))
        self.accept_length = Histogram(PREFIX + "spec_accept_length", "Tokens emitted per verify step with drafts.",
                                       list(labels), buckets=(1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32), registry=registry)
        self.step_seconds = Histogram(PREFIX + "step_phase_seconds",
                                      "Time per step phase: schedule, draft (waiting for drafts), verify (the target forward), accept, commit.",
                                      [*labels, "phase"],
                                      buckets=(1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
                                      registry=registry)
        self.loop_seconds = Histogram(PREFIX + "engine_loop_seconds",
                                      "Time per busy engine-loop iteration by part: intake (submissions and aborts), step "
                                      "(Engine.step, less what was hidden in it), metrics (this observation), publish (handing "
                                      "the step's deltas to the streams), hidden (metrics and publishing of the last step "
                                      "done while this step's forward ran on the GPU: overlap). Intake, metrics and "
                                      "publish are host work the served path adds to every step.",
                                      [*labels, "part"],
                                      buckets=(1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
                                      registry=registry)
        self.prefix_hit_tokens = counter("prefix_cache_hit_tokens", "Tokens whose KV came from the prefix cache at admission (readmission after preemption included).")
        self.prefix_pages = gauge("prefix_cache_pages", "KV-cache pages held by the prefix cache.")
        self.kv_used = gauge("kv_pages_used", "KV-cache pages in use (the prefix cache's included).")
        self.kv_free = gauge("kv_pages_free", "KV-cache pages free.")
        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to join.")
        self.budget = gauge("spec_adaptive_num_draft_tokens",
                            "Tree budget (nodes, root included) of the last step's speculating requests: fixed without "
                            "--speculative-adaptive, the policy's choice with it; 1 = no drafts.")
        self.depth = gauge("spec_adaptive_num_steps", "Drafting depth that budget allows (0 = no drafts).")
        self.predicted_speedup = gauge("spec_adaptive_predicted_speedup",
                                       "Adaptive: the chosen budget's predicted throughput over plain decoding's, for the "
                                       "batch of the last choice.")
        self.switches = counter("spec_adaptive_switches", "Adaptive: changes of the tree budget.")
        self.probes = counter("spec_adaptive_probes", "Adaptive: probes: two drafted steps while speculation was off "
                              "(its acceptance measured again), or three plain steps while it was on (plain decoding's "
                              "cost timed at that load).")
        self.tries = counter("spec_adaptive_tries", "Adaptive: single steps at a budget not used lately (or ever), to "
                             "measure it before switching to it.")
        self.grpc_malformed = counter("grpc_malformed_messages", "gRPC messages that did not decode (the call that sent "
                                      "one ends with a status; nobody else's), by method.", ("method",))
        self.grpc_refused = counter("grpc_refused_requests", "Submissions refused on arrival (an error delta names the "
                                    "problem), by gRPC code.", ("code",))
        self._switches = self._probes = self._tries = 0
        self._children: dict = {}  # (metric, extra labels) -> its labelled child: labels() costs ~5 us a call

    def _child(self, metric, **extra):
        key = (metric, *extra.items())
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(**self.labels, **extra)
        return child

    def refused(self, code: str) -> None:
        """A submission refused on arrival, by gRPC code name (the gRPC service's Counts)."""
        self.grpc_refused.labels(**self.labels, code=code).inc()

    def malformed(self, method: str) -> None:
        """A gRPC message that did not decode on this method (the gRPC service's Counts)."""
        self.grpc_malformed.labels(**self.labels, method=method).inc()

    def observe(self, engine: Engine, report=None) -> None:
        """One step: its report (default the engine's last), then the engine's state as it is now."""
        report = engine.report if report is None else report
        for metric, amount in ((self.num_drafts, len(report.accept_lengths)), (self.draft_tokens, report.draft_tokens),
                               (self.accepted_tokens, report.accepted_tokens), (self.fallbacks, report.fallbacks),
                               (self.padding_tokens, report.padding_tokens), (self.grammar_pruned, report.grammar_pruned),
                               (self.prompt_tokens, report.prompt_tokens), (self.prefill_tokens, report.prefill_tokens),
                               (self.preemptions, report.preemptions), (self.deferred_steps, int(report.deferred)),
                               (self.generation_tokens, report.generated_tokens), (self.prefix_hit_tokens, report.cached_tokens)):
            child = self._child(metric)  # exported (at 0) from the first step on, incremented only when it moved
            if amount:
                child.inc(amount)
        for position, count in enumerate(report.accepted_per_position):
            self._child(self.accepted_per_pos, position=str(position)).inc(count)
        for reason in report.finished:
            self._child(self.finished, finished_reason=reason).inc()
        for length in report.accept_lengths:
            self._child(self.accept_length).observe(length)
        for phase, seconds in report.seconds.items():
            self._child(self.step_seconds, phase=phase).observe(seconds)
        self.observe_state(engine)
        policy = engine.adaptive
        if engine.drafter is not None:
            self._child(self.budget).set(report.budget)
            steps = engine.spec.num_steps or engine.spec.num_draft_tokens - 1
            self._child(self.depth).set(min(steps, report.budget - 1))
        if policy is not None:
            if policy.predicted.get(1):
                self._child(self.predicted_speedup).set(policy.predicted.get(policy.budget, 0.0) / policy.predicted[1])
            self._child(self.switches).inc(policy.switches - self._switches)
            probes = policy.probes + policy.plain_probes
            self._child(self.probes).inc(probes - self._probes)
            self._child(self.tries).inc(policy.tries - self._tries)
            self._switches, self._probes, self._tries = policy.switches, probes, policy.tries

    def observe_loop(self, parts: dict[str, float]) -> None:
        for part, seconds in parts.items():
            self._child(self.loop_seconds, part=part).observe(seconds)

    def observe_state(self, engine: Engine) -> None:
        allocator = engine.runner.kv_cache.allocator
        self._child(self.kv_used).set(allocator.num_used)
        self._child(self.kv_free).set(allocator.num_free)
        self._child(self.running).set(len(engine.running))
        self._child(self.waiting).set(len(engine.waiting))
        cache = engine.prefix_cache
        self._child(self.prefix_pages).set(cache.num_pages if cache is not None else 0)


class PoolMetrics:
    """The drafter pool's metrics: per drafter (label `drafter`) and for the pool."""

    def __init__(self, registry: CollectorRegistry, model_name: str):
        const = {"model_name": model_name}
        self.pinned = labelled(Gauge, registry, "drafter_requests_pinned", "Requests pinned to each drafter.", ("drafter",), const)
        self.round_trip = labelled(Histogram, registry, "drafter_round_trip_seconds",
                                    "From sending a step's draft request to filing the drafter's reply.", ("drafter",), const,
                                    buckets=(5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
        self.draft_seconds = labelled(Histogram, registry, "drafter_step_seconds",
                                       "Time the drafter reports spending on a step's trees.", ("drafter",), const,
                                       buckets=(1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1))
        self.bytes = labelled(Counter, registry, "drafter_bytes", "Bytes on the step channel (envelopes and tensor frames).",
                               ("drafter", "direction"), const)
        self.dropped = labelled(Counter, registry, "drafter_drafts_dropped",
                                 "Drafter messages or trees dropped, by reason (timeout, late, stale, malformed, "
                                 "wrong_request, invalid_tree, drafter_gone).", ("drafter", "reason"), const)
        self.hidden_bytes = labelled(Counter, registry, "drafter_hidden_state_bytes",
                                      "Bytes of target hidden states sent to each drafter (EAGLE).", ("drafter",), const)
        self.hidden_bytes_per_step = labelled(Histogram, registry, "drafter_hidden_state_bytes_per_step",
                                               "Bytes of hidden states in one draft request to a drafter (EAGLE).",
                                               ("drafter",), const,
                                               buckets=(1e3, 1e4, 1e5, 1e6, 4e6, 1.6e7, 6.4e7, 2.56e8))
        self.heartbeats = labelled(Counter, registry, "drafter_heartbeats", "Heartbeats received.", ("drafter",), const)
        self.cuda_ipc = labelled(Gauge, registry, "drafter_cuda_ipc",
                                 "1 while a drafter takes its tensors through a CUDA-IPC buffer on the verifier's GPU "
                                 "(same host), 0 or absent: ZeroMQ frames.", ("drafter",), const)
        self.draft_tokens = labelled(Counter, registry, "drafter_draft_tokens", "Draft tokens verified, per drafter.",
                                      ("drafter",), const)
        self.accepted_tokens = labelled(Counter, registry, "drafter_accepted_tokens", "Draft tokens accepted, per drafter.",
                                         ("drafter",), const)
        self.bets = labelled(Counter, registry, "drafter_bets",
                             "Overlap: asks whose tree a bet had already drafted (outcome hit), asks drafted afresh "
                             "(miss), and bet replies that came too late (late).", ("drafter", "outcome"), const)
        self.registrations = labelled(Counter, registry, "drafter_registrations", "Drafter registrations, by outcome.",
                                       ("outcome",), const)
        self.handshake_failures = labelled(
            Counter, registry, "drafter_handshake_failures",
            "Connections to the step channel refused in the ZeroMQ handshake (they never register), by reason: "
            "unauthorized (a CURVE key not among --zmq-curve-authorized-keys), mechanism_mismatch (CURVE on one "
            "side only), cryptographic (another --zmq-curve-server-key), protocol, no_detail (closed mid-handshake, "
            "as a peer without CURVE that hangs up first).",
            ("reason",), const)
        self.repins = Counter(PREFIX + "drafter_repins", "Requests moved to another drafter after theirs died or stalled.",
                              ["model_name"], registry=registry).labels(**const)
        self.alive = Gauge(PREFIX + "drafters_alive", "Drafters registered and heartbeating.", ["model_name"],
                           registry=registry).labels(**const)
