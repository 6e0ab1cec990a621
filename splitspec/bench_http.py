"""`splitspec bench --url`: a running deployment measured over its OpenAI HTTP API with streaming (plain
requests opt out with "speculative": false). One asyncio event loop drives every concurrent request, each
slot over its own keep-alive connection, as the field's serving benchmarks do (SGLang's bench_serving, vLLM's
benchmark_serving: aiohttp), on uvloop where installed; responses are parsed by httptools' C parser (uvicorn's)
in the connection's protocol callbacks as their bytes arrive (benchmarks/client_cost.py: 40-42 us of the client's
CPU per streamed token with h11 and a task woken per event, 14-16 with this). A thread per request on a new
connection, as before, was itself a queue under a burst: on this project's 2-core machine a 64-request burst reached
a bare server 26-28 ms after its start on the mean that way, 4.5-6.9 ms on this client's kept-alive connections
(benchmarks/client_burst.py)."""

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

import httptools

from splitspec import event_loop
from splitspec.bench_measure import Timeline, drafted_token_share, latency_fields, make_prompts, prompts_for, round_prompts
from splitspec.step_log import StepLog

logger = logging.getLogger("splitspec.bench")

TIMEOUT_S = 600.0  # a connection that cannot open, or a server silent this long, fails the request
_DECODE = json.JSONDecoder().raw_decode  # json.loads less its bytes-encoding guess and trailing-text check
CONNECTIONS: weakref.WeakSet = weakref.WeakSet()  # what `kill -USR2` reports on (where a stuck point waits)


class HttpError(RuntimeError):
    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


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
        self.header_lines = "".join(f"{name}: {value}\r\n" for name, value in self.headers.items())

    def get(self, path: str) -> dict:
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        conn = cls(self.host, self.port, timeout=TIMEOUT_S)
        try:
            conn.request("GET", path, headers=self.headers)
            response = conn.getresponse()
            body = response.read()
            if response.status != 200:
                raise HttpError(f"GET {path}: HTTP {response.status}: {body[:200]!r}", response.status)
            return json.loads(body)
        finally:
            conn.close()

    def connection(self) -> Connection:
        return Connection(self)


class Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection (opened on first use, opened again when the server closes it), read by
    httptools' C parser as the bytes arrive: a response's events are taken in the protocol's callbacks, with no
    task woken per event (the client's own cost per streamed token is what it adds to a served point's edges)."""

    def __init__(self, http_: Http):
        self.http = http_
        self.transport: asyncio.Transport | None = None
        self.response: _Response | None = None  # the request out on this connection, until its end
        self.request: int | None = None  # the body's seed (its index in the point) while a request is out
        self.opened = self.received = 0  # connections opened, bytes received on this one
        self.last_read = time.perf_counter()
        CONNECTIONS.add(self)

    def state(self) -> str:
        r = self.response
        h = "closed" if self.transport is None else "idle" if r is None else \
            f"status {r.status or 'awaited'}, {'ended' if r.done.done() else 'open'}"
        local = self.transport.get_extra_info("sockname") if self.transport is not None else None
        return (f"request {self.request} on {local}: {h}, opened {self.opened}x, {self.received} bytes in, last read "
                f"{time.perf_counter() - self.last_read:.1f} s ago")

    # asyncio.Protocol -------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        self.received += len(data)
        self.last_read = time.perf_counter()
        if self.response is None:
            return  # nothing asked: bytes between responses are the server's, dropped with the connection
        self.response.feed(data, self.last_read)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.response is not None:
            self.response.lost()

    # the client's side ------------------------------------------------------------------------------
    async def _open(self) -> None:
        context = ssl.create_default_context() if self.http.https else None
        self.transport, _ = await asyncio.wait_for(asyncio.get_running_loop().create_connection(
            lambda: self, self.http.host, self.http.port, ssl=context), TIMEOUT_S)
        self.opened += 1
        self.received = 0

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self.transport = None

    async def stream(self, body: dict, timeline: Timeline) -> dict:
        """POST /v1/completions with stream=true; records each delivery; returns the last chunk's extras. A kept-alive
        connection the server closed meanwhile is opened again and the request sent again (no response had begun)."""
        payload = json.dumps(body).encode()
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {self.http.host}:{self.http.port}\r\n" \
               f"Content-Length: {len(payload)}\r\n{self.http.header_lines}\r\n"
        timeline.sent = time.perf_counter()
        self.request = body.get("seed")
        try:
            for attempt in (0, 1):
                reused = self.transport is not None
                if not reused:
                    await self._open()
                self.response = response = _Response(timeline)
                self.last_read = time.perf_counter()
                self.transport.write(head.encode() + payload)
                await self._wait(response)
                unanswered = not response.status and response.failure is None  # closed before any answer
                if not (unanswered and reused and attempt == 0):
                    break  # else a kept-alive connection the server had closed: the request goes again, once
            if unanswered:
                raise RuntimeError("the server closed the connection")
            if response.failure is not None:
                raise RuntimeError(response.failure)
            if response.error_body is not None:
                raise RuntimeError(f"HTTP {response.status}: {bytes(response.error_body[:300])!r}")
        except BaseException:
            self.close()
            raise
        finally:
            self.response, self.request = None, None
        if not response.keep_alive:
            self.close()
        return response.extras

    async def _wait(self, response: _Response) -> None:
        while not response.done.done():
            remaining = TIMEOUT_S - (time.perf_counter() - self.last_read)
            if remaining <= 0:
                raise RuntimeError(f"nothing from the server for {TIMEOUT_S:g} s")
            await asyncio.wait([response.done], timeout=remaining)


class _Response:
    """One response as httptools parses it: its status, then its server-sent events taken as they arrive (each one
    with text a delivery at the time its bytes were read), or an error status's body kept for the report."""

    def __init__(self, timeline: Timeline):
        self.timeline, self.extras = timeline, {}
        self.parser = httptools.HttpResponseParser(self)
        self.done = asyncio.get_running_loop().create_future()
        self.status = 0
        self.keep_alive = False
        self.error_body: bytearray | None = None
        self.failure: str | None = None  # why the response cannot be read (a cut or malformed message, a stream error)
        self.buffer, self.now = b"", 0.0
        self.by_close = True  # the body ends when the connection does (no length, not chunked)

    def feed(self, data: bytes, now: float) -> None:
        self.now = now
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError:
            pass  # a callback's failure, already noted
        except httptools.HttpParserError as exc:
            self._end(f"the server's response is malformed: {exc}")

    def lost(self) -> None:
        if self.status and self.by_close and self.failure is None:
            self.on_message_complete()  # a body delimited by the connection's end
        elif self.status:
            self._end("the server closed the connection mid-stream")
        else:
            self._end(None)  # closed before any answer: stream() decides whether it goes again

    def _end(self, failure: str | None) -> None:
        if not self.done.done():
            self.failure = failure
            self.done.set_result(None)

    # httptools' callbacks ----------------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() in (b"content-length", b"transfer-encoding"):
            self.by_close = False

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        if self.status != 200:
            self.error_body = bytearray()

    def on_body(self, body: bytes) -> None:
        if self.error_body is not None:
            self.error_body += body
            return
        if self.failure is not None:
            return
        *lines, self.buffer = (self.buffer + body).split(b"\n")
        try:
            for raw in lines:
                self._event(raw)
        except Exception as exc:  # noqa: BLE001 (the request's failure, reported in its row)
            self._end(str(exc))

    def _event(self, raw: bytes) -> None:
        line = raw.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            return
        chunk = _DECODE(line.decode(), 6)[0]  # the event's JSON, read where it starts
        if "error" in chunk:
            raise RuntimeError(f"stream error: {chunk['error']}")
        if chunk.get("choices") and chunk["choices"][0].get("text"):
            self.timeline.deliveries.append((self.now, 1))  # token counts per delivery are not on the wire
        if "speculative" in chunk:
            self.extras["speculative"] = chunk["speculative"]
        if chunk.get("usage"):
            self.extras["usage"] = chunk["usage"]

    def on_message_complete(self) -> None:
        tokens = (self.extras.get("usage") or {}).get("completion_tokens")
        deliveries = self.timeline.deliveries
        if tokens and deliveries and self.error_body is None:  # spread the count over the deliveries
            t, n = deliveries[-1]
            deliveries[-1] = (t, n + max(0, tokens - len(deliveries)))
        self._end(self.failure)


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


def _measure(client: Http, model: str, args, prompts: list, batch_size: int, speculative: bool, log) -> dict:
    """One round of one point: its warm-up, then every prompt at `batch_size` at a time. What it saw, unpooled."""
    bodies = [{"model": model, "prompt": p, "max_tokens": args.output_len, "stream": True,
               "temperature": args.temperature, "seed": i, "ignore_eos": True, "speculative": speculative,
               "stream_options": {"include_usage": True}} for i, p in enumerate(prompts)]
    timelines = [Timeline() for _ in prompts]
    extras: list[dict] = [{} for _ in prompts]
    errors: list[str] = []
    warm = [{"model": model, "prompt": prompts[w % len(prompts)], "max_tokens": 8, "stream": True,
             "temperature": 0, "ignore_eos": True, "speculative": speculative}
            for w in range(args.warmup_requests)]
    event_loop.run(_warm(client, warm))
    cpu = time.process_time()
    start, ended = event_loop.run(_point(client, bodies, batch_size, timelines, extras, errors))
    cpu = time.process_time() - cpu  # this client's own CPU over the point's requests (its start and warm-up apart)
    if log is not None:
        log.point(batch_size, speculative, start, ended, timelines)
    return {"timelines": timelines, "extras": extras, "errors": errors, "window": (start, ended), "cpu_s": cpu}


