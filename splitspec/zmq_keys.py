"""`splitspec zmq-keys`: CURVE certificates for the step channel between the verifier and its drafters.

Each --name gets a pair in DIR: NAME.key (the public certificate, to hand out) and NAME.key_secret (the
secret one, mode 0600, stays on its host). A setup with drafters on other hosts:

    splitspec zmq-keys keys --name verifier                # on the verifier's host
    splitspec zmq-keys keys/drafters --name gpu-host-2     # one pair per drafter (host)
    splitspec verifier ... --drafter-bind-addr tcp://0.0.0.0:30003 \\
        --zmq-curve-secret-key keys/verifier.key_secret --zmq-curve-authorized-keys keys/drafters
    splitspec drafter ... --verifier-drafter-addr tcp://VERIFIER_HOST:30003 \\
        --zmq-curve-server-key verifier.key --zmq-curve-secret-key gpu-host-2.key_secret

The verifier admits the drafters whose NAME.key files are in its --zmq-curve-authorized-keys directory
(*.key only: the secret files beside them are not read there).
"""

from __future__ import annotations

import argparse
import socket
import sys

from splitspec.runtime.curve import CurveError, write_certificates


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitspec zmq-keys", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir", metavar="DIR", help="Directory for the certificates (made if missing).")
    parser.add_argument("--name", action="append", default=None,
                        help="Name of a key pair: DIR/NAME.key and DIR/NAME.key_secret; repeat for several "
                        "(default: this host's name).")
    parser.add_argument("--force", action="store_true", help="Replace a pair that exists (default: refuse).")
    return parser


def run(args: argparse.Namespace) -> int:
    names = args.name or [socket.gethostname()]
    try:
        for name in names:
            public, secret = write_certificates(args.dir, name, overwrite=args.force)
            print(f"{public}  (public: hand it out)\n{secret}  (secret, mode 0600: keep it on its host)")
    except (CurveError, OSError) as exc:
        print(f"splitspec zmq-keys: error: {exc}", file=sys.stderr)
        return 2
    return 0
