"""What a batch-1 policy could make of a recorded trace's requests (SPLITSPEC_ADAPTIVE_TRACE of a served or in-process
point): each request's mean accepted drafts where it drafted, and the point's median step costs (a drafted step's
whole cycle, a drafting-off step's, a prompt's), then tokens/s if every request drafted throughout, if none did, and
if each did exactly when drafting pays for it (an oracle that knows each request's acceptance in advance). Requests
differ (a prompt that loops accepts nearly everything, another little), so drafting pays for some and not others: the
oracle bounds any per-request choice at these step costs. No assertions.

    python benchmarks/request_mix_bound.py benchmarks/results/traces/adaptive_demo-eagle3-chain_h200_aa4d769.served.jsonl.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--output-len", type=int, default=128, help="New tokens per request in the recorded load.")
    parser.add_argument("--min-drafted", type=int, default=5, help="Drafted steps a request needs to be counted.")
    args = parser.parse_args()
    opener = gzip.open if args.trace.endswith(".gz") else open
    with opener(args.trace, "rt") as f:
        rows = [json.loads(line) for line in f if '"observe"' in line]
    requests, current, prompts = [], None, []
    drafted, off = [], []
    for r in rows:
        if r["speculating"] + r["plain"] > 1:
            continue
        if r["forward_tokens"] and r["speculating"] + r["plain"] == 0:  # a prompt alone: the next request starts
            prompts.append(r["verify_seconds"] + r["spec_seconds"] + r["base_seconds"])
            current = []
            requests.append(current)
        elif current is not None and r["speculating"] == 1:
            if r["accepts"]:
                current += [a for _, a in r["accepts"]]
                drafted.append(r["verify_seconds"] + r["spec_seconds"] + r["base_seconds"])
            elif not r["forward_tokens"]:
                off.append(r["base_seconds"])
    means = [statistics.mean(a) for a in requests if len(a) >= args.min_drafted]
    if not means or not drafted or not off:
        raise SystemExit("the trace has no batch-1 speculative point with both drafted and drafting-off steps")
    d, o, p = statistics.median(drafted), statistics.median(off), statistics.median(prompts)
    n = args.output_len

    def rate(choose) -> float:
        seconds = sum(p + (n / (1 + m) * d if choose(m) else n * o) for m in means)
        return n * len(means) / seconds

    breakeven = d / o - 1
    print(json.dumps({
        "trace": args.trace, "requests": len(means), "drafted_step_ms": round(d * 1e3, 3), "off_step_ms": round(o * 1e3, 3),
        "prompt_step_ms": round(p * 1e3, 3), "mean_accepted_per_request": sorted(round(m, 2) for m in means),
        "breakeven_accepted": round(breakeven, 2),
        "tok_s": {"every_request_drafts": round(rate(lambda m: True)), "none_drafts": round(rate(lambda m: False)),
                  "oracle_per_request": round(rate(lambda m: m > breakeven))},
    }, indent=1))


if __name__ == "__main__":
    main()
