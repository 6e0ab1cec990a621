"""The OpenAI-compatible HTTP app (FastAPI): chat and text completions (streamed as server-sent events
or whole), models, health and metrics, in front of the verifier's gRPC stream.

A request's path: the body is read (at most --max-request-body-bytes) and checked (protocol.py); it
waits for the tokenizer together with the requests that arrived in the same event-loop turn (one
batch, rendered and encoded in a worker thread); its length is checked against the verifier's context;
its n choices are submitted on the shared gRPC stream; deltas are detokenized incrementally, stop
strings are matched across token boundaries (a hit aborts the verifier request at once), and the
answer is streamed or assembled. A client that disconnects has its requests aborted in the verifier.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from splitspec import heap
from splitspec.gateway.body import BodyError, parse_body
from splitspec.gateway.client import StreamBroken, VerifierClient
from splitspec.gateway.metrics import GatewayMetrics
from splitspec.gateway.protocol import APIError, Generation, invalid, parse_chat, parse_completion, request_schemas
from splitspec.gateway.text import IncrementalDecoder, StopMatcher, TemplateError, TextCodec
from splitspec.protos import verifier_pb2 as pb

logger = logging.getLogger("splitspec.gateway")

FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}
GRPC_INVALID_ARGUMENT, GRPC_RESOURCE_EXHAUSTED = 3, 8


@dataclass
class GatewayConfig:
    verifier: str = "127.0.0.1:30001"
    tokenizer_path: str | None = None
    served_model_name: str | None = None
    api_key: str | None = None
    max_queued_requests: int = 1024
    max_request_body_bytes: int = 8 << 20
    tokenizer_threads: int = 2


class Tokenizing:
    """Requests are rendered and encoded in batches, in a worker thread (the event loop never runs the
    tokenizer): those that arrive in the same event-loop turn, and those that arrive while a batch is
    being encoded, go together in the next batch."""

    def __init__(self, codec: TextCodec, threads: int, batch_metric=None):
        self.codec = codec
        self.batch_metric = batch_metric
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")
        self.pending: list[tuple[list[dict] | str, asyncio.Future]] = []
        self.busy = False
        self.scheduled = False

    async def prompt_ids(self, job: list[dict] | str | list[int]) -> list[int]:
        """job: chat messages, a completion text, or token ids (returned as they are)."""
        if isinstance(job, list) and (not job or isinstance(job[0], int)):
            return job
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.pending.append((job, future))
        if not self.busy and not self.scheduled:
            self.scheduled = True
            loop.call_soon(self._flush)
        return await future

    def _flush(self) -> None:
        self.scheduled = False
        if not self.pending:
            return
        jobs, self.pending = self.pending, []
        self.busy = True
        if self.batch_metric is not None:
            self.batch_metric.observe(len(jobs))
        work = asyncio.get_running_loop().run_in_executor(self.executor, self._work, [job for job, _ in jobs])

        def resolve(done: asyncio.Future) -> None:
            results = done.result() if done.exception() is None else [done.exception()] * len(jobs)
            for (_, future), result in zip(jobs, results):
                if future.done():
                    continue
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)
            self.busy = False
            self._flush()  # whatever arrived meanwhile

        work.add_done_callback(resolve)

    def _work(self, jobs: list[list[dict] | str]) -> list:
        texts, results = [], []
        for job in jobs:
            try:
                texts.append((job, True) if isinstance(job, str) else (self.codec.render_chat(job), False))
                results.append(None)
            except TemplateError as exc:
                texts.append(None)
                results.append(invalid("messages", str(exc)))
        for special in (False, True):
            index = [i for i, t in enumerate(texts) if t is not None and t[1] is special]
            if not index:
                continue
            try:
                encoded = self.codec.encode_batch([texts[i][0] for i in index], add_special_tokens=special)
            except Exception:  # noqa: BLE001 (one bad text fails the batch: encode one by one to find it)
                encoded = []
                for i in index:
                    try:
                        encoded.append(self.codec.encode_batch([texts[i][0]], add_special_tokens=special)[0])
                    except Exception as exc:  # noqa: BLE001
                        encoded.append(invalid("prompt" if isinstance(jobs[i], str) else "messages",
                                               f"the text cannot be tokenized: {exc}"))
            for i, ids in zip(index, encoded):
                results[i] = ids
        return results


@dataclass
class Choice:
    index: int
    request_id: str
    decoder: IncrementalDecoder
    stop: StopMatcher
    queue: asyncio.Queue | None = None
    tokens: int = 0
    text: str = ""
    finish_reason: str | None = None
    logprobs: list = field(default_factory=list)  # (token_id, logprob, top [(id, lp)], text_offset)
    speculation: pb.SpeculationCounts | None = None
    cached_tokens: int = 0
    error: APIError | None = None


class LatencyClock:
    """A request's latency metrics: time to first token, the gaps between token deliveries, end to end."""

    def __init__(self, metrics: GatewayMetrics, arrival: float):
        self.metrics, self.arrival = metrics, arrival
        self.last: float | None = None

    def delivered(self, delta) -> None:
        if isinstance(delta, StreamBroken) or not delta.token_ids:
            return
        now = time.perf_counter()
        model = self.metrics.model
        if self.last is None:
            self.metrics.ttft.labels(**model).observe(now - self.arrival)
        else:
            self.metrics.itl.labels(**model).observe(now - self.last)
        self.last = now

    def done(self) -> None:
        self.metrics.e2e.labels(**self.metrics.model).observe(time.perf_counter() - self.arrival)


