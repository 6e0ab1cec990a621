"""`splitspec drafter`: one drafting algorithm in its own process, serving a verifier over ZeroMQ.

The drafter connects a DEALER socket to the verifier's ROUTER (--verifier-drafter-addr), registers
(algorithm, draft model, hidden states it needs, capacity, a random instance epoch) and heartbeats.
The verifier pins requests to it (OpenRequest with the tokens so far), asks for one step of trees at
a time (DraftRequest: new tokens per request) and releases finished requests. When the verifier goes
silent, restarts (a new verifier epoch) or no longer knows this drafter's session, every request of
the old session is dropped and the drafter registers again. Start as many as you like, on any hosts:
each joins the pool without restarting anything.

With --zmq-curve-server-key and --zmq-curve-secret-key the socket is a CURVE client (runtime/curve.py):
the step channel is encrypted and the verifier admits this drafter only if its key is authorized there. A
handshake the verifier refuses (an unauthorized key, CURVE on one side only) ends the drafter with a
message saying why, as a refused registration does.
"""
# This module is the command's flags alone, and imports neither torch nor the drafters: `splitspec up` reads them to
# pass the drafters theirs (without it `up` imported torch, ~3 CPU-s a launch), and `splitspec drafter --help` answers
# without loading a model library. server.py is the service.

from __future__ import annotations

import argparse

from splitspec import engine_args
from splitspec.log_format import LOG_LEVELS
from splitspec.runtime.config import LOAD_FORMATS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitspec drafter", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_argument_group("drafter service")
    group.add_argument("--verifier-drafter-addr", default="tcp://127.0.0.1:30003",
                       help="The verifier's drafter endpoint (its --drafter-bind-addr), e.g. tcp://verifier-host:30003.")
    group.add_argument("--drafter-name", default=None,
                       help="Name in the verifier's pool and in metric labels (default: hostname:pid).")
    group.add_argument("--max-running-requests", type=int, default=1024,
                       help="Requests this drafter holds at once; the pool balances by pinned requests / this.")
    group.add_argument("--heartbeat-interval", type=float, default=0.25,
                       help="Seconds between heartbeats to the verifier.")
    group.add_argument("--verifier-timeout", type=float, default=5.0,
                       help="Seconds without a word from the verifier before dropping all requests and registering again.")
    group.add_argument("--metrics-port", type=int, default=None,
                       help="Serve this drafter's Prometheus metrics on this port at /metrics; 0 picks a free port "
                       "(default: no metrics server). The verifier lists the endpoint in its service discovery "
                       "(GET /sd/drafters on its --metrics-port) while this drafter is registered.")
    group.add_argument("--metrics-host", default="127.0.0.1",
                       help="Address the metrics endpoint binds. 0.0.0.0 (or ::) lets other hosts scrape it; the "
                       "verifier then advertises the address it sees this drafter connect from.")
    group.add_argument("--zmq-curve-server-key", default=None, metavar="PATH",
                       help="The verifier's public CURVE certificate (NAME.key from `splitspec zmq-keys`, the public half "
                       "of its --zmq-curve-secret-key): the step channel is encrypted with ZeroMQ CURVE and this "
                       "drafter talks only to the holder of that key. Needs --zmq-curve-secret-key.")
    group.add_argument("--zmq-curve-secret-key", default=None, metavar="PATH",
                       help="This drafter's secret CURVE certificate (NAME.key_secret from `splitspec zmq-keys`); its "
                       "public half (NAME.key) must be in the verifier's --zmq-curve-authorized-keys directory, or the "
                       "verifier refuses the handshake and this drafter exits (code 3). Needs --zmq-curve-server-key.")
    group.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="Logging level.")
    model = parser.add_argument_group("draft model (model drafters)")
    model.add_argument("--model-path", "--model", dest="model_path", default=None,
                       help="The target model (HF directory or hub id), required for EAGLE/EAGLE3/NEXTN. Their drafts share its "
                       "embedding (and lm_head), and its config says which states EAGLE3 needs; MTP loads its MTP "
                       "layers from it; STANDALONE checks that the draft speaks its vocabulary. Every drafter uses its tokenizer to draft "
                       "constrained requests (structured outputs) to their grammars; without it they draft unguided.")
    model.add_argument("--revision", default=None, help="Hub branch, tag or commit of --model-path.")
    model.add_argument("--load-format", default="auto", choices=LOAD_FORMATS,
                       help="The target's (`splitspec up` passes the verifier's on). dummy or dummy-decisive: --model-path is "
                       "a config alone and the target's embedding (and lm_head) that a head shares are random (benchmarks "
                       "of dummy targets; see splitspec bench --preset); the others read the target's checkpoint as usual.")
    model.add_argument("--dtype", default="auto", help="Draft model dtype (auto = the checkpoint's; fp32 files run in bf16 on GPU).")
    model.add_argument("--device", default="auto", help="cpu, cuda, cuda:N; auto = cuda when available.")
    model.add_argument("--page-size", type=int, default=16, help="Tokens per page of the draft model's KV cache.")
    model.add_argument("--max-total-tokens", type=int, default=None,
                       help="Draft KV-cache capacity in tokens (default: 65536 on CPU, --mem-fraction-static on GPU).")
    model.add_argument("--mem-fraction-static", type=float, default=None,
                       help="GPU only: fraction of GPU memory for the draft model's weights plus KV cache.")
    model.add_argument("--attention-backend", default="auto",
                       help="Attention kernels of the draft model: auto (flashinfer on CUDA when it imports, else torch), "
                       "flashinfer or torch; SGLang's other names are served by auto.")
    model.add_argument("--cuda-graph-max-bs", type=int, default=None,
                       help="GPU: the whole draft (every step and the ranking) replays one CUDA graph per batch size "
                       "up to this many requests (default 32); larger batches and catch-ups run eagerly.")
    model.add_argument("--disable-cuda-graph", action="store_true", help="GPU: run every draft step eagerly.")
    engine_args.add_speculative_args(parser, side="drafter")
    return parser
