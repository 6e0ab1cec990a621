"""The verifier's Prometheus metrics (vLLM's spec-decode names, prefixed splitspec:), fed once per step
from the engine's StepReport; served on --metrics-port.

PromQL as vLLM documents it: acceptance rate = rate(accepted_tokens) / rate(draft_tokens); mean
acceptance length = 1 + rate(accepted_tokens) / rate(num_drafts); per position = per_pos / num_drafts.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from splitspec.metric_tally import Tally
from splitspec.metrics_http import PREFIX, labelled
from splitspec.verifier_svc.engine import Engine


class EngineMetrics:
    """Fed by the engine's thread once per step (and at aborts, on the same thread): a Tally (plain numbers, turned
    into families at a scrape; splitspec.metric_tally); the gRPC front's counts, fed from another thread, are
    prometheus_client's own metrics."""

    def __init__(self, registry: CollectorRegistry, model_name: str):
        labels = {"model_name": model_name}
        self.labels = labels
        tally = Tally(registry, PREFIX, labels)
        counter, gauge = tally.counter, tally.gauge
        self.num_drafts = counter("spec_decode_num_drafts", "Verify steps that checked at least one draft token.")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos", "Drafts accepted at each depth.", ("position",))
        self.fallbacks = counter("spec_decode_fallbacks", "Delivered drafts that were unusable (plain decode instead).")
        self.grammar_pruned = counter("spec_grammar_pruned_tokens", "Draft tokens a constrained request's grammar forbids, "
                                      "pruned before verification (drafted without the grammar: in a drafter process).")
        self.padding_tokens = counter("spec_verify_padding_tokens", "Filler tree nodes verified so that a batch of trees "
                                      "of different sizes replays one captured CUDA graph (their rows are not read).")
        self.prompt_padding_tokens = counter("prompt_padding_tokens", "Filler tokens prefilled after prompt chunks so that "
                                             "a step that only prefills replays a captured prompt graph "
                                             "(--prompt-cuda-graph-max-tokens; their rows are not read).")
        self.caught_up_ahead = counter("spec_catch_up_ahead_requests", "Verified chains whose draft head caught up on "
                                       "them before their acceptance reached the host (a drafter in the verifier's "
                                       "process: queued behind the verification, not after the host's walk).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that got their first token (cached included).")
        self.prefill_tokens = counter("prefill_computed_tokens", "Tokens prefilled by the target (recomputation after preemption included).")
        self.deferred_steps = counter("overlap_deferred_steps", "Plain decoding steps launched and left in flight: their "
                                      "tokens reached the host while the next step ran (the overlap schedule).")
        self.preemptions = counter("num_preemptions", "Running requests sent back to wait because the KV cache ran out of pages.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.finished = counter("request_success", "Requests that ended, by finish reason.", ("finished_reason",))
        self.accept_length = tally.histogram("spec_accept_length", "Tokens emitted per verify step with drafts.",
                                             (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32))
        self.step_seconds = tally.histogram(
            "step_phase_seconds", "Time per step phase: schedule, draft (waiting for drafts), verify (the target forward), "
            "accept, commit.", (1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5), ("phase",))
        self.loop_seconds = tally.histogram(
            "engine_loop_seconds", "Time per busy engine-loop iteration by part: intake (submissions and aborts), step "
            "(Engine.step, less what was hidden in it), metrics (this observation), publish (handing the step's deltas to "
            "the streams), hidden (metrics and publishing of the last step done while this step's forward ran on the "
            "GPU: overlap). Intake, metrics and publish are host work the served path adds to every step.",
            (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1), ("part",))
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
        tally.register()
        self.grpc_malformed = Counter(PREFIX + "grpc_malformed_messages", "gRPC messages that did not decode (the call "
                                      "that sent one ends with a status; nobody else's), by method.", [*labels, "method"],
                                      registry=registry)
        self.grpc_refused = Counter(PREFIX + "grpc_refused_requests", "Submissions refused on arrival (an error delta "
                                    "names the problem), by gRPC code.", [*labels, "code"], registry=registry)
        self._switches = self._probes = self._tries = 0
        # (counter, the report's field) of the counters every step adds to
        self._step_counts = ((self.draft_tokens, "draft_tokens"), (self.accepted_tokens, "accepted_tokens"),
                             (self.fallbacks, "fallbacks"), (self.padding_tokens, "padding_tokens"),
                             (self.prompt_padding_tokens, "prompt_padding_tokens"),
                             (self.grammar_pruned, "grammar_pruned"), (self.caught_up_ahead, "caught_up_ahead"),
                             (self.prompt_tokens, "prompt_tokens"),
                             (self.prefill_tokens, "prefill_tokens"), (self.preemptions, "preemptions"),
                             (self.generation_tokens, "generated_tokens"), (self.prefix_hit_tokens, "cached_tokens"))

    def refused(self, code: str) -> None:
        """A submission refused on arrival, by gRPC code name (the gRPC service's Counts; the front's thread)."""
        self.grpc_refused.labels(**self.labels, code=code).inc()

    def malformed(self, method: str) -> None:
        """A gRPC message that did not decode on this method (the gRPC service's Counts; the front's thread)."""
        self.grpc_malformed.labels(**self.labels, method=method).inc()

    def count_finished(self, reason: str) -> None:
        self.finished.inc(1, (reason,))

    def observe(self, engine: Engine, report=None) -> None:
        """One step: its report (default the engine's last), then the engine's state as it is now."""
        report = engine.report if report is None else report
        for counter, field in self._step_counts:
            amount = getattr(report, field)
            if amount:
                counter.values[()] += amount
        if report.accept_lengths:
            self.num_drafts.values[()] += len(report.accept_lengths)
            self.accept_length.observe_all(report.accept_lengths)
        if report.deferred:
            self.deferred_steps.values[()] += 1
        for position, count in enumerate(report.accepted_per_position):
            self.accepted_per_pos.inc(count, (str(position),))
        for reason in report.finished:
            self.finished.inc(1, (reason,))
        observe = self.step_seconds.observe
        for phase, seconds in report.seconds.items():
            observe(seconds, (phase,))
        self.observe_state(engine)
        if engine.drafter is not None:
            self.budget.values[()] = report.budget
            steps = engine.spec.num_steps or engine.spec.num_draft_tokens - 1
            self.depth.values[()] = min(steps, report.budget - 1)
        policy = engine.adaptive
        if policy is not None:
            if policy.predicted.get(1):
                self.predicted_speedup.values[()] = policy.predicted.get(policy.budget, 0.0) / policy.predicted[1]
            probes = policy.probes + policy.plain_probes
            self.switches.values[()] += policy.switches - self._switches
            self.probes.values[()] += probes - self._probes
            self.tries.values[()] += policy.tries - self._tries
            self._switches, self._probes, self._tries = policy.switches, probes, policy.tries

    def observe_loop(self, parts: dict[str, float]) -> None:
        observe = self.loop_seconds.observe
        for part, seconds in parts.items():
            observe(seconds, (part,))

    def observe_state(self, engine: Engine) -> None:
        allocator = engine.runner.kv_cache.allocator
        self.kv_used.values[()] = allocator.num_used
        self.kv_free.values[()] = allocator.num_free
        self.running.values[()] = len(engine.running)
        self.waiting.values[()] = len(engine.waiting)
        cache = engine.prefix_cache
        self.prefix_pages.values[()] = cache.num_pages if cache is not None else 0


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
