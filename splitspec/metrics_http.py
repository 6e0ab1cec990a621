"""A /metrics endpoint that always answers in Prometheus's text format 0.0.4.

prometheus_client's own server negotiates OpenMetrics 1.0.0 with Prometheus and, for metric names
with colons (ours are `splitspec:...`, as vLLM's are `vllm:...`), writes `# TYPE splitspec:x` but
samples named `splitspec_x_total` (prometheus/client_python#1177, open as of 0.26). Prometheus then
stores none of the samples. The text format keeps the names intact, so the endpoint serves only that.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "splitspec:"  # every metric's name starts so, as vLLM's start with vllm:
logger = logging.getLogger(__name__)


class Bound:
    """A metric with its constant labels filled in: .labels(**rest) gives the child."""

    def __init__(self, metric, const: dict):
        self.metric, self.const = metric, const

    def labels(self, **labels):
        return self.metric.labels(**self.const, **labels)


def labelled(kind, registry, name, doc, names, const, **kwargs) -> Bound:
    """A PREFIXed prometheus_client metric labelled by const's keys and then names, const filled in."""
    return Bound(kind(PREFIX + name, doc, [*const, *names], registry=registry, **kwargs), const)


def metrics_text(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)


def start_metrics_server(registry: CollectorRegistry, host: str, port: int,
                         json_routes: dict[str, Callable[[], object]] | None = None) -> ThreadingHTTPServer:
    """Serve GET /metrics on host:port from a daemon thread; returns the server (its port is bound).
    json_routes: more paths, each answered with its callable's result as JSON (e.g. /sd/drafters)."""
    json_routes = dict(json_routes or {})

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            path = self.path.split("?", 1)[0]
            if path in json_routes:
                body, content_type = json.dumps(json_routes[path]()).encode(), "application/json"
            elif path in ("/metrics", "/"):
                body, content_type = metrics_text(registry), CONTENT_TYPE
            else:
                self.send_error(404, f"served here: /metrics {' '.join(json_routes)}".strip())
                return
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args):  # scrapes every few seconds would flood the log
            logger.debug("metrics: " + format, *args)

    server_class = ThreadingHTTPServer
    if ":" in host:  # an IPv6 address

        class server_class(ThreadingHTTPServer):  # noqa: N801
            address_family = socket.AF_INET6

    server = server_class((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