class Gateway:
    def __init__(self, config: GatewayConfig, codec: TextCodec | None = None):
        self.config = config
        self.codec = codec
        self.client: VerifierClient | None = None
        self.metrics: GatewayMetrics | None = None
        self.tokenizing: Tokenizing | None = None
        self.created = int(time.time())
        self.model_name = config.served_model_name
        self.ready = False
        self.admitted = 0  # choices admitted and not yet finished (the --max-queued-requests budget)
        self._connector: asyncio.Task | None = None

    # lifecycle ---------------------------------------------------------------------------------------
    async def start(self) -> None:
        self.client = VerifierClient(self.config.verifier, on_grpc_error=self._grpc_error)
        self._connector = asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        """Wait for the verifier's model info (it may start after the gateway), then serve."""
        delay = 0.2
        while True:
            try:
                info = await self.client.model_info()
                break
            except Exception as exc:  # noqa: BLE001 (grpc.aio raises several kinds while the verifier is down)
                logger.info("waiting for the verifier at %s (%s)", self.config.verifier, type(exc).__name__)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
        self.model_name = self.model_name or info.model_id
        if self.codec is None:
            self.codec = TextCodec(self.config.tokenizer_path or info.model_path)
        if self.metrics is None:
            self.metrics = GatewayMetrics(self.model_name)
        self.tokenizing = Tokenizing(self.codec, self.config.tokenizer_threads,
                                     self.metrics.tokenize_batch.labels(**self.metrics.model))
        heap.freeze("gateway")
        self.ready = True
        logger.info("serving %s (context %d tokens, speculation %s) from the verifier at %s", self.model_name,
                     info.max_context_tokens, info.speculative_algorithm or "off", self.config.verifier)

    async def stop(self) -> None:
        if self._connector is not None:
            self._connector.cancel()
        if self.client is not None:
            await self.client.close()

    def _grpc_error(self, code: str) -> None:
        if self.metrics is not None:
            self.metrics.grpc_errors.labels(code).inc()

    # requests ----------------------------------------------------------------------------------------
    def check_ready(self) -> None:
        if not self.ready:
            raise APIError(503, "the verifier is not ready yet", "service_unavailable", code="verifier_unavailable",
                           headers={"Retry-After": "1"})

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"The model '{name}' does not exist (this server serves '{self.model_name}')",
                           "invalid_request_error", "model", "model_not_found")

    def admit(self, g: Generation) -> int:
        """Reserve the request's choices in the queue budget (released by release())."""
        self.check_ready()
        self.check_model(g.model)
        n = g.n * max(1, len(g.prompts))
        if self.admitted + n > self.config.max_queued_requests:
            raise APIError(429, f"the server is at its limit of {self.config.max_queued_requests} queued requests; "
                           "retry shortly", "rate_limit_exceeded", code="queue_full", headers={"Retry-After": "1"})
        self.admitted += n
        return n

    def release(self, n: int) -> None:
        self.admitted -= n

    async def prepare(self, g: Generation) -> list[list[int]]:
        """The request's prompts as token ids, each checked against the context."""
        jobs = [g.messages] if g.messages is not None else g.prompts
        prompts = await asyncio.gather(*(self.tokenizing.prompt_ids(job) for job in jobs))
        context = self.client.info.max_context_tokens
        for i, prompt in enumerate(prompts):
            where = "messages" if g.messages is not None else "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            if not prompt:
                raise invalid(where, "the prompt is empty after tokenization")
            if len(prompt) >= context:
                raise invalid(where, f"This model's maximum context length is {context} tokens; the prompt has "
                              f"{len(prompt)} tokens", "context_length_exceeded")
            if g.max_tokens is not None and len(prompt) + g.max_tokens > context:
                raise invalid("max_tokens", f"This model's maximum context length is {context} tokens; the prompt has "
                              f"{len(prompt)} tokens and max_tokens asks for {g.max_tokens} more", "context_length_exceeded")
        return list(prompts)

    def submit(self, g: Generation, prompts: list[list[int]]) -> list[Choice]:
        """n choices per prompt, indexed prompt by prompt (OpenAI's order for a batch)."""
        base = self.client.new_id(uuid.uuid4().hex[:12])
        choices = []
        context = self.client.info.max_context_tokens
        for index in range(len(prompts) * g.n):
            prompt, i = prompts[index // g.n], index % g.n
            sampling = pb.SamplingParams(
                temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                max_new_tokens=g.max_tokens if g.max_tokens is not None else context - len(prompt),
                ignore_eos=g.ignore_eos, frequency_penalty=g.frequency_penalty, presence_penalty=g.presence_penalty)
            if g.seed is not None:
                sampling.seed = (g.seed + i) % (2**63 - 1)  # each choice its own sample, reproducibly
            if g.repetition_penalty != 1.0:
                sampling.repetition_penalty = g.repetition_penalty
            if g.logprobs:
                sampling.top_logprobs = g.top_logprobs
            choice = Choice(index, f"{base}-{index}", IncrementalDecoder(self.codec), StopMatcher(g.stop))
            choice.queue = self.client.submit(choice.request_id, prompt, sampling, g.speculative)
            choices.append(choice)
        self.metrics.prompt_tokens.labels(**self.metrics.model).inc(sum(len(p) for p in prompts))
        return choices

    def absorb(self, choice: Choice, delta: pb.TokenDelta | StreamBroken) -> str:
        """Apply one delta to a choice; returns the text that may be sent now."""
        if isinstance(delta, StreamBroken):
            choice.finish_reason = "error"
            choice.error = APIError(503, f"the verifier became unavailable ({delta.code}: {delta.details})",
                                    "service_unavailable", code="verifier_unavailable")
            return ""
        out = []
        for j, token in enumerate(delta.token_ids):
            if choice.stop.hit is not None:
                break
            offset = len(choice.text) + sum(len(p) for p in out)
            choice.tokens += 1
            if j < len(delta.logprobs):
                lp = delta.logprobs[j]
                choice.logprobs.append((token, lp.logprob, list(zip(lp.top_token_ids, lp.top_logprobs)), offset))
            out.append(choice.stop.feed(choice.decoder.step(token)))
        if delta.HasField("speculation"):
            choice.speculation = delta.speculation
        choice.cached_tokens = max(choice.cached_tokens, delta.cached_prompt_tokens)
        if choice.stop.hit is not None and choice.finish_reason is None:
            choice.finish_reason = "stop"
            self.client.abort(choice.request_id)
            self.metrics.aborts.labels("stop_string").inc()
        elif delta.finish_reason != pb.FINISH_REASON_UNSPECIFIED and choice.finish_reason is None:
            if delta.finish_reason == pb.FINISH_REASON_ERROR:
                choice.finish_reason = "error"
                status = 400 if delta.error_code in (GRPC_INVALID_ARGUMENT, GRPC_RESOURCE_EXHAUSTED) else 503
                choice.error = APIError(status, f"the verifier refused the request: {delta.error}",
                                        "invalid_request_error" if status == 400 else "service_unavailable")
            else:
                choice.finish_reason = FINISH.get(delta.finish_reason, "stop")
                out.append(choice.stop.feed(choice.decoder.flush()))
                out.append(choice.stop.finish())
            self.client.done(choice.request_id)
        piece = "".join(out)
        choice.text += piece
        return piece

    def finished(self, choice: Choice) -> None:
        self.metrics.completion_tokens.labels(**self.metrics.model).inc(choice.tokens)
        self.metrics.finished.labels(finish_reason=choice.finish_reason or "abort", **self.metrics.model).inc()

    def abort_unfinished(self, choices: list[Choice], cause: str) -> None:
        for choice in choices:
            if choice.finish_reason is None:
                choice.finish_reason = "abort"
                self.client.abort(choice.request_id)
                self.metrics.aborts.labels(cause).inc()

    # response pieces -----------------------------------------------------------------------------------
    def speculative(self, choices: list[Choice], g: Generation) -> dict:
        counts = [c.speculation for c in choices if c.speculation is not None]
        steps = sum(c.verify_steps for c in counts)
        accepted = sum(c.accepted_tokens for c in counts)
        algorithm = self.client.info.speculative_algorithm or None
        return {"algorithm": algorithm if g.speculative else None, "verify_steps": steps,
                "draft_tokens": sum(c.draft_tokens for c in counts), "accepted_tokens": accepted,
                "mean_accept_length": round(1 + accepted / steps, 4) if steps else None}

    def usage(self, choices: list[Choice], prompts: list[list[int]]) -> dict:
        completion = sum(c.tokens for c in choices)
        prompt = sum(len(p) for p in prompts)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": max((c.cached_tokens for c in choices), default=0)}}

    def chat_logprobs(self, entries: list) -> dict:
        def item(token, lp):
            raw = self.codec.token_bytes(token)
            return {"token": raw.decode("utf-8", errors="replace"), "logprob": max(lp, -9999.0), "bytes": list(raw)}

        return {"content": [{**item(t, lp), "top_logprobs": [item(i, v) for i, v in top]} for t, lp, top, _ in entries],
                "refusal": None}

    def completion_logprobs(self, entries: list, base_offset: int = 0) -> dict:
        return {"tokens": [self.codec.token_text(t) for t, _, _, _ in entries],
                "token_logprobs": [max(lp, -9999.0) for _, lp, _, _ in entries],
                "top_logprobs": [{self.codec.token_text(i): max(v, -9999.0) for i, v in top} for _, _, top, _ in entries],
                "text_offset": [base_offset + off for _, _, _, off in entries]}


def create_app(config: GatewayConfig, codec: TextCodec | None = None) -> FastAPI:
    gateway = Gateway(config, codec)

    @asynccontextmanager
    async def lifespan(_app):
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    app = FastAPI(title="splitspec gateway", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.gateway = gateway

    def openapi() -> dict:
        """The OpenAPI document: request bodies are the models that check them (protocol.py); once the
        verifier is known, the served model's name and the vocabulary bound `model` and token ids."""
        if app.openapi_schema is not None:
            return app.openapi_schema
        from splitspec import __version__

        document = get_openapi(title=app.title, version=__version__, routes=app.routes,
                               description="OpenAI-compatible completions in front of a speculative-decoding verifier")
        info = gateway.client.info if gateway.ready else None
        schemas = request_schemas(gateway.model_name if info else None, info.vocab_size if info else None)
        document.setdefault("components", {}).setdefault("schemas", {}).update(schemas)
        if info is not None:
            app.openapi_schema = document  # final: what the verifier serves does not change
        return document

    app.openapi = openapi

    def error_response(exc: APIError, endpoint: str) -> JSONResponse:
        if gateway.metrics is not None:
            gateway.metrics.http.labels(endpoint, str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request_error")
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(APIError(exc.status_code, message, "invalid_request_error", code=kind).body(),
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("internal error on %s %s", request.method, request.url.path)
        return JSONResponse(APIError(500, f"internal error: {type(exc).__name__}", "server_error", code="internal_error")
                            .body(), status_code=500)

    def authorized(request: Request) -> None:
        if config.api_key is not None and not hmac.compare_digest(  # constant time: no key guessing by timing
                request.headers.get("authorization", "").encode(), f"Bearer {config.api_key}".encode()):
            raise APIError(401, "Incorrect or missing API key (send 'Authorization: Bearer <key>')",
                           "invalid_request_error", code="invalid_api_key")

    async def read_body(request: Request):
        authorized(request)
        limit = config.max_request_body_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise APIError(413, f"the request body is larger than {limit} bytes", "invalid_request_error",
                           code="request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"the request body is larger than {limit} bytes", "invalid_request_error",
                               code="request_too_large")
            chunks.append(chunk)
        try:
            return parse_body(b"".join(chunks))
        except BodyError as exc:
            raise invalid(None, str(exc), "invalid_json") from None

    async def watch_disconnect(request: Request, task: asyncio.Task, gone: asyncio.Event) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                gone.set()
                task.cancel()
                return

    async def generate(request: Request, endpoint: str, chat: bool):
        arrival = time.perf_counter()
        admitted = 0
        try:
            body = await read_body(request)
            gateway.check_ready()
            g = parse_chat(body) if chat else parse_completion(body, gateway.client.info.vocab_size)
            admitted = gateway.admit(g)
            prompts = await gateway.prepare(g)
        except APIError as exc:
            gateway.release(admitted)
            return error_response(exc, endpoint)
        except BaseException:
            gateway.release(admitted)
            raise
        choices = gateway.submit(g, prompts)
        gateway.metrics.in_flight.labels(**gateway.metrics.model).inc()
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        if g.stream:
            gateway.metrics.http.labels(endpoint, "200").inc()
            return StreamingResponse(stream(g, prompts, choices, rid, chat, arrival, admitted), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        task, gone = asyncio.current_task(), asyncio.Event()
        watcher = asyncio.get_running_loop().create_task(watch_disconnect(request, task, gone))
        try:
            await collect(choices, arrival)
        except asyncio.CancelledError:
            gateway.abort_unfinished(choices, "disconnect")
            if not gone.is_set():  # the server is shutting down: the cancellation is not ours to swallow
                raise
            task.uncancel()  # the client went away: an ordinary end (no traceback), answered to no one
            gateway.metrics.http.labels(endpoint, "499").inc()
            return Response(status_code=499)
        finally:
            watcher.cancel()
            gateway.release(admitted)
            gateway.metrics.in_flight.labels(**gateway.metrics.model).dec()
        for choice in choices:
            gateway.finished(choice)
        failed = next((c.error for c in choices if c.error is not None), None)
        if failed is not None:
            return error_response(failed, endpoint)
        gateway.metrics.http.labels(endpoint, "200").inc()
        return JSONResponse(whole_response(g, prompts, choices, rid, chat))

    async def collect(choices: list[Choice], arrival: float) -> None:
        clock = LatencyClock(gateway.metrics, arrival)
        for choice in choices:
            while choice.finish_reason is None:
                delta = await choice.queue.get()
                clock.delivered(delta)
                gateway.absorb(choice, delta)
        clock.done()

    def whole_response(g: Generation, prompts: list[list[int]], choices: list[Choice], rid: str, chat: bool) -> dict:
        body = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": gateway.model_name, "choices": [], "usage": gateway.usage(choices, prompts),
                "speculative": gateway.speculative(choices, g)}
        for c in choices:
            finish = c.finish_reason if c.finish_reason in ("stop", "length") else "stop"
            if chat:
                body["choices"].append({"index": c.index, "message": {"role": "assistant", "content": c.text, "refusal": None},
                                        "finish_reason": finish,
                                        "logprobs": gateway.chat_logprobs(c.logprobs) if g.logprobs else None})
            else:
                body["choices"].append({"index": c.index, "text": c.text, "finish_reason": finish,
                                        "logprobs": gateway.completion_logprobs(c.logprobs) if g.logprobs else None})
        return body

    async def stream(g: Generation, prompts: list[list[int]], choices: list[Choice], rid: str, chat: bool, arrival: float,
                     admitted: int):
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choice_body: dict | None, **extra) -> str:
            body = {"id": rid, "object": kind, "created": created, "model": gateway.model_name,
                    "choices": [choice_body] if choice_body is not None else []}
            if g.include_usage and chat:  # chat chunks carry usage null until the last (completions: absent)
                body["usage"] = None
            body.update(extra)
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        def piece_body(c: Choice, text: str, entries: list, finish: str | None) -> dict:
            if chat:
                return {"index": c.index, "delta": {"content": text} if text or finish is None else {},
                        "finish_reason": finish, "logprobs": gateway.chat_logprobs(entries) if g.logprobs and entries else None}
            return {"index": c.index, "text": text, "finish_reason": finish,
                    "logprobs": gateway.completion_logprobs(entries) if g.logprobs and entries else None}

        queue: asyncio.Queue = asyncio.Queue()  # (choice, delta) from every choice, in arrival order

        async def pump(c: Choice):
            while True:
                delta = await c.queue.get()
                await queue.put((c, delta))
                if isinstance(delta, StreamBroken) or delta.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    return

        pumps = [asyncio.get_running_loop().create_task(pump(c)) for c in choices]
        clock, sent_done = LatencyClock(gateway.metrics, arrival), False
        try:
            if chat:
                for c in choices:
                    yield chunk({"index": c.index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                                 "logprobs": None})
            open_choices = len(choices)
            while open_choices:
                c, delta = await queue.get()
                if c.finish_reason is not None:  # stopped by a stop string; later deltas are dropped
                    continue
                before = len(c.logprobs)
                text = gateway.absorb(c, delta)
                clock.delivered(delta)
                if c.error is not None:
                    open_choices -= 1
                    gateway.finished(c)
                    gateway.abort_unfinished(choices, "error")
                    yield f"data: {json.dumps(c.error.body())}\n\n"
                    break
                entries = c.logprobs[before:]
                finish = c.finish_reason if c.finish_reason in ("stop", "length") else None
                if text or entries:
                    yield chunk(piece_body(c, text, entries, None))
                if c.finish_reason is not None:
                    open_choices -= 1
                    gateway.finished(c)
                    yield chunk(piece_body(c, "", [], finish or "stop"), speculative=gateway.speculative([c], g))
            else:
                clock.done()
                if g.include_usage:
                    body = {"id": rid, "object": kind, "created": created, "model": gateway.model_name, "choices": [],
                            "usage": gateway.usage(choices, prompts)}
                    yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"
            sent_done = True
        finally:
            for task in pumps:
                task.cancel()
            if not sent_done:
                gateway.abort_unfinished(choices, "disconnect")
            gateway.release(admitted)
            gateway.metrics.in_flight.labels(**gateway.metrics.model).dec()

    def documented(model: str) -> dict:
        error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
        return {"openapi_extra": {"requestBody": {"required": True, "content": {
            "application/json": {"schema": {"$ref": f"#/components/schemas/{model}"}}}}}, "responses": {
            200: {"description": "the completion, whole (application/json) or streamed (text/event-stream)",
                  "content": {"application/json": {}, "text/event-stream": {}}},
            **{status: {"description": why, "content": error} for status, why in (
                (400, "the request is invalid"), (401, "a wrong or missing API key"), (404, "no such model"),
                (413, "the body is too large"), (429, "the queue is full; retry after Retry-After seconds"),
                (503, "the verifier is unavailable"))}}}

    @app.post("/v1/chat/completions", **documented("ChatCompletionRequest"))
    async def chat_completions(request: Request):
        return await generate(request, "/v1/chat/completions", chat=True)

    @app.post("/v1/completions", **documented("CompletionRequest"))
    async def completions(request: Request):
        return await generate(request, "/v1/completions", chat=False)

    def model_card() -> dict:
        info = gateway.client.info
        return {"id": gateway.model_name, "object": "model", "created": gateway.created, "owned_by": "splitspec",
                "root": info.model_path, "max_model_len": info.max_context_tokens}

    @app.get("/v1/models")
    async def models(request: Request):
        try:
            authorized(request)
            gateway.check_ready()
        except APIError as exc:
            return error_response(exc, "/v1/models")
        gateway.metrics.http.labels("/v1/models", "200").inc()
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        try:
            authorized(request)
            gateway.check_ready()
            gateway.check_model(model_id)
        except APIError as exc:
            return error_response(exc, "/v1/models/{model}")
        gateway.metrics.http.labels("/v1/models/{model}", "200").inc()
        return model_card()

    @app.get("/health")
    async def health():
        if gateway.ready and await gateway.client.serving():
            return Response(status_code=200)
        return JSONResponse(APIError(503, "the verifier is not serving", "service_unavailable",
                                     code="verifier_unavailable").body(), status_code=503)

    @app.get("/metrics")
    async def metrics():
        if gateway.metrics is None:
            return Response(b"", media_type=CONTENT_TYPE_LATEST)
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
