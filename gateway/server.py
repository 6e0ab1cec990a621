"""`splitspec gateway`: the OpenAI-compatible HTTP server in front of a verifier (uvicorn)."""

from __future__ import annotations

import argparse
import logging
import sys


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
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                        help="Log level of the gateway and uvicorn.")
    return parser


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from splitspec import event_loop
    from splitspec.gateway.app import GatewayConfig, create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    if args.max_queued_requests < 1 or args.max_request_body_bytes < 1024 or args.timeout_keep_alive <= 0:
        print("splitspec gateway: error: --max-queued-requests must be >= 1, --max-request-body-bytes >= 1024 and "
              "--timeout-keep-alive > 0", file=sys.stderr)
        return 2
    config = GatewayConfig(verifier=args.verifier, tokenizer_path=args.tokenizer_path,
                           served_model_name=args.served_model_name, api_key=args.api_key,
                           max_queued_requests=args.max_queued_requests,
                           max_request_body_bytes=args.max_request_body_bytes, tokenizer_threads=args.tokenizer_threads)
    loop, http = event_loop.name(), event_loop.http_parser()
    logging.getLogger("splitspec.gateway").info("gateway on http://%s:%d, verifier at %s (event loop %s, HTTP parser %s)",
                                                args.host, args.port, args.verifier, loop, http)
    uvicorn.run(create_app(config), host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                timeout_keep_alive=args.timeout_keep_alive, timeout_graceful_shutdown=5, loop=loop, http=http)
    return 0
