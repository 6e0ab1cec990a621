"""ZeroMQ CURVE on the step channel: certificates, the verifier's key check, and handshake failures.

CURVE (CurveZMQ: Curve25519 key exchange, every frame encrypted and authenticated) secures the step channel
between the verifier and drafters on other hosts. Keys are ZeroMQ certificates as
zmq.auth.create_certificates writes them (`splitspec zmq-keys`): NAME.key holds a public key, NAME.key_secret
the public and the secret key, both Z85-encoded (40 characters for 32 bytes).

    verifier (CURVE server)                                    drafter (CURVE client)
    its secret certificate           --zmq-curve-secret-key    its own secret certificate
    the drafters' *.key files        --zmq-curve-authorized-keys / --zmq-curve-server-key   the verifier's .key

A ZAP handler (zmq.auth.ThreadAuthenticator, its own thread) admits a drafter only when its public key is
one of the authorized ones. It is bound before the verifier's socket, so no connection can come before it
(libzmq admits every CURVE client of a context that has no ZAP handler). Each side watches its socket's
handshakes through a ZeroMQ socket monitor: a refused connection never reaches the application, so the
monitor is where it is seen, classified (`HandshakeFailure.reason`), logged and counted.
"""

from __future__ import annotations

import collections
import logging
import os
import stat
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

Z85_KEY_LENGTH = 40  # a 32-byte Curve25519 key, Z85-encoded
ZAP_DENIED = 400  # the ZAP status code of a refused key (300: temporary failure, 500: handler error)
# HandshakeFailure.reason values, the `reason` label of splitspec:drafter_handshake_failures_total
HANDSHAKE_REASONS = ("unauthorized", "mechanism_mismatch", "cryptographic", "protocol", "no_detail")


class CurveError(ValueError):
    """A missing, malformed or mismatched CURVE certificate, or half the CURVE flags (names the file or flag)."""


@dataclass(frozen=True)
class ServerKeys:
    """The verifier's CURVE keys (Z85) and the public keys of the drafters it admits."""

    public_key: bytes
    secret_key: bytes = field(repr=False)
    authorized: frozenset[bytes]
    authorized_dir: str


@dataclass(frozen=True)
class ClientKeys:
    """A drafter's CURVE keys (Z85) and the verifier's public key it expects."""

    server_key: bytes
    public_key: bytes
    secret_key: bytes = field(repr=False)


@dataclass(frozen=True)
class HandshakeFailure:
    reason: str  # one of HANDSHAKE_REASONS
    detail: str  # what it means, for a log line
    fatal: bool  # a drafter should give up: the verifier refused its key, or only one side uses CURVE


# certificates ---------------------------------------------------------------------------------------
def _check_key(key: bytes | None, what: str, path: Path, flag: str) -> bytes:
    from zmq.utils import z85

    if key is None:
        raise CurveError(f"{flag} {path}: no {what} in it (a ZeroMQ certificate from `splitspec zmq-keys`?)")
    try:
        if len(key) != Z85_KEY_LENGTH or len(z85.decode(key)) != 32:
            raise ValueError
    except (ValueError, KeyError, TypeError, struct.error):
        raise CurveError(f"{flag} {path}: its {what} is not a Z85-encoded 32-byte key "
                         f"({len(key)} characters, {Z85_KEY_LENGTH} expected)") from None
    return key


def _read_certificate(path: str | os.PathLike, flag: str) -> tuple[bytes, bytes | None, Path]:
    import zmq
    import zmq.auth

    if not zmq.has("curve"):
        raise CurveError(f"{flag}: this libzmq ({zmq.zmq_version()}) was built without CURVE")
    path = Path(path)
    if not path.is_file():
        raise CurveError(f"{flag} {path}: no such file" if not path.exists() else f"{flag} {path}: not a file")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (ValueError, UnicodeError) as exc:
        raise CurveError(f"{flag} {path}: not a ZeroMQ certificate ({exc}); make one with `splitspec zmq-keys`") from None
    except OSError as exc:
        raise CurveError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from None
    return _check_key(public, "public-key", path, flag), secret, path


def load_public_certificate(path: str | os.PathLike, flag: str) -> bytes:
    """The Z85 public key of a certificate (NAME.key, or a secret certificate's public half)."""
    return _read_certificate(path, flag)[0]


