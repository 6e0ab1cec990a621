"""What a recorded load-adaptive trace (SPLITSPEC_ADAPTIVE_TRACE; gpu_bench.sh served writes one per case and side)
says a decode cycle cost, by batch size: steps of plain requests and speculating steps with drafting off (both
overlapped: the whole cycle, the forward under the host's work), and drafted steps (their count and total time: the
tries and probes a point paid).

    python -P benchmarks/trace_cycles.py benchmarks/results/traces/adaptive_demo-eagle3-bs16_h200_546a5a4.served.jsonl.gz
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import statistics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--min-batch", type=int, default=2, help="Batch sizes below this are left out.")
    args = parser.parse_args()
    plain, off, drafted = (collections.defaultdict(list) for _ in range(3))
    with (gzip.open(args.trace, "rt") if args.trace.endswith(".gz") else open(args.trace)) as f:
        lines = [json.loads(line) for line in f]
    for r in lines:
        batch = r["kind"] == "observe" and r["speculating"] + r["plain"]
        if not batch or batch < args.min_batch:
            continue
        cycle = (r["verify_seconds"] + r["spec_seconds"] + r["base_seconds"]) * 1e3
        if r["budget"] >= 2 and r["speculating"]:
            drafted[batch].append(cycle)
        elif r["forward_tokens"] == 0:  # overlapped: the base is the whole cycle
            (off if r["speculating"] else plain)[batch].append(cycle)
    for batch in sorted(set(plain) | set(off) | set(drafted)):
        parts = [f"batch {batch:3d}"]
        for name, table in (("plain", plain), ("drafting off", off)):
            if table[batch]:
                parts.append(f"{name} {len(table[batch])} steps, median {statistics.median(table[batch]):.3f} ms")
        if drafted[batch]:
            parts.append(f"drafted {len(drafted[batch])} steps, {sum(drafted[batch]):.1f} ms in all")
        print("; ".join(parts))


if __name__ == "__main__":
    main()
