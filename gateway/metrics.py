"""The gateway's Prometheus metrics (vLLM's latency names, prefixed splitspec:), served on its own
`/metrics`."""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, multiprocess

PREFIX = "splitspec:"
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class GatewayMetrics:
    def __init__(self, model_name: str):
        """With PROMETHEUS_MULTIPROC_DIR set (several gateway processes, gateway/workers.py), every process writes
        its values there and `exposition` sums all of theirs (prometheus_client's multiprocess mode; the process
        collector's memory and descriptors are left out there: they would be the answering process's alone)."""
        self.registry = CollectorRegistry()
        multiprocess_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if multiprocess_dir:
            self.exposition = CollectorRegistry()
            multiprocess.MultiProcessCollector(self.exposition, path=multiprocess_dir)
        else:
            self.exposition = self.registry
            ProcessCollector(registry=self.registry)  # process_resident_memory_bytes, process_open_fds, ... (drift)
        labels = ["model_name"]
        self.model = {"model_name": model_name}
        reg = self.registry
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Request arrival to its first token sent.",
                              labels, buckets=LATENCY_BUCKETS, registry=reg)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "Gap between successive token deliveries of a request (one per verifier step; a step may "
                             "carry several accepted tokens).", labels, buckets=LATENCY_BUCKETS, registry=reg)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Request arrival to its last token.", labels,
                             buckets=LATENCY_BUCKETS, registry=reg)
        self.http = Counter(PREFIX + "gateway_http_requests", "HTTP requests answered, by endpoint and status code.",
                            ["endpoint", "status_code"], registry=reg)
        self.finished = Counter(PREFIX + "gateway_finished_choices", "Choices that ended, by finish reason.",
                                [*labels, "finish_reason"], registry=reg)
        self.prompt_tokens = Counter(PREFIX + "gateway_prompt_tokens", "Prompt tokens of admitted requests.", labels,
                                     registry=reg)
        self.completion_tokens = Counter(PREFIX + "gateway_completion_tokens", "Tokens generated for clients.", labels,
                                         registry=reg)
        self.in_flight = Gauge(PREFIX + "gateway_requests_in_flight", "HTTP generation requests being served.", labels,
                               registry=reg, multiprocess_mode="livesum")
        self.grpc_errors = Counter(PREFIX + "gateway_grpc_errors", "Failed gRPC calls and streams to the verifier, by code.",
                                   ["code"], registry=reg)
        self.tokenize_batch = Histogram(PREFIX + "gateway_tokenize_batch_size",
                                        "Requests rendered and encoded together (those that arrived in one event-loop turn).",
                                        labels, buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=reg)
        self.aborts = Counter(PREFIX + "gateway_aborts", "Verifier requests aborted by the gateway, by cause.",
                              ["cause"], registry=reg)
        # the served model's children, looked up once rather than per delta or per request (labels() takes a lock and
        # checks its values each call)
        self.ttft_served, self.itl_served, self.e2e_served = (h.labels(**self.model) for h in (self.ttft, self.itl, self.e2e))
        self.in_flight_served = self.in_flight.labels(**self.model)
        self.prompt_tokens_served = self.prompt_tokens.labels(**self.model)
        self.completion_tokens_served = self.completion_tokens.labels(**self.model)
        self._children: dict[tuple, object] = {}

    def answered(self, endpoint: str, status: str):
        """The HTTP counter's child for an endpoint and status code."""
        key = ("http", endpoint, status)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.http.labels(endpoint, status)
        return child

    def finished_as(self, reason: str):
        """The finished-choices counter's child for a finish reason."""
        key = ("finished", reason)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.finished.labels(finish_reason=reason, **self.model)
        return child