def load_secret_certificate(path: str | os.PathLike, flag: str) -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys of a secret certificate (NAME.key_secret), checked to be one pair."""
    import zmq

    public, secret, path = _read_certificate(path, flag)
    if secret is None:
        raise CurveError(f"{flag} {path}: a public certificate, with no secret-key (give its .key_secret file)")
    secret = _check_key(secret, "secret-key", path, flag)
    if zmq.curve_public(secret) != public:
        raise CurveError(f"{flag} {path}: its public-key is not the public half of its secret-key")
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning("%s %s is readable by other users (mode %o): chmod 600 it", flag, path, stat.S_IMODE(mode))
    return public, secret


def load_authorized_keys(directory: str | os.PathLike, flag: str) -> frozenset[bytes]:
    """The Z85 public keys of every *.key certificate in a directory (at least one)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CurveError(f"{flag} {directory}: no such directory" if not directory.exists()
                         else f"{flag} {directory}: not a directory")
    files = sorted(directory.glob("*.key"))
    if not files:
        raise CurveError(f"{flag} {directory}: no *.key public certificates in it (copy each drafter's NAME.key there)")
    return frozenset(load_public_certificate(f, flag) for f in files)


def _both(first: tuple[str, str | None], second: tuple[str, str | None], takes: str) -> None:
    """A pair of flags given together (the caller has returned when neither is)."""
    if first[1] is None or second[1] is None:
        (given, _), (missing, _) = (first, second) if second[1] is None else (second, first)
        raise CurveError(f"{given} needs {missing} as well (CURVE takes {takes})")


def server_keys(secret_path: str | None, authorized_dir: str | None) -> ServerKeys | None:
    """The verifier's keys from its flags; None when CURVE is off (neither flag)."""
    if secret_path is None and authorized_dir is None:
        return None
    _both(("--zmq-curve-secret-key", secret_path), ("--zmq-curve-authorized-keys", authorized_dir),
          "the verifier's secret certificate and the drafters' public ones")
    public, secret = load_secret_certificate(secret_path, "--zmq-curve-secret-key")
    authorized = load_authorized_keys(authorized_dir, "--zmq-curve-authorized-keys")
    return ServerKeys(public, secret, authorized, str(authorized_dir))


def client_keys(server_path: str | None, secret_path: str | None) -> ClientKeys | None:
    """A drafter's keys from its flags; None when CURVE is off (neither flag)."""
    if server_path is None and secret_path is None:
        return None
    _both(("--zmq-curve-server-key", server_path), ("--zmq-curve-secret-key", secret_path),
          "the verifier's public certificate and this drafter's secret one")
    server = load_public_certificate(server_path, "--zmq-curve-server-key")
    public, secret = load_secret_certificate(secret_path, "--zmq-curve-secret-key")
    return ClientKeys(server, public, secret)


def write_certificates(directory: str | os.PathLike, name: str, overwrite: bool = False) -> tuple[Path, Path]:
    """NAME.key and NAME.key_secret in directory (made if missing), the secret one readable by its owner
    only from the moment it exists: both are written in a private temporary directory and moved in."""
    import zmq.auth

    if not name or name in (".", "..") or os.sep in name or (os.altsep and os.altsep in name):
        raise CurveError(f"--name {name!r}: a file name is needed, without a path")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    public, secret = directory / f"{name}.key", directory / f"{name}.key_secret"
    existing = [str(p) for p in (public, secret) if p.exists()]
    if existing and not overwrite:
        raise CurveError(f"{' and '.join(existing)} {'exist' if len(existing) > 1 else 'exists'} already; pass --force "
                         "to replace the pair")
    with tempfile.TemporaryDirectory(dir=directory, prefix=".zmq-keys-") as private:  # mode 0700
        made_public, made_secret = zmq.auth.create_certificates(private, name)
        os.chmod(made_secret, 0o600)
        os.chmod(made_public, 0o644)
        os.replace(made_secret, secret)
        os.replace(made_public, public)
    return public, secret


# sockets ----------------------------------------------------------------------------------------------
def make_server(socket, keys: ServerKeys) -> None:
    """Before bind: the socket is a CURVE server with the verifier's keys."""
    socket.curve_secretkey = keys.secret_key
    socket.curve_publickey = keys.public_key
    socket.curve_server = True


def make_client(socket, keys: ClientKeys) -> None:
    """Before connect: the socket is a CURVE client of the verifier whose public key it holds."""
    socket.curve_serverkey = keys.server_key
    socket.curve_publickey = keys.public_key
    socket.curve_secretkey = keys.secret_key


