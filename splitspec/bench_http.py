"""`splitspec bench --url`: a running deployment measured over its OpenAI HTTP API with streaming (plain
requests opt out with "speculative": false). One asyncio event loop drives every concurrent request, each
slot over its own keep-alive connection, as the field's serving benchmarks do (SGLang's bench_serving, vLLM's
benchmark_serving: aiohttp); HTTP/1.1 is h11's. A thread per request on a new connection, as before, was itself a
queue under a burst: on this project's 2-core machine a 64-request burst reached a bare server 26-28 ms after its
start on the mean that way, 4.5-6.9 ms on this client's kept-alive connections (benchmarks/client_burst.py)."""

from __future__ import annotations

import asyncio
import http.client
import itertools
import json
import logging
import ssl
import statistics
import time
import weakref
from pathlib import Path
from urllib.parse import urlsplit

import h11

from splitspec import event_loop
from splitspec.bench_measure import Timeline, latency_fields, make_prompts
from splitspec.step_log import StepLog

logger = logging.getLogger("splitspec.bench")

TIMEOUT_S = 600.0  # a connection that cannot open, or a server silent this long, fails the request
CONNECTIONS: weakref.WeakSet = weakref.WeakSet()  # what `kill -USR2` reports on (where a stuck point waits)


class Http:
    def __init__(self, url: str, api_key: str | None):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--url {url!r}: expected http(s)://host:port")
        self.https, self.host = parts.scheme == "https", parts.hostname
        self.port = parts.port or (443 if self.https else 80)
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def get(self, path: str) -> dict:
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        conn = cls(self.host, self.port, timeout=TIMEOUT_S)
        try:
            conn.request("GET", path, headers=self.headers)
            response = conn.getresponse()
            body = response.read()
            if response.status != 200:
                raise RuntimeError(f"GET {path}: HTTP {response.status}: {body[:200]!r}")
            return json.loads(body)
        finally:
            conn.close()

    def connection(self) -> Connection:
        return Connection(self)


class Connection:
    """One keep-alive HTTP/1.1 connection (opened on first use, opened again when the server closes it)."""

    def __init__(self, http_: Http):
        self.http = http_
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.h11: h11.Connection | None = None
        self.request: int | None = None  # the body's seed (its index in the point) while a request is out
        self.opened = self.received = 0  # connections opened, bytes received on this one
        self.last_read = time.perf_counter()
        CONNECTIONS.add(self)

    def state(self) -> str:
        h = "closed" if self.h11 is None else f"ours {self.h11.our_state.__name__}, theirs {self.h11.their_state.__name__}"
        local = self.writer.get_extra_info("sockname") if self.writer is not None else None
        return (f"request {self.request} on {local}: {h}, opened {self.opened}x, {self.received} bytes in, last read "
                f"{time.perf_counter() - self.last_read:.1f} s ago")

    async def _open(self) -> None:
        context = ssl.create_default_context() if self.http.https else None
        self.reader, self.writer = await asyncio.wait_for(
            asyncio.open_connection(self.http.host, self.http.port, ssl=context), TIMEOUT_S)
        self.h11 = h11.Connection(h11.CLIENT)
        self.opened += 1
        self.received = 0

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = self.h11 = None

    async def _next_event(self):
        while True:
            event = self.h11.next_event()
            if event is not h11.NEED_DATA:
                return event
            try:
                async with asyncio.timeout(TIMEOUT_S):
                    data = await self.reader.read(65536)
            except TimeoutError:
                raise RuntimeError(f"nothing from the server for {TIMEOUT_S:g} s") from None
            self.received += len(data)
            self.last_read = time.perf_counter()
            self.h11.receive_data(data)  # b"" = the server closed: h11 raises on a cut message

    async def stream(self, body: dict, timeline: Timeline) -> dict:
        """POST /v1/completions with stream=true; records each delivery; returns the last chunk's extras. A kept-alive
        connection the server closed meanwhile is opened again and the request sent again (no response had begun)."""
        payload = json.dumps(body).encode()
        headers = [("Host", f"{self.http.host}:{self.http.port}"), ("Content-Length", str(len(payload))),
                   *self.http.headers.items()]
        timeline.sent = time.perf_counter()
        self.request = body.get("seed")
        for attempt in (0, 1):
            reused = self.h11 is not None
            if not reused:
                await self._open()
            self.writer.write(self.h11.send(h11.Request(method="POST", target="/v1/completions", headers=headers))
                              + self.h11.send(h11.Data(data=payload)) + self.h11.send(h11.EndOfMessage()))
            try:
                await self.writer.drain()
                response = await self._next_event()
                if isinstance(response, h11.ConnectionClosed):
                    raise ConnectionError
            except (ConnectionError, h11.RemoteProtocolError):
                self.close()
                if reused and attempt == 0:
                    continue
                raise RuntimeError("the server closed the connection") from None
            break
        try:
            extras = await self._response(response, timeline)
        except BaseException:
            self.close()
            raise
        if self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE:
            self.h11.start_next_cycle()  # keep-alive: the slot's next request reuses the connection
        else:
            self.close()
        self.request = None
        return extras

    async def _response(self, response: h11.Response, timeline: Timeline) -> dict:
        extras, buffer, error = {}, b"", response.status_code != 200
        while True:
            event = await self._next_event()
            if isinstance(event, h11.EndOfMessage):
                break
            if isinstance(event, h11.ConnectionClosed):
                raise RuntimeError("the server closed the connection mid-stream")
            buffer += event.data
            if error:
                continue
            now = time.perf_counter()
            *lines, buffer = buffer.split(b"\n")
            for raw in lines:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"stream error: {chunk['error']}")
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    timeline.deliveries.append((now, 1))  # token counts per delivery are not on the wire
                if "speculative" in chunk:
                    extras["speculative"] = chunk["speculative"]
                if chunk.get("usage"):
                    extras["usage"] = chunk["usage"]
        if error:
            raise RuntimeError(f"HTTP {response.status_code}: {buffer[:300]!r}")
        tokens = (extras.get("usage") or {}).get("completion_tokens")
        if tokens and timeline.deliveries:  # spread the count over the deliveries
            extra = tokens - len(timeline.deliveries)
            t, n = timeline.deliveries[-1]
            timeline.deliveries[-1] = (t, n + max(0, extra))
        return extras


