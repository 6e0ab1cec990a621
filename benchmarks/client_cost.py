"""What `splitspec bench --url`'s client costs per streamed token: its own CPU time, against a server that costs
nothing to speak of.

    python -P benchmarks/client_cost.py --rounds 3
    python -P benchmarks/client_cost.py --rounds 3 --repo /tmp/old-tree   # another tree's client (git archive <rev>)

A server process (asyncio streams on uvloop) answers every POST with a streamed completion of --output-len
server-sent events, one chunked write each, --gap-ms apart, then a usage event and [DONE], as the gateway writes
them. This process runs the bench client's point (splitspec.bench_http._point: --concurrency slots, a keep-alive
connection each) over --requests requests and reports its CPU seconds per token delivered (time.process_time:
this process only). A client slower than the gateway's deltas falls behind them: at batch 64 on an 8B target's
5.5 ms steps it has ~86 us a token; what it spends at a wave's end (the last events read, the next requests sent)
is part of every served point's edge.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import socket
import statistics
import sys
import time
from pathlib import Path


def serve(port: int, output_len: int, gap: float) -> None:
    import asyncio

    from splitspec import event_loop

    event = ("data: " + json.dumps({"id": "cmpl-0123456789abcdef", "object": "text_completion", "created": 1700000000,
                                    "model": "m", "choices": [{"index": 0, "text": " word", "logprobs": None,
                                                               "finish_reason": None}]}) + "\n\n").encode()
    chunk = b"%x\r\n%s\r\n" % (len(event), event)
    tail = (f'data: {{"choices": [], "usage": {{"completion_tokens": {output_len}}}}}\n\n' + "data: [DONE]\n\n").encode()
    end = b"%x\r\n%s\r\n0\r\n\r\n" % (len(tail), tail)

    async def handle(reader, writer):
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length"))
            await reader.readexactly(length)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            for _ in range(output_len):
                writer.write(chunk)
                await writer.drain()
                await asyncio.sleep(gap)
            writer.write(end)
            await writer.drain()

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", port)
        await server.serve_forever()

    event_loop.run(main())


def measure(port: int, args) -> dict:
    from splitspec import bench_http, event_loop
    from splitspec.bench_measure import Timeline

    client = bench_http.Http(f"http://127.0.0.1:{port}", None)
    bodies = [{"prompt": list(range(args.prompt_len)), "max_tokens": args.output_len, "stream": True, "seed": i}
              for i in range(args.requests)]
    timelines = [Timeline() for _ in bodies]
    extras: list[dict] = [{} for _ in bodies]
    errors: list[str] = []
    cpu, wall = time.process_time(), time.perf_counter()
    event_loop.run(bench_http._point(client, bodies, args.concurrency, timelines, extras, errors))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    tokens = sum(t.tokens for t in timelines)
    if errors or tokens != args.requests * args.output_len:
        raise SystemExit(f"client_cost: {len(errors)} errors ({errors[:3]}), {tokens} tokens")
    return {"cpu_us_per_token": round(cpu / tokens * 1e6, 2), "cpu_s": round(cpu, 3), "wall_s": round(wall, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1],
                        help="The tree whose splitspec.bench_http is measured (default: this one).")
    parser.add_argument("--concurrency", type=int, default=64, help="Slots, a connection each (default 64).")
    parser.add_argument("--requests", type=int, default=256, help="Requests per round (default 256).")
    parser.add_argument("--output-len", type=int, default=128, help="Events per response (default 128).")
    parser.add_argument("--prompt-len", type=int, default=128, help="Token ids in each request's prompt (default 128).")
    parser.add_argument("--gap-ms", type=float, default=2.0, help="The server's pause between a response's events.")
    parser.add_argument("--rounds", type=int, default=3, help="Rounds; the report gives each and their median.")
    parser.add_argument("--out", type=Path, help="Write the report here as JSON too.")
    args = parser.parse_args()
    sys.path.insert(0, str(args.repo))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = multiprocessing.get_context("spawn").Process(target=serve, args=(port, args.output_len, args.gap_ms / 1e3),
                                                          daemon=True)
    server.start()
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or not server.is_alive():
                    raise SystemExit("client_cost: the server did not start") from None
                time.sleep(0.1)
        rounds = [measure(port, args) for _ in range(args.rounds)]
    finally:
        server.terminate()
        server.join(5)
    from splitspec.step_log import calibration_us

    report = {"benchmark": "bench --url client cost", "command": " ".join(["python -P benchmarks/client_cost.py", *sys.argv[1:]]),
              "repo": str(args.repo), "host_us": round(calibration_us(), 1), "rounds": rounds,
              "median_cpu_us_per_token": statistics.median(r["cpu_us_per_token"] for r in rounds)}
    print(json.dumps(report))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