def _row(batch_size: int, speculative: bool, rounds: list[dict]) -> dict:
    """A point's row from its rounds pooled: every request's timeline, tokens over the rounds' summed wall time."""
    timelines = [t for r in rounds for t in r["timelines"]]
    extras = [e for r in rounds for e in r["extras"]]
    wall = sum(r["window"][1] - r["window"][0] for r in rounds)
    windows = [[round(a, 3), round(b, 3)] for a, b in (r["window"] for r in rounds)]
    row = {"batch_size": batch_size, "speculative": None, **latency_fields(timelines, wall),
           "window_s": [windows[0][0], windows[-1][1]], "windows_s": windows,
           "errors": [e for r in rounds for e in r["errors"]]}
    if len(rounds) > 1:
        row["rounds_tok_s"] = [latency_fields(r["timelines"], r["window"][1] - r["window"][0])["output_tok_s"]
                               for r in rounds]
    # the load's client's own CPU over the point: per request, and as a share of one core over the point's wall (near 1:
    # the client, one Python thread, is what limits the point, not the server)
    cpu = sum(r["cpu_s"] for r in rounds)
    row["client_cpu"] = {"ms_per_request": round(1e3 * cpu / max(len(timelines), 1), 3),
                         "share_of_wall": round(cpu / wall, 5) if wall > 0 else None}
    row["prompt_tokens_mean"] = round(statistics.fmean(
        [e["usage"]["prompt_tokens"] for e in extras if e.get("usage")] or [0]), 1)
    if speculative:
        counts = [e["speculative"] for e in extras if e.get("speculative")]
        steps = sum(c["verify_steps"] for c in counts)
        accepted = sum(c["accepted_tokens"] for c in counts)
        row.update(speculative=next((c["algorithm"] for c in counts if c.get("algorithm")), "off"),
                   verify_steps=steps, accepted_tokens=accepted,
                   accept_length=round(1 + accepted / steps, 4) if steps else None,
                   drafted_token_share=drafted_token_share(steps, accepted, row["output_tokens"]))
    return row


def _speedup(row: dict, plain: dict) -> float | None:
    """Speculative over plain tok/s: over one round each, their ratio; over several, the median of each round's ratio
    to the plain round just before it (a host whose speed drifts over minutes then weighs on both sides of a pair alike)."""
    pairs = [s / p for s, p in zip(row.get("rounds_tok_s") or [row["output_tok_s"]],
                                   plain.get("rounds_tok_s") or [plain["output_tok_s"]]) if s and p]
    return round(statistics.median(pairs), 3) if pairs else None


def wait_ready(client: Http, timeout: float, url: str, interval: float = 1.0) -> dict:
    """GET /v1/models until it answers (vLLM's bench serve waits for its endpoint so, --ready-check-timeout-sec): a
    server still starting (no listener yet, or 503 while its verifier loads) is waited for up to timeout seconds, saying
    so once; any other error, or still not ready at the deadline, raises."""
    deadline, said = time.monotonic() + timeout, False
    while True:
        try:
            return client.get("/v1/models")
        except (HttpError, OSError) as exc:
            starting = isinstance(exc, OSError) or exc.status == 503
            if not starting or time.monotonic() + interval > deadline:
                if starting and timeout > 0:
                    raise RuntimeError(f"{url} was not ready after {timeout:.0f} s (--ready-check-timeout-sec): {exc}") from exc
                raise
            if not said:
                logger.info("waiting up to %.0f s for %s to be ready (%s)", timeout, url, exc)
                said = True
            time.sleep(interval)


def run_remote(args) -> dict:
    client = Http(args.url, args.api_key)
    models = wait_ready(client, args.ready_check_timeout_sec, args.url)
    model = models["data"][0]["id"]
    batch_sizes = [int(b) for b in args.batch_size.split(",")]
    counts = {b: args.num_prompts or max(4, 2 * b) for b in batch_sizes}
    local = Path(args.model_path) if args.model_path else None
    # every round and batch size its own prompts (the held-out texts' next windows: round_prompts)
    first = args.first_round
    prompts_all = make_prompts(args, local, None, prompts_for(counts, first + args.rounds))
    rounds = [round_prompts(prompts_all, counts, first + r) for r in range(args.rounds)]
    rows = []
    log = StepLog.from_env("client")  # SPLITSPEC_STEP_LOG
    for batch_size in batch_sizes:
        # plain and speculative alternate, round after round, at each batch size
        measured: dict[bool, list[dict]] = {False: [], True: []}
        for r, speculative in itertools.product(range(args.rounds), (False, True)):
            measured[speculative].append(_measure(client, model, args, rounds[r][batch_size],
                                                  batch_size, speculative, log))
        plain, spec = (_row(batch_size, s, measured[s]) for s in (False, True))
        spec["speedup"] = _speedup(spec, plain)
        for row in (plain, spec):
            rows.append(row)
            logger.info("batch %d %s: %s tok/s (rounds %s), ttft %s ms", batch_size,
                        "speculative" if row["speculative"] else "plain", row["output_tok_s"],
                        row.get("rounds_tok_s", "1"), (row["ttft_ms"] or {}).get("p50"))
    return {"url": args.url, "model": model, "rows": rows, "client": "asyncio, a keep-alive connection per slot",
            "rounds": args.rounds, "first_round": first}