async def _point(client: Http, bodies: list[dict], concurrency: int, timelines: list[Timeline], extras: list[dict],
                 errors: list[str]) -> tuple[float, float]:
    """Every body sent, at most `concurrency` at a time, one connection per slot; (start, end)."""
    pending = iter(range(len(bodies)))

    async def slot():
        connection = client.connection()
        try:
            for i in pending:
                try:
                    extras[i] = await connection.stream(bodies[i], timelines[i])
                except Exception as exc:  # noqa: BLE001 (reported in the row)
                    errors.append(f"request {i}: {exc}")
        finally:
            connection.close()

    event_loop.print_tasks_on_sigusr2(lambda: [c.state() for c in CONNECTIONS])
    start = time.perf_counter()
    await asyncio.gather(*(slot() for _ in range(concurrency)))
    return start, time.perf_counter()


async def _warm(client: Http, bodies: list[dict]) -> None:
    event_loop.print_tasks_on_sigusr2(lambda: [c.state() for c in CONNECTIONS])
    connection = client.connection()
    try:
        for body in bodies:
            await connection.stream(body, Timeline())
    finally:
        connection.close()


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
        bodies = [{"model": model, "prompt": p, "max_tokens": args.output_len, "stream": True,
                   "temperature": args.temperature, "seed": i, "ignore_eos": True, "speculative": speculative,
                   "stream_options": {"include_usage": True}} for i, p in enumerate(prompts)]
        timelines = [Timeline() for _ in prompts]
        extras: list[dict] = [{} for _ in prompts]
        errors: list[str] = []
        warm = [{"model": model, "prompt": prompts[w % len(prompts)], "max_tokens": 8, "stream": True,
                 "temperature": 0, "ignore_eos": True, "speculative": speculative}
                for w in range(args.warmup_requests)]
        asyncio.run(_warm(client, warm))
        start, ended = asyncio.run(_point(client, bodies, batch_size, timelines, extras, errors))
        if log is not None:
            log.point(batch_size, speculative, start, ended, timelines)
        row = {"batch_size": batch_size, "speculative": None, **latency_fields(timelines, ended - start),
               "window_s": [round(start, 3), round(ended, 3)], "errors": errors}
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
    return {"url": args.url, "model": model, "rows": rows, "client": "asyncio, a keep-alive connection per slot"}
