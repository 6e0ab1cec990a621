"""`splitspec verifier`: the target model and the step loop behind the splitspec.v1.Verifier gRPC API.

Two processes: this one (the engine: the model, the step loop on its own thread (worker.EngineWorker),
the drafter pool, the metrics) and the front it starts (front_process.py: the gRPC server, the streams
and their protobuf), so that gRPC's work never takes the engine's GIL; each step's deltas cross in one
message (engine_link.py). --disable-frontend-multiprocessing serves gRPC on this process's event loop
instead (server.py's LocalBackend: a step's deltas cross from the engine thread in one hand-off). The service
itself (grpc_front.py) is the same either way.
"""
# This module is the command's flags alone, and imports neither torch nor the engine: `splitspec verifier --help` (and a
# launch with a flag misspelt) answers without loading a model library (~3 CPU-s). server.py is the service.

from __future__ import annotations

import argparse

from splitspec import engine_args, model_flags
from splitspec.verifier_svc.stats_log import DEFAULT_DECODE_LOG_INTERVAL
from splitspec.verifier_svc.step_watchdog import WATCHDOG_TIMEOUT_SECONDS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitspec verifier", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    model_flags.add_model_args(parser)
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="Address the gRPC server binds.")
    server.add_argument("--port", type=int, default=30001, help="gRPC port.")
    server.add_argument("--served-model-name", default=None, help="Model name reported to clients (default: the model path).")
    server.add_argument("--context-length", type=int, default=None,
                        help="The longest prompt plus completion served, in tokens (default: config.json's "
                        "max_position_embeddings). Longer than the model's is refused unless "
                        "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1, as in SGLang.")
    server.add_argument("--disable-radix-cache", action="store_true",
                        help="Do not keep finished requests' KV pages for reuse by prompts that share a prefix.")
    server.add_argument("--grammar-backend", choices=("xgrammar", "none"), default="xgrammar",
                        help="The grammar engine of structured outputs (response_format json_object / json_schema, "
                        "regex, ebnf): xgrammar, or none to serve without them (such requests then end with an error). "
                        "SGLang's flag; its outlines and llguidance backends are not served.")
    server.add_argument("--metrics-port", type=int, default=None,
                        help="Serve Prometheus metrics on this port at /metrics (default: no metrics server, unless "
                        "--enable-metrics).")
    server.add_argument("--enable-metrics", action="store_true",
                        help="Serve Prometheus metrics at /metrics on --port + 1 when --metrics-port is not given "
                        "(`splitspec up` gives it: the gateway's port + 2). SGLang's flag; the gateway always serves its "
                        "own /metrics.")
    server.add_argument("--enable-cache-report", action="store_true",
                        help="Accepted (SGLang's flag): every answer reports its prompt tokens served from the prefix "
                        "cache (usage.prompt_tokens_details.cached_tokens) whether or not it is given.")
    server.add_argument("--disable-frontend-multiprocessing", action="store_true",
                        help="Serve gRPC (the gateway's streams and their protobuf) on this process's event loop, beside "
                        "the engine's thread. By default a front process does it, so that it never takes the engine's GIL "
                        "(vLLM's flag name).")
    server.add_argument("--stream-interval", type=int, default=1,
                        help="Tokens a streamed request gathers before the verifier sends them on: its first token goes "
                        "at once, then one message per this many tokens, and its last at its end. Above 1, fewer and "
                        "larger deltas reach the gateway, which turns each into one server-sent event: more tokens/s "
                        "where the gateway's per-event work is the limit (many short steps, a small model), at the cost "
                        "of a burstier stream (and a stop string matched up to this many tokens late: the tokens decoded "
                        "past it are dropped). Whatever the value, a request's deltas that wait for a slow reader are "
                        "merged (SGLang's flag).")
    server.add_argument("--decode-log-interval", type=int, default=DEFAULT_DECODE_LOG_INTERVAL,
                        help="Log a line every this many decode steps (at info): the running and waiting requests, the KV "
                        "cache's use, the tokens/s generated since the last line and, with speculation, the accept "
                        "length and the share of request-steps that drafted; and a line for each step that prefilled "
                        "prompts. 0: no such lines (SGLang's flag).")
    server.add_argument("--watchdog-timeout", type=float, default=WATCHDOG_TIMEOUT_SECONDS,
                        help="Seconds a single engine step may run before the verifier exits (its streams end with an "
                        "error; `splitspec up` and compose's restart policy start it again), the engine thread's stack "
                        "logged first; a step past 20 s has its stack logged as a warning. 0: never exit (SGLang's flag).")
    server.add_argument("--disable-overlap-schedule", action="store_true",
                        help="Run every step to its end before the next one starts. By default, on a GPU, a step's tokens "
                        "and metrics are published while the next step's forward runs on the device, and a plain decoding "
                        "step (no draft in it) is launched before the last one's tokens reach the host, its input tokens "
                        "taken on the device (SGLang's flag name; docs/lifecycle.md).")
    server.add_argument("--async-scheduling", action="store_true",
                        help="Launch each plain decoding step before the last one's tokens reach the host on a CPU device "
                        "too (on a GPU it is the default). On a CPU it hides nothing and holds each stream's tokens back "
                        "one step: for tests of the overlap schedule (vLLM's flag name).")
    server.add_argument("--skip-server-warmup", action="store_true",
                        help="Report serving without first running two short requests through the engine. By default, on "
                        "a GPU, they compile the kernels that compile on first use (FlashInfer's prefill, the samplers) "
                        "before the first user's request (SGLang's flag name).")
    engine_args.add_scheduler_args(parser)
    engine_args.add_speculative_args(parser)
    pool = parser.add_argument_group("drafter pool (drafters in their own processes)")
    pool.add_argument("--drafter-bind-addr", default=None,
                      help="Bind the drafters' ZeroMQ endpoint here (e.g. tcp://0.0.0.0:30003) and draft with the "
                      "`splitspec drafter` processes that connect to it; without it the drafter runs in this process.")
    pool.add_argument("--drafter-timeout-ms", type=float, default=500.0,
                      help="How long a step waits for a drafter's trees; past it the request decodes a plain token that step.")
    pool.add_argument("--drafter-heartbeat-timeout", type=float, default=2.0,
                      help="Seconds without a heartbeat before a drafter is declared dead and its requests move elsewhere.")
    pool.add_argument("--drafter-ipc-buffer-mb", type=int, default=64,
                      help="A GPU verifier offers each drafter process that sees its GPU (one on the same host) a "
                      "buffer of this many MiB on that GPU, mapped through CUDA IPC, to take the hidden states "
                      "from GPU to GPU instead of in ZeroMQ frames through the host; 0: frames always.")
    pool.add_argument("--zmq-curve-secret-key", default=None, metavar="PATH",
                      help="The verifier's secret CURVE certificate (NAME.key_secret from `splitspec zmq-keys`): the "
                      "drafter endpoint encrypts the step channel and authenticates every drafter with ZeroMQ CURVE, "
                      "for drafters on other hosts. Needs --zmq-curve-authorized-keys; drafters need this "
                      "certificate's public half (NAME.key) as their --zmq-curve-server-key.")
    pool.add_argument("--zmq-curve-authorized-keys", default=None, metavar="DIR",
                      help="Directory of the drafters' public CURVE certificates (*.key): only a drafter holding the "
                      "secret half of one may connect; others are refused in the handshake, logged and counted "
                      "(splitspec:drafter_handshake_failures_total). Read at start. Needs --zmq-curve-secret-key.")
    engine_args.add_overlap_args(pool)
    pool.add_argument("--wait-for-drafters", type=int, default=0,
                      help="Report SERVING on health only once this many drafters have registered (they may join later too).")
    return parser
