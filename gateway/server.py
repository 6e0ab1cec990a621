"""`splitspec gateway`: the OpenAI-compatible HTTP server in front of a verifier (uvicorn)."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

from splitspec.gateway.request_log import LEVELS, PARTIAL_CHARS
from splitspec.log_format import setup_logging


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="splitspec gateway",
        description="OpenAI-compatible HTTP (chat and text completions with SSE streaming, models, health, "
        "metrics) in front of a `splitspec verifier`. Never imports torch.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--host", default="127.0.0.1", help="Address to listen on (0.0.0.0 for every interface).")
    parser.add_argument("--port", type=int, default=30000, help="HTTP port.")
    parser.add_argument("--verifier", default="127.0.0.1:30001", help="The verifier's gRPC address (host:port).")
    parser.add_argument("--tokenizer-path", default=None,
                        help="Directory with tokenizer.json (and the chat template); default: the model path the "
                        "verifier reports.")
    parser.add_argument("--served-model-name", default=None,
                        help="The model name clients use; default: the name the verifier reports.")
    parser.add_argument("--api-key", default=None,
                        help="Require 'Authorization: Bearer KEY' on /v1/* (health and metrics stay open).")
    parser.add_argument("--max-queued-requests", type=int, default=1024,
                        help="Choices in flight at most; beyond it requests get 429 with Retry-After.")
    parser.add_argument("--max-request-body-bytes", type=int, default=8 << 20,
                        help="Larger request bodies get 413.")
    parser.add_argument("--tokenizer-threads", type=int, default=2,
                        help="Worker threads that render chat templates and tokenize (off the event loop).")
    parser.add_argument("--timeout-keep-alive", type=int, default=75,
                        help="Seconds an idle keep-alive connection stays open. Above the 5 s after which HTTP "
                        "clients (httpx, hence openai; requests) drop their idle connections, so a client never "
                        "reuses one the server is closing that instant (uvicorn's own 5 s races them).")
    parser.add_argument("--tokenizer-worker-num", "--api-server-count", type=int, default=1,
                        help="Gateway processes serving the port (SGLang's flag; vLLM's --api-server-count): each "
                        "parses HTTP, tokenizes and streams on its own event loop with its own gRPC stream to the "
                        "verifier, and the kernel spreads connections over them (SO_REUSEPORT). More than one "
                        "shortens a burst's way to the engine when one process is the queue. /metrics sums them all; "
                        "--max-queued-requests is shared out among them; a worker that dies is started again.")
    parser.add_argument("--log-requests", action="store_true",
                        help="Log a line (at info) for each request answered, as it ends: its outcome, tokens, seconds "
                        "and accept length, and more by --log-requests-level (SGLang's flag).")
    parser.add_argument("--log-requests-level", type=int, default=2, choices=LEVELS,
                        help="What --log-requests logs: 0 the outcome, 1 also the sampling parameters, 2 also the prompt "
                        f"and the output texts cut to {PARTIAL_CHARS} characters each, 3 the whole texts (SGLang's levels).")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                        help="Log level of the gateway and uvicorn.")
    return parser


def worker_flags(args: argparse.Namespace) -> list[str]:
    """The flags that reproduce args for one worker process: every option of build_parser but the worker count and
    the queue limit (the supervisor gives each worker its share)."""
    flags = []
    for action in build_parser()._actions:
        if not action.option_strings or action.dest in ("help", "tokenizer_worker_num", "max_queued_requests"):
            continue
        value = getattr(args, action.dest)
        if action.nargs == 0:  # a switch (store_true): present or not
            flags += [action.option_strings[0]] if value else []
        elif value is not None:
            flags += [action.option_strings[0], str(value)]
    return flags


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    if (args.max_queued_requests < 1 or args.max_request_body_bytes < 1024 or args.timeout_keep_alive <= 0
            or args.tokenizer_worker_num < 1):
        print("splitspec gateway: error: --max-queued-requests must be >= 1, --max-request-body-bytes >= 1024, "
              "--timeout-keep-alive > 0 and --tokenizer-worker-num >= 1", file=sys.stderr)
        return 2
    if args.tokenizer_worker_num > 1:
        from splitspec.gateway.workers import Supervisor

        logging.getLogger("splitspec.gateway").info("gateway on http://%s:%d: %d worker processes", args.host, args.port,
                                                    args.tokenizer_worker_num)
        return Supervisor(worker_flags(args), args.host, args.port, args.tokenizer_worker_num,
                          args.max_queued_requests).run()
    return serve(args)


def serve(args: argparse.Namespace, sock: socket.socket | None = None) -> int:
    """This process serves the app: on host:port, or on a socket a supervisor bound (gateway/workers.py)."""
    import uvicorn

    from splitspec import event_loop
    from splitspec.gateway.app import CompletionRoutes, GatewayConfig, create_app

    config = GatewayConfig(verifier=args.verifier, tokenizer_path=args.tokenizer_path,
                           served_model_name=args.served_model_name, api_key=args.api_key,
                           max_queued_requests=args.max_queued_requests,
                           max_request_body_bytes=args.max_request_body_bytes, tokenizer_threads=args.tokenizer_threads,
                           workers_dir=getattr(args, "workers_dir", None), workers=getattr(args, "workers", 1),
                           serve_when_ready=getattr(args, "serve_when_ready", False),
                           log_requests_level=args.log_requests_level if args.log_requests else -1)
    loop, http = event_loop.name(), event_loop.http_parser()
    logging.getLogger("splitspec.gateway").info("gateway%s on http://%s:%d, verifier at %s (event loop %s, HTTP parser %s)",
                                                "" if sock is None else f" worker {os.getpid()}", args.host, args.port,
                                                args.verifier, loop, http)
    app = create_app(config)
    server = uvicorn.Server(uvicorn.Config(
        CompletionRoutes(app), host=args.host, port=args.port, log_level=args.log_level, access_log=False,
        log_config=None,  # uvicorn's lines go through the root logger: the services' one format (log_format.py)
        timeout_keep_alive=args.timeout_keep_alive, timeout_graceful_shutdown=5, loop=loop, http=http))
    app.state.gateway.http_state = lambda: connection_lines(server.server_state.connections)  # `kill -USR2` lists them
    server.run(sockets=None if sock is None else [sock])
    return 0


def connection_lines(connections) -> list[str]:
    """A line per open HTTP connection (uvicorn's protocols): its peer, its request's state, its transport's."""
    lines = []
    for protocol in list(connections)[:64]:
        cycle, transport = getattr(protocol, "cycle", None), getattr(protocol, "transport", None)
        peer = transport.get_extra_info("peername") if transport is not None else None
        state = "no request yet" if cycle is None else (
            f"response started {cycle.response_started}, complete {cycle.response_complete}, "
            f"disconnected {cycle.disconnected}")
        closing = transport.is_closing() if transport is not None else None
        buffered = transport.get_write_buffer_size() if transport is not None and not closing else None
        lines.append(f"http connection from {peer}: {state}; closing {closing}, {buffered} bytes unsent")
    return lines
