"""How fast a load client puts a burst of requests on the wire: N concurrent POSTs (a 512-character completion
body each) sent at once to a bare asyncio HTTP server in another process, which stamps each request's head as it
arrives; the client is a thread per request over a new http.client connection (`splitspec bench --url`'s before
8121dad) or the bench's own (splitspec.bench_http: one asyncio event loop, a connection per slot), which sends a
second burst on the first one's kept-alive connections, as a bench point's second wave does. Prints the first,
mean and last arrival after the burst's start, in ms, per client and run as JSON lines.

    python -P benchmarks/client_burst.py --requests 64 --runs 3
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import multiprocessing as mp
import statistics
import threading
import time

BODY = {"model": "m", "prompt": "x" * 512, "max_tokens": 128, "stream": True}


def serve(port_out, arrivals_out, expected: int) -> None:
    """Answers every request with a short 200 and reports the arrival times once `expected` requests came."""
    arrivals: list[float] = []

    async def handle(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                arrivals.append(time.perf_counter())
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length")), 0)
                await reader.readexactly(length)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
                if len(arrivals) == expected:
                    arrivals_out.put(list(arrivals))
                    arrivals.clear()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=4096)
        port_out.put(server.sockets[0].getsockname()[1])
        await server.serve_forever()

    asyncio.run(main())


def threads(port: int, n: int) -> float:
    """A thread per request, each on a new connection (http.client); returns the start time."""
    payload, go = json.dumps(BODY), threading.Event()

    def one():
        go.wait()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/completions", payload, headers={"Content-Type": "application/json"})
        conn.getresponse().read()
        conn.close()

    workers = [threading.Thread(target=one) for _ in range(n)]
    for w in workers:
        w.start()
    start = time.perf_counter()
    go.set()
    for w in workers:
        w.join()
    return start


def event_loop(port: int, n: int, arrivals) -> tuple[list[float], list[float]]:
    """splitspec.bench_http's client: one event loop, a connection per slot; two bursts, the second on the first's
    kept-alive connections (a bench point's second wave); each burst's arrivals after its start."""
    from splitspec.bench_http import Http
    from splitspec.bench_measure import Timeline

    client = Http(f"http://127.0.0.1:{port}", None)

    async def bursts():
        connections = [client.connection() for _ in range(n)]
        out = []
        for _ in range(2):
            start = time.perf_counter()
            await asyncio.gather(*(c.stream(BODY, Timeline()) for c in connections))
            out.append([t - start for t in sorted(arrivals.get(timeout=60))])
        for c in connections:
            c.close()
        return out

    return tuple(asyncio.run(bursts()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64, help="Requests in the burst.")
    parser.add_argument("--runs", type=int, default=3, help="Bursts per client, the clients alternating.")
    args = parser.parse_args()
    ports, arrivals = mp.Queue(), mp.Queue()
    server = mp.Process(target=serve, args=(ports, arrivals, args.requests), daemon=True)
    server.start()
    port = ports.get(timeout=30)
    try:
        for run in range(args.runs):
            start = threads(port, args.requests)
            fresh = [t - start for t in sorted(arrivals.get(timeout=60))]
            first, kept = event_loop(port, args.requests, arrivals)
            for name, seen in (("threads", fresh), ("event-loop, new connections", first),
                               ("event-loop, kept-alive connections", kept)):
                print(json.dumps({"client": name, "run": run, "requests": args.requests,
                                  "first_ms": round(seen[0] * 1e3, 2), "mean_ms": round(statistics.fmean(seen) * 1e3, 2),
                                  "last_ms": round(seen[-1] * 1e3, 2)}), flush=True)
    finally:
        server.kill()


if __name__ == "__main__":
    main()
