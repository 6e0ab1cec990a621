"""How many kernels each labelled phase runs on the device, and how busy it keeps it: read a Chrome trace that
`SPLITSPEC_TORCH_PROFILE` wrote (`splitspec/device_profile.py`) and report, per phase (the device-side ranges of
engine.*, draft.*, loop.*), the median over its occurrences of its span on the device, its kernels (copies and
memsets counted) and their summed time; --list PHASE prints one occurrence's kernels with the gaps between them.

    python benchmarks/trace_kernels.py OUT/prof/bs1_4x128_EAGLE3.trace.json.gz [--list loop.replay]

A phase whose span is much longer than its busy time waits on the host (launches, copies, Python) or, inside a
CUDA graph, on one launch per kernel: fewer kernels is the remedy there. Profiled runs are slower than unprofiled
ones; compare within a trace, and traces of one call with each other."""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import statistics

DEVICE = ("kernel", "gpu_memcpy", "gpu_memset")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="a .trace.json.gz (or .json) written by SPLITSPEC_TORCH_PROFILE")
    parser.add_argument("--list", metavar="PHASE", help="print the kernels of this phase's middle occurrence")
    args = parser.parse_args()
    opener = gzip.open if args.trace.endswith(".gz") else open
    with opener(args.trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") in DEVICE), key=lambda e: e["ts"])
    starts = [k["ts"] for k in kernels]
    phases: dict[str, list] = {}
    for e in events:
        if e.get("cat") == "gpu_user_annotation":
            phases.setdefault(e["name"], []).append(e)

    def inside(a):
        return kernels[bisect.bisect_left(starts, a["ts"]):bisect.bisect_left(starts, a["ts"] + a["dur"])]

    print(f"{'phase':24} {'times':>6} {'span us':>9} {'kernels':>8} {'busy us':>9}")
    for name, spans in sorted(phases.items()):
        rows = [(a["dur"], len(inside(a)), sum(k["dur"] for k in inside(a))) for a in spans]
        print(f"{name:24} {len(rows):6d} {statistics.median(r[0] for r in rows):9.1f} "
              f"{statistics.median(r[1] for r in rows):8.0f} {statistics.median(r[2] for r in rows):9.1f}")
    if args.list:
        spans = phases.get(args.list) or []
        if not spans:
            raise SystemExit(f"no phase {args.list!r} in the trace")
        a = spans[len(spans) // 2]
        last = a["ts"]
        for k in inside(a):
            print(f"{k['ts'] - a['ts']:9.1f} gap {k['ts'] - last:6.1f} {k['dur']:6.1f} {k['name'][:100]}")
            last = k["ts"] + k["dur"]


if __name__ == "__main__":
    main()
