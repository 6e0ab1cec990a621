"""The OpenAI-compatible HTTP app (FastAPI): chat and text completions (streamed as server-sent events
or whole), models, health and metrics, in front of the verifier's gRPC stream.

A request's path: the body is read (at most --max-request-body-bytes) and checked (protocol.py); it
waits for the tokenizer together with the requests that arrived in the same event-loop turn (one
batch, rendered and encoded in a worker thread); its length is checked against the verifier's context;
its n choices are submitted on the shared gRPC stream; deltas are detokenized incrementally, stop
strings are matched across token boundaries (a hit aborts the verifier request at once), and the
answer is streamed or assembled. A client that disconnects has its requests aborted in the verifier.
The concepts live apart: tokenizing.py (the batched tokenizer), generations.py (admission, submission,
deltas absorbed), responses.py (whole answers and server-sent events); this module is the routes.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from splitspec.gateway.body import BodyError, parse_body
from splitspec.gateway.protocol import (APIError, invalid, parse_chat, parse_completion, request_schemas,
                                        template_messages)
from splitspec.gateway.tokenize_models import parse_detokenize, parse_tokenize
from splitspec.gateway.generations import Gateway, GatewayConfig
from splitspec.gateway.ids import unique_hex
from splitspec.gateway.responses import EventStream, collect, stream, watch_disconnect, whole_response
from splitspec.gateway.text import ChatMessages, TextCodec

logger = logging.getLogger("splitspec.gateway")


def error_response(gateway: Gateway, exc: APIError, endpoint: str) -> JSONResponse:
    if gateway.metrics is not None:
        gateway.metrics.answered(endpoint, str(exc.status)).inc()
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def authorized(config: GatewayConfig, request: Request) -> None:
    if config.api_key is not None and not hmac.compare_digest(  # constant time: no key guessing by timing
            request.headers.get("authorization", "").encode(), f"Bearer {config.api_key}".encode()):
        raise APIError(401, "Incorrect or missing API key (send 'Authorization: Bearer <key>')",
                       "invalid_request_error", code="invalid_api_key")


async def read_body(config: GatewayConfig, request: Request):
    authorized(config, request)
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


async def generate(gateway: Gateway, request: Request, endpoint: str, chat: bool):
    """A completion request from its body to its answer (whole, or a stream of events)."""
    arrival = time.perf_counter()
    admitted = 0
    try:
        await gateway.client.turn()  # a burst's first submissions go out before the rest of it is taken
        body = await read_body(gateway.config, request)
        gateway.check_ready()
        g = parse_chat(body, gateway.client.info.vocab_size) if chat else parse_completion(body, gateway.client.info.vocab_size)
        admitted = gateway.admit(g)
        prompts = await gateway.prepare(g)
    except APIError as exc:
        gateway.release(admitted)
        return error_response(gateway, exc, endpoint)
    except BaseException:
        gateway.release(admitted)
        raise
    choices = gateway.submit(g, prompts)
    if gateway.step_log is not None:
        gateway.step_log.hop("gateway_handler", arrival)
    gateway.metrics.in_flight_served.inc()
    rid = ("chatcmpl-" if chat else "cmpl-") + unique_hex()
    if g.stream:
        gateway.metrics.answered(endpoint, "200").inc()
        return EventStream(stream(gateway, g, prompts, choices, rid, chat, arrival, admitted),
                           headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    task, gone = asyncio.current_task(), asyncio.Event()
    watcher = asyncio.get_running_loop().create_task(watch_disconnect(request.receive, task, gone))
    try:
        await collect(gateway, choices, arrival)
    except asyncio.CancelledError:
        gateway.abort_unfinished(choices, "disconnect")
        if not gone.is_set():  # the server is shutting down: the cancellation is not ours to swallow
            raise
        task.uncancel()  # the client went away: an ordinary end (no traceback), answered to no one
        gateway.metrics.answered(endpoint, "499").inc()
        gateway.log_request(endpoint, rid, "499 (the client left)", g, prompts, choices, arrival)
        return Response(status_code=499)
    finally:
        watcher.cancel()
        gateway.release(admitted)
        gateway.metrics.in_flight_served.dec()
    for choice in choices:
        gateway.finished(choice)
    failed = next((c.error for c in choices if c.error is not None), None)
    if failed is not None:
        gateway.log_request(endpoint, rid, f"{failed.status} ({failed.message})", g, prompts, choices, arrival)
        return error_response(gateway, failed, endpoint)
    gateway.metrics.answered(endpoint, "200").inc()
    gateway.log_request(endpoint, rid, "200", g, prompts, choices, arrival)
    return JSONResponse(whole_response(gateway, g, prompts, choices, rid, chat))


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


def openapi_document(app: FastAPI, gateway: Gateway) -> dict:
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


async def tokenize(gateway: Gateway, request: Request):
    """POST /tokenize: a prompt's or a chat's token ids, as vLLM and SGLang answer it."""
    try:
        body = await read_body(gateway.config, request)
        gateway.check_ready()
        asked = parse_tokenize(body)
        if asked.model is not None:
            gateway.check_model(asked.model)
        job = ChatMessages(template_messages(asked.messages), options=asked.template_options()) if asked.messages \
            else asked.prompt
        ids = await gateway.tokenizing.encode(job, asked.add_special_tokens)
    except APIError as exc:
        return error_response(gateway, exc, "/tokenize")
    gateway.metrics.answered("/tokenize", "200").inc()
    return {"count": len(ids), "max_model_len": gateway.client.info.max_context_tokens, "tokens": ids}


async def detokenize(gateway: Gateway, request: Request):
    """POST /detokenize: token ids back to text."""
    try:
        body = await read_body(gateway.config, request)
        gateway.check_ready()
        asked = parse_detokenize(body, gateway.client.info.vocab_size)
        if asked.model is not None:
            gateway.check_model(asked.model)
        text = await gateway.tokenizing.decode(asked.tokens)
    except APIError as exc:
        return error_response(gateway, exc, "/detokenize")
    gateway.metrics.answered("/detokenize", "200").inc()
    return {"prompt": text}


def read_only(gateway: Gateway, request: Request, path: str, answer, model_id: str | None = None):
    """A GET that reads the served model's state: the API key, a connected verifier (and the model asked for, if
    any) checked, answer() returned and counted."""
    try:
        authorized(gateway.config, request)
        gateway.check_ready()
        if model_id is not None:
            gateway.check_model(model_id)
    except APIError as exc:
        return error_response(gateway, exc, path)
    gateway.metrics.answered(path, "200").inc()
    return answer()


def internal_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("internal error on %s %s", request.method, request.url.path, exc_info=exc)
    return JSONResponse(APIError(500, f"internal error: {type(exc).__name__}", "server_error", code="internal_error")
                        .body(), status_code=500)


COMPLETION_ROUTES = {"/v1/completions": False, "/v1/chat/completions": True}  # path -> chat


class CompletionRoutes:
    """The ASGI app the server runs: a POST to a completion route goes straight to its handler, everything else
    (the other routes, other methods, 404s, the lifespan) to the FastAPI app. The handler is the same either way;
    FastAPI's router and Starlette's middleware stack (six layers, each a coroutine per request and per write) took,
    with the streamed answer's task group, ~30% of the gateway's CPU per request (py-spy; docs/performance.md,
    2026-12-02), and a burst reaches the engine only as fast as the gateway takes it."""

    def __init__(self, app: FastAPI):
        self.app = app
        self.gateway: Gateway = app.state.gateway

    async def __call__(self, scope, receive, send) -> None:
        chat = COMPLETION_ROUTES.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if chat is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            response = await generate(self.gateway, request, scope["path"], chat)
        except Exception as exc:  # noqa: BLE001 (what the app's handler of every exception answers)
            response = internal_error(request, exc)
        await response(scope, receive, send)


def create_app(config: GatewayConfig, codec: TextCodec | None = None) -> FastAPI:
    gateway = Gateway(config, codec)

    @asynccontextmanager
    async def lifespan(_app):
        await gateway.start()
        if config.serve_when_ready:  # uvicorn accepts once this returns: meanwhile connections wait in the backlog
            await gateway.until_ready()
        try:
            yield
        finally:
            await gateway.stop()

    app = FastAPI(title="splitspec gateway", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.gateway = gateway

    app.openapi = lambda: openapi_document(app, gateway)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request_error")
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(APIError(exc.status_code, message, "invalid_request_error", code=kind).body(),
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        return internal_error(request, exc)

    @app.post("/v1/chat/completions", **documented("ChatCompletionRequest"))
    async def chat_completions(request: Request):
        return await generate(gateway, request, "/v1/chat/completions", chat=True)

    @app.post("/v1/completions", **documented("CompletionRequest"))
    async def completions(request: Request):
        return await generate(gateway, request, "/v1/completions", chat=False)

    def model_card() -> dict:
        info = gateway.client.info
        return {"id": gateway.model_name, "object": "model", "created": gateway.created, "owned_by": "splitspec",
                "root": info.model_path, "max_model_len": info.max_context_tokens}

    @app.get("/v1/models")
    async def models(request: Request):
        return read_only(gateway, request, "/v1/models", lambda: {"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        return read_only(gateway, request, "/v1/models/{model}", model_card, model_id)

    @app.get("/get_server_info")
    async def server_info(request: Request):
        return read_only(gateway, request, "/get_server_info", gateway.server_info)

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        return await tokenize(gateway, request)

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        return await detokenize(gateway, request)

    @app.get("/health")
    async def health():
        if gateway.all_ready() and await gateway.client.serving():
            return Response(status_code=200)
        message = ("the verifier is not serving" if not gateway.ready or gateway.config.workers_dir is None
                   else "not every gateway worker serves yet")
        return JSONResponse(APIError(503, message, "service_unavailable", code="verifier_unavailable").body(),
                            status_code=503)

    @app.get("/metrics")
    async def metrics():
        if gateway.metrics is None:
            return Response(b"", media_type=CONTENT_TYPE_LATEST)
        return Response(generate_latest(gateway.metrics.exposition), media_type=CONTENT_TYPE_LATEST)

    return app