class Authorizer:
    """The ZAP handler of a context, in its own thread (zmq.auth.ThreadAuthenticator), admitting only
    keys.authorized. Made before the CURVE server socket binds; stop() after the socket closes. Keeps the
    refused keys (Z85) for the log line of the handshake failure that follows (a monitor event has none)."""

    def __init__(self, context, keys: ServerKeys):
        from zmq.auth.thread import ThreadAuthenticator

        self.authorized = keys.authorized
        self.refused: collections.deque[bytes] = collections.deque(maxlen=64)  # appended by the ZAP thread
        self._authenticator = ThreadAuthenticator(context, log=logging.getLogger(__name__ + ".zap"))
        self._authenticator.start()
        self._authenticator.configure_curve_callback(domain="*", credentials_provider=self)

    def callback(self, domain: str, key: bytes) -> bool:
        """zmq.auth's credentials-provider call (ZAP thread): is this client key (Z85) authorized?"""
        if key in self.authorized:
            return True
        self.refused.append(key)
        return False

    def stop(self) -> None:
        self._authenticator.stop()


# handshakes ---------------------------------------------------------------------------------------------
class HandshakeMonitor:
    """A socket's failed handshakes, from its ZeroMQ monitor (made before the socket binds or connects).
    side: "verifier" or "drafter" (how a failure is explained); curve: whether this side uses CURVE."""

    def __init__(self, socket, side: str, curve: bool):
        import zmq

        self.zmq, self.side, self.curve = zmq, side, curve
        self.target = socket
        self.num_succeeded = 0  # handshakes completed (connections ready for messages)
        self.socket = socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                                                | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)

    def read(self) -> list[HandshakeFailure]:
        """The failures reported since the last read (never blocks); counts the successes."""
        from zmq.utils.monitor import recv_monitor_message

        failures = []
        while True:
            try:
                event = recv_monitor_message(self.socket, flags=self.zmq.NOBLOCK)
            except self.zmq.Again:
                return failures
            if event["event"] == self.zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.num_succeeded += 1
                continue
            failure = self.classify(event["event"], event["value"])
            if failure is not None:
                failures.append(failure)

    def classify(self, event: int, value: int) -> HandshakeFailure | None:
        zmq = self.zmq
        verifier = self.side == "verifier"
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:  # value: the ZAP status code
            if value != ZAP_DENIED:
                return HandshakeFailure("unauthorized", f"the key check failed (ZAP status {value})", False)
            return HandshakeFailure("unauthorized", "its CURVE public key is not among --zmq-curve-authorized-keys"
                                    if verifier else "the verifier does not authorize this drafter's CURVE public key "
                                    "(add its .key file to the verifier's --zmq-curve-authorized-keys)", True)
        if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:  # value: a ZMQ_PROTOCOL_ERROR_* code
            if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
                if verifier:
                    detail = ("the peer does not use CURVE (a drafter without --zmq-curve-server-key and "
                              "--zmq-curve-secret-key?)" if self.curve else
                              "the peer uses CURVE and this verifier does not (no --zmq-curve-secret-key)")
                else:
                    detail = ("the verifier's step channel does not use CURVE (no --zmq-curve-secret-key there)"
                              if self.curve else "the verifier's step channel requires CURVE: give this drafter "
                              "--zmq-curve-server-key and --zmq-curve-secret-key")
                return HandshakeFailure("mechanism_mismatch", detail, True)
            if value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
                return HandshakeFailure("cryptographic", "its CURVE hello did not decrypt: the drafter's "
                                        "--zmq-curve-server-key is not this verifier's public certificate" if verifier
                                        else "a CURVE message did not decrypt", False)
            return HandshakeFailure("protocol", f"ZMTP protocol error 0x{value:x}", False)
        if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:  # value: errno
            # also what a mechanism mismatch looks like to the side that did not see the other's greeting before
            # the other hung up: each attempt is reported as mechanism_mismatch on one side at least
            detail = "the connection closed during the handshake"
            if verifier:
                detail += " (a drafter without CURVE that hung up first?)" if self.curve else ""
            elif self.curve:
                detail += " (is --zmq-curve-server-key the verifier's public certificate?)"
            else:
                detail += " (does the verifier's step channel require CURVE?)"
            return HandshakeFailure("no_detail", detail, False)
        return None

    def close(self) -> None:
        try:
            self.target.disable_monitor()
        except self.zmq.ZMQError:  # the socket closed already
            pass
        self.socket.close(linger=0)


class Throttle:
    """At most one log line per key every `interval` seconds; says how many were held back."""

    def __init__(self, interval: float = 10.0):
        self.interval = interval
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def allow(self, key: str, now: float) -> int | None:
        """None: hold this one back; else the number held back since the last allowed one."""
        if now - self._last.get(key, -1e18) < self.interval:
            self._held[key] = self._held.get(key, 0) + 1
            return None
        self._last[key] = now
        return self._held.pop(key, 0)
