"""Replay a recorded load-adaptive trace (SPLITSPEC_ADAPTIVE_TRACE=FILE on a verifier or `splitspec bench`) through
the policy as the code stands: the same observations in the same order, every choice made again.

    python -P benchmarks/replay_adaptive.py benchmarks/results/traces/adaptive_demo-ngram_h100_e3e2b2f.served.jsonl.gz \
        --max-budget 12 --num-steps 11

Prints how many choices differ from the recorded ones, the budgets chosen by batch size, and the policy's own
time per choice on this machine (and per choice that kept drafting off: a small model's plain step, ~0.4 ms on a GPU,
pays it every step). What a different choice would have cost is not in a trace: a replay tells
what the policy decides from what it saw, not what the decision would have earned.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import time

from splitspec.verifier_svc.adaptive import AdaptiveSpeculation
from splitspec.verifier_svc.adaptive_estimates import TRACE_ENV, AdaptiveConfig, StepShape


def records(path: str):
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        for line in f:
            yield json.loads(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--max-budget", type=int, required=True, help="--speculative-num-draft-tokens of the run.")
    parser.add_argument("--num-steps", type=int, required=True, help="--speculative-num-steps of the run.")
    parser.add_argument("--chain", action="store_true", help="Top-1 drafts (a chain per budget).")
    args = parser.parse_args()
    os.environ.pop(TRACE_ENV, None)  # the replayed policy records nothing (into the trace it reads, least of all)
    policy = AdaptiveSpeculation(AdaptiveConfig(max_budget=args.max_budget, num_steps=args.num_steps, chain=args.chain))
    differ = total = off = 0
    seconds = off_seconds = 0.0
    by_batch: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for record in records(args.trace):
        if record["kind"] == "observe":
            fields = {k: v for k, v in record.items() if k not in ("kind", "step")}
            fields["accepts"] = [tuple(a) for a in fields["accepts"]]
            policy.observe(StepShape(**fields))
            continue
        was_off = policy.budget == 1
        began = time.perf_counter()
        choice = policy.choose(record["speculating"], record["plain"], record["prefill"])
        spent = time.perf_counter() - began
        seconds += spent
        total += 1
        if was_off and choice == 1 and record["speculating"]:  # drafting off, and staying off
            off, off_seconds = off + 1, off_seconds + spent
        differ += choice != record["choice"]
        by_batch[record["speculating"]][choice] += 1
    print(f"{total} choices, {differ} differ from the trace's; {seconds / max(total, 1) * 1e6:.0f} us per choice here; "
          f"{off} with drafting off that kept it off: {off_seconds / max(off, 1) * 1e6:.1f} us each")
    for batch in sorted(by_batch):
        print(f"  {batch:>4} speculating: " + ", ".join(f"budget {b} x{n}" for b, n in sorted(by_batch[batch].items())))


if __name__ == "__main__":
    main()
