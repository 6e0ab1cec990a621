"""`splitspec bench --url`: a running deployment measured over its OpenAI HTTP API with streaming (plain
requests opt out with "speculative": false), one client thread per concurrent request."""

from __future__ import annotations

import http.client
import itertools
import json
import logging
import queue
import statistics
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

from splitspec.bench_measure import Timeline, latency_fields, make_prompts
from splitspec.step_log import StepLog

logger = logging.getLogger("splitspec.bench")


class Http:
    def __init__(self, url: str, api_key: str | None):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--url {url!r}: expected http(s)://host:port")
        self.https, self.host, self.port = parts.scheme == "https", parts.hostname, parts.port
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def connection(self):
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=600)

    def get(self, path: str) -> dict:
        conn = self.connection()
        try:
            conn.request("GET", path, headers=self.headers)
            response = conn.getresponse()
            body = response.read()
            if response.status != 200:
                raise RuntimeError(f"GET {path}: HTTP {response.status}: {body[:200]!r}")
            return json.loads(body)
        finally:
            conn.close()

    def stream(self, body: dict, timeline: Timeline) -> dict:
        """POST /v1/completions with stream=true; records each delivery; returns the last chunk's extras."""
        conn = self.connection()
        extras = {}
        try:
            timeline.sent = time.perf_counter()
            conn.request("POST", "/v1/completions", json.dumps(body), headers=self.headers)
            response = conn.getresponse()
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"stream error: {chunk['error']}")
                now = time.perf_counter()
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    timeline.deliveries.append((now, 1))  # token counts per delivery are not on the wire
                if "speculative" in chunk:
                    extras["speculative"] = chunk["speculative"]
                if chunk.get("usage"):
                    extras["usage"] = chunk["usage"]
            tokens = (extras.get("usage") or {}).get("completion_tokens")
            if tokens and timeline.deliveries:  # spread the count over the deliveries
                extra = tokens - len(timeline.deliveries)
                t, n = timeline.deliveries[-1]
                timeline.deliveries[-1] = (t, n + max(0, extra))
            return extras
        finally:
            conn.close()


def run_remote(args) -> dict:
    client = Http(args.url, args.api_key)
    models = client.get("/v1/models")
    model = models["data"][0]["id"]
    batch_sizes = [int(b) for b in args.batch_size.split(",")]
    counts = {b: args.num_prompts or max(4, 2 * b) for b in batch_sizes}
    local = Path(args.model_path) if args.model_path else None
    prompts_all = make_prompts(args, local, None, max(counts.values()))
    rows = []
    log = StepLog.from_env("client")  # SPLITSPEC_STEP_LOG
    for batch_size, speculative in itertools.product(batch_sizes, (False, True)):
        prompts = prompts_all[: counts[batch_size]]
        work: queue.Queue = queue.Queue()
        for i in range(len(prompts)):
            work.put(i)
        timelines = [Timeline() for _ in prompts]
        extras: list[dict] = [{} for _ in prompts]
        errors: list[str] = []

        def worker():
            while True:
                try:
                    i = work.get_nowait()
                except queue.Empty:
                    return
                body = {"model": model, "prompt": prompts[i], "max_tokens": args.output_len, "stream": True,
                        "temperature": args.temperature, "seed": i, "ignore_eos": True, "speculative": speculative,
                        "stream_options": {"include_usage": True}}
                try:
                    extras[i] = client.stream(body, timelines[i])
                except Exception as exc:  # noqa: BLE001 (reported in the row)
                    errors.append(f"request {i}: {exc}")

        for warm in range(args.warmup_requests):
            client.stream({"model": model, "prompt": prompts[warm % len(prompts)], "max_tokens": 8, "stream": True,
                           "temperature": 0, "ignore_eos": True, "speculative": speculative}, Timeline())
        start = time.perf_counter()
        threads = [threading.Thread(target=worker, daemon=True) for _ in range(batch_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        ended = time.perf_counter()
        if log is not None:
            log.point(batch_size, speculative, start, ended, timelines)
        row = {"batch_size": batch_size, "speculative": None, **latency_fields(timelines, ended - start),
               "errors": errors}
        row["prompt_tokens_mean"] = round(statistics.fmean(
            [e["usage"]["prompt_tokens"] for e in extras if e.get("usage")] or [0]), 1)
        counts_ = [e["speculative"] for e in extras if e.get("speculative")]
        steps = sum(c["verify_steps"] for c in counts_)
        accepted = sum(c["accepted_tokens"] for c in counts_)
        if speculative:
            row.update(speculative=next((c["algorithm"] for c in counts_ if c.get("algorithm")), "off"),
                       verify_steps=steps, accepted_tokens=accepted,
                       accept_length=round(1 + accepted / steps, 4) if steps else None)
            plain = next(r for r in rows if r["batch_size"] == batch_size and r["speculative"] is None)
            row["speedup"] = round(row["output_tok_s"] / plain["output_tok_s"], 3) if plain["output_tok_s"] else None
        rows.append(row)
        logger.info("batch %d %s: %s tok/s, ttft %s ms", batch_size, "speculative" if speculative else "plain",
                    row["output_tok_s"], (row["ttft_ms"] or {}).get("p50"))
    return {"url": args.url, "model": model, "rows": rows}
