"""A /metrics endpoint that always answers in Prometheus's text format 0.0.4.

prometheus_client's own server negotiates OpenMetrics 1.0.0 with Prometheus and, for metric names
with colons (ours are `splitspec:...`, as vLLM's are `vllm:...`), writes `# TYPE splitspec:x` but
samples named `splitspec_x_total` (prometheus/client_python#1177, open as of 0.26). Prometheus then
stores none of the samples. The text format keeps the names intact, so the endpoint serves only that.
"""

from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
logger = logging.getLogger(__name__)


def metrics_text(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)


def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> ThreadingHTTPServer:
    """Serve GET /metrics on host:port from a daemon thread; returns the server (its port is bound)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            if self.path.split("?", 1)[0] not in ("/metrics", "/"):
                self.send_error(404, "only /metrics is served here")
                return
            body = metrics_text(registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args):  # scrapes every few seconds would flood the log
            logger.debug("metrics: " + format, *args)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
