"""How fast a burst of requests reaches the engine: bursts of N concurrent streamed completions (128 token ids,
one new token each) against a running `splitspec up` whose services run with SPLITSPEC_STEP_LOG=PREFIX; from the
verifier's log, the spacing of each burst's arrivals at the engine (milliseconds per request: the way in's
throughput, gateway and front included).

    SPLITSPEC_STEP_LOG=/tmp/steps splitspec up --port 31000 --speculative-algorithm none &
    python benchmarks/burst_intake.py --url http://127.0.0.1:31000 --step-log /tmp/steps --requests 32 --bursts 20
"""

from __future__ import annotations

import argparse
import glob
import http.client
import json
import random
import statistics
import sys
import threading
from urllib.parse import urlsplit


def send(url: str, model: str, seed: int) -> None:
    rng = random.Random(seed)
    body = {"model": model, "prompt": [rng.randrange(10, 4000) for _ in range(128)], "max_tokens": 1, "stream": True,
            "temperature": 0, "ignore_eos": True}
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
        for _ in response:
            pass
    finally:
        conn.close()


def spacings(prefix: str, burst_size: int) -> list[float]:
    """Per burst of burst_size arrivals (split at gaps over 100 ms): ms between its first and last over burst_size - 1."""
    arrivals = sorted(json.loads(line)["received"] for path in glob.glob(f"{prefix}.verifier.*.jsonl")
                      for line in open(path) if '"arrive"' in line)
    bursts: list[list[float]] = []
    for t in arrivals:
        if bursts and t - bursts[-1][-1] <= 0.1:
            bursts[-1].append(t)
        else:
            bursts.append([t])
    return [(b[-1] - b[0]) * 1e3 / (len(b) - 1) for b in bursts if len(b) == burst_size]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="The gateway (splitspec up's --port).")
    parser.add_argument("--step-log", required=True, help="The SPLITSPEC_STEP_LOG prefix the services run with.")
    parser.add_argument("--requests", type=int, default=32, help="Requests per burst.")
    parser.add_argument("--bursts", type=int, default=20, help="Bursts, one after the other.")
    args = parser.parse_args(argv)
    parts = urlsplit(args.url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    conn.request("GET", "/v1/models")
    model = json.loads(conn.getresponse().read())["data"][0]["id"]
    conn.close()
    before = len(spacings(args.step_log, args.requests))
    for b in range(args.bursts):
        threads = [threading.Thread(target=send, args=(args.url, model, b * args.requests + i)) for i in range(args.requests)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    measured = spacings(args.step_log, args.requests)[before:]
    if not measured:
        print("no whole burst in the verifier's step log (is SPLITSPEC_STEP_LOG the services' prefix?)", file=sys.stderr)
        return 1
    print(json.dumps({"bursts": len(measured), "requests": args.requests,
                      "ms_per_arrival": {"median": round(statistics.median(measured), 3),
                                         "mean": round(statistics.fmean(measured), 3)}}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
