"""One of the gateway's worker processes (`splitspec gateway --tokenizer-worker-num N`, gateway/workers.py):
`python -m splitspec.gateway.worker --fd FD <the gateway's flags>` serves the app on the listening socket its
supervisor bound and passed down as file descriptor FD."""

from __future__ import annotations

import socket
import sys

from splitspec.gateway.server import build_parser, serve


def main() -> int:
    parser = build_parser()
    parser.prog = "python -m splitspec.gateway.worker"
    parser.add_argument("--fd", type=int, required=True,
                        help="The listening socket's file descriptor, inherited from the supervising gateway.")
    parser.add_argument("--workers-dir", required=True,
                        help="Where each worker marks itself once it serves (/health waits for every worker's mark).")
    parser.add_argument("--workers", type=int, required=True, help="The supervisor's number of workers.")
    parser.add_argument("--serve-when-ready", action="store_true",
                        help="Accept connections only once connected to the verifier (a worker started again while "
                        "its siblings serve: the connections its socket queued wait for it, none gets a 503).")
    args = parser.parse_args()
    from splitspec.log_format import setup_logging

    setup_logging(args.log_level)
    return serve(args, socket.socket(fileno=args.fd))


if __name__ == "__main__":
    sys.exit(main())
