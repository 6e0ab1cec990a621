"""A served trace's rounds, step by step (SPLITSPEC_ADAPTIVE_TRACE, which `gpu_bench.sh served` records per case and
side): each point of a `served.py --rounds` run (plain requests, then speculating ones, alternating) split into prompt
steps (prefill alone, or mixed beside decoding requests), drafted steps at the full batch, at 8-15 and below 8 (a
point's desynchronised arrivals and its tail), and plain or drafting-off steps, with their time and tokens a ms; each
pair's ratio of tokens a ms over the steps (what the bench's speedup reads, from the engine's side) and over the steps
at the full batch only (the point without its tail); and what an arrival into a running batch cost: its prompt step and
the step after it (medians).

    python benchmarks/trace_rounds.py benchmarks/results/traces/adaptive_demo-ngram-bs16-auto_h200_f043c12.served.jsonl.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics


def cycle(step: dict) -> float:
    return (step["verify_seconds"] + step["spec_seconds"] + step["base_seconds"]) * 1e3


def batch(step: dict) -> int:
    return step["speculating"] + step["plain"]


def prompt(step: dict) -> bool:
    return step["forward_tokens"] > step["speculating"] * step["budget"] + step["plain"]


def drafted(step: dict) -> bool:
    return step["budget"] > 1 and step["speculating"] > 0


def tokens(step: dict) -> int:
    if not drafted(step):
        return batch(step)
    return (sum(1 + a for _, a in step["accepts"]) + max(step["speculating"] - len(step["accepts"]), 0)
            + step["plain"])


def points(steps: list[dict]) -> list[tuple[str, list[dict]]]:
    """Consecutive steps of plain requests or of speculating ones (a prompt-only step joins the point it falls in)."""
    out: list[tuple[str, list[dict]]] = []
    for step in steps:
        kind = "plain" if step["plain"] and not step["speculating"] else "spec" if step["speculating"] else None
        kind = kind or (out[-1][0] if out else "prefill")
        if not out or out[-1][0] != kind:
            out.append((kind, []))
        out[-1][1].append(step)
    return out


def category(step: dict, full: int) -> str:
    if prompt(step):
        return "mixed" if batch(step) else "prompt"
    size = "full" if batch(step) >= full else "8-15" if batch(step) >= 8 else "<8"
    return ("drafted " if drafted(step) else "off ") + size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--skip", type=int, default=3, help="Points to leave out first (the warm-up's, by default).")
    args = parser.parse_args()
    with (gzip.open(args.trace, "rt") if args.trace.endswith(".gz") else open(args.trace)) as f:
        steps = [s for s in (json.loads(line) for line in f) if s["kind"] == "observe"]
    full = max(batch(s) for s in steps)
    rates = []
    for kind, point in points(steps)[args.skip:]:
        parts: dict[str, list[float]] = {}
        for step in point:
            part = parts.setdefault(category(step, full), [0, 0.0, 0])
            part[0], part[1], part[2] = part[0] + 1, part[1] + cycle(step), part[2] + tokens(step)
        print(f"{kind:5} {sum(p[1] for p in parts.values()):7.1f} ms  " + "  ".join(
            f"{name} {n}/{ms:.0f}ms/{made / ms:.1f}" for name, (n, ms, made) in sorted(parts.items()) if ms))
        at_full = [s for s in point if batch(s) >= full - 1]
        rates.append((sum(map(tokens, point)) / sum(map(cycle, point)),
                      sum(map(tokens, at_full)) / max(sum(map(cycle, at_full)), 1e-9)))
    pairs = list(zip(rates[::2], rates[1::2]))
    print("(each part: steps/ms/tokens a ms)")
    print("speculating over plain, tokens a ms, every step:", [round(s[0] / p[0], 3) for p, s in pairs])
    print(f"the same, steps at batch {full - 1}-{full} only:", [round(s[1] / p[1], 3) for p, s in pairs])
    arrivals = [(cycle(step), cycle(steps[i + 1]), batch(step) > 0) for i, step in enumerate(steps[:-1])
                if i and prompt(step) and steps[i - 1]["speculating"] >= full - 2]
    if arrivals:
        print(f"arrivals into a speculating batch of {full - 2}+: {len(arrivals)}, {sum(a[2] for a in arrivals)} mixed; "
              f"median prompt step {statistics.median(a[0] for a in arrivals):.2f} ms, the next "
              f"{statistics.median(a[1] for a in arrivals):.2f}, both {statistics.median(a[0] + a[1] for a in arrivals):.2f}")


if __name__ == "__main__":
    main()
