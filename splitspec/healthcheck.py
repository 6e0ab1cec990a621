"""Container health checks without curl or grpcurl in the image (torch-free):

    python -m splitspec.healthcheck http http://127.0.0.1:30000/health
    python -m splitspec.healthcheck grpc 127.0.0.1:30001      # grpc.health.v1, service splitspec.v1.Verifier

Exit 0 when healthy, 1 otherwise (with the reason on stderr).
"""

from __future__ import annotations

import sys


def check(kind: str, target: str, timeout: float = 3.0) -> str | None:
    """None when healthy, else why not."""
    if kind == "http":
        import urllib.request

        try:
            with urllib.request.urlopen(target, timeout=timeout) as response:
                return None if response.status == 200 else f"HTTP {response.status}"
        except OSError as exc:
            return str(exc)
    if kind == "grpc":
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(target) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service="splitspec.v1.Verifier"), timeout=timeout)
            except grpc.RpcError as exc:
                return f"{exc.code().name}: {exc.details()}"
        return None if reply.status == health_pb2.HealthCheckResponse.SERVING else health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return f"unknown check {kind!r} (http or grpc)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    problem = check(argv[0], argv[1])
    if problem is not None:
        print(f"unhealthy: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
