"""What a CUDA graph's launch costs the host while an earlier launch of the same graph is still queued, against a
launch of another graph (a second capture of the same work) in the same place.

The device-fed drafted step (verifier_svc/device_fed.py) launches step N+1's verification, catch-up and draft loop
graphs while step N's launches of those same graphs are still queued on the device; on an H100 its profile showed
cudaGraphLaunch at ~74 us a call against ~25 us when the device is idle. This times, for a graph of K small kernels
(~K x 2 us of device work): the host time of each launch when the queue ahead holds (a) nothing, (b) the same graph
launched just before, (c) another graph of the same work launched just before.

    python3 -P benchmarks/graph_relaunch_cost.py [--kernels 200] [--repeats 50]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def capture(x: torch.Tensor, kernels: int) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm
            y = x
            for _ in range(kernels):
                y = y * 1.0001 + 0.5
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        y = x
        for _ in range(kernels):
            y = y * 1.0001 + 0.5
    return graph


def timed(launch) -> float:
    began = time.perf_counter()
    launch()
    return (time.perf_counter() - began) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", type=int, default=200, help="kernels in each graph")
    parser.add_argument("--repeats", type=int, default=50, help="measurements of each case")
    args = parser.parse_args()
    x = torch.ones(1024, device="cuda")
    a, b = capture(x, args.kernels), capture(x, args.kernels)
    torch.cuda.synchronize()
    began = time.perf_counter()
    a.replay()
    torch.cuda.synchronize()
    device_us = (time.perf_counter() - began) * 1e6
    cases = {"idle": [], "same_graph_queued": [], "other_graph_queued": []}
    for _ in range(args.repeats):
        torch.cuda.synchronize()
        cases["idle"].append(timed(a.replay))
        torch.cuda.synchronize()
        a.replay()
        cases["same_graph_queued"].append(timed(a.replay))
        torch.cuda.synchronize()
        a.replay()
        cases["other_graph_queued"].append(timed(b.replay))
    torch.cuda.synchronize()
    out = {"device": torch.cuda.get_device_name(), "kernels": args.kernels, "one_replay_wall_us": round(device_us, 1),
           "launch_host_us_median": {k: round(statistics.median(v), 1) for k, v in cases.items()},
           "launch_host_us_p90": {k: round(sorted(v)[int(0.9 * len(v))], 1) for k, v in cases.items()}}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
