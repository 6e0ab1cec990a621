"""Host time per small CUDA operator on the main thread and on another thread of the same process (issue 31: the
demo target's engine step took ~1.45x longer on a thread than on the main thread, benchmarks/neighbours.sh).

    python -P benchmarks/thread_ops.py [--device cuda] [--iters 20000]

Prints microseconds per iteration (empty, copy_, add, index_select, a 1-element copy to the host every 64) for each
variant; run it under MALLOC_ARENA_MAX=1 too, to tell glibc's per-thread malloc arenas from the rest."""

from __future__ import annotations

import argparse
import json
import threading
import time

import torch


def loop(device: str, iters: int) -> float:
    x = torch.zeros(16, 64, device=device)
    idx = torch.arange(8, device=device)
    for i in range(iters // 10):  # warm
        torch.empty(16, 64, device=device).copy_(x).add_(1).index_select(0, idx)
    start = time.perf_counter()
    for i in range(iters):
        y = torch.empty(16, 64, device=device)
        y.copy_(x)
        z = y + 1
        z.index_select(0, idx)
        if i % 64 == 0:
            z[0, 0].item()
    return (time.perf_counter() - start) / iters * 1e6


def on_thread(fn, *args):
    out = []
    worker = threading.Thread(target=lambda: out.append(fn(*args)))
    worker.start()
    worker.join()
    return out[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--iters", type=int, default=20000)
    args = parser.parse_args()
    result = {}
    for round_ in range(2):
        result[f"main_{round_}"] = round(loop(args.device, args.iters), 2)
        result[f"thread_{round_}"] = round(on_thread(loop, args.device, args.iters), 2)
    with torch.inference_mode():
        result["main_inference_mode"] = round(loop(args.device, args.iters), 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
