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
    """Consecutive steps of plain requests or of speculating ones; prompt-only steps go with the point of the step after
    them (a point's first prompts begin it; those of its arrivals are its own)."""
    out: list[tuple[str, list[dict]]] = []
    held: list[dict] = []
    for step in steps:
        kind = "plain" if step["plain"] and not step["speculating"] else "spec" if step["speculating"] else None
        if kind is None:
            held.append(step)
            continue
        if not out or out[-1][0] != kind:
            out.append((kind, []))
        out[-1][1].extend(held)
        out[-1][1].append(step)
        held = []
    if held and out:
        out[-1][1].extend(held)
    return out


def category(step: dict, full: int) -> str:
    if prompt(step):
        return "mixed" if batch(step) else "prompt"
    size = "full" if batch(step) >= full else "8-15" if batch(step) >= 8 else "<8"
    return ("drafted " if drafted(step) else "off ") + size


def report(steps: list[dict], skip: int) -> dict:
    """The points (each part's steps, ms and tokens a ms), the pairs' ratios and the arrivals' costs."""
    full = max(batch(s) for s in steps)
    out, rates = {"full_batch": full, "points": []}, []
    for kind, point in points(steps)[skip:]:
        parts: dict[str, dict] = {}
        for step in point:
            part = parts.setdefault(category(step, full), {"steps": 0, "ms": 0.0, "tokens": 0})
            part["steps"], part["ms"], part["tokens"] = part["steps"] + 1, part["ms"] + cycle(step), part["tokens"] + tokens(step)
        out["points"].append({"kind": kind, "ms": sum(p["ms"] for p in parts.values()), "parts": parts})
        at_full = [s for s in point if batch(s) >= full - 1]
        rates.append((sum(map(tokens, point)) / sum(map(cycle, point)),
                      sum(map(tokens, at_full)) / max(sum(map(cycle, at_full)), 1e-9)))
    pairs = list(zip(rates[::2], rates[1::2]))
    out["ratio_every_step"] = [s[0] / p[0] for p, s in pairs]
    out["ratio_full_batch"] = [s[1] / p[1] for p, s in pairs]
    arrivals = [(cycle(step), cycle(steps[i + 1]), batch(step) > 0) for i, step in enumerate(steps[:-1])
                if i and prompt(step) and steps[i - 1]["speculating"] >= full - 2]
    if arrivals:
        out["arrivals"] = {"count": len(arrivals), "mixed": sum(a[2] for a in arrivals),
                           "prompt_ms": statistics.median(a[0] for a in arrivals),
                           "next_ms": statistics.median(a[1] for a in arrivals),
                           "both_ms": statistics.median(a[0] + a[1] for a in arrivals)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--skip", type=int, default=2,
                        help="Points to leave out first (served.py's warm-up: its plain and speculative points).")
    parser.add_argument("--json", action="store_true", help="The report as JSON.")
    args = parser.parse_args()
    with (gzip.open(args.trace, "rt") if args.trace.endswith(".gz") else open(args.trace)) as f:
        steps = [s for s in (json.loads(line) for line in f) if s["kind"] == "observe"]
    out = report(steps, args.skip)
    if args.json:
        print(json.dumps(out))
        return
    for point in out["points"]:
        print(f"{point['kind']:5} {point['ms']:7.1f} ms  " + "  ".join(
            f"{name} {p['steps']}/{p['ms']:.0f}ms/{p['tokens'] / p['ms']:.1f}" for name, p in sorted(point["parts"].items())
            if p["ms"]))
    print("(each part: steps/ms/tokens a ms)")
    print("speculating over plain, tokens a ms, every step:", [round(r, 3) for r in out["ratio_every_step"]])
    print(f"the same, steps at batch {out['full_batch'] - 1}-{out['full_batch']} only:",
          [round(r, 3) for r in out["ratio_full_batch"]])
    if "arrivals" in out:
        a = out["arrivals"]
        print(f"arrivals into a speculating batch of {out['full_batch'] - 2}+: {a['count']}, {a['mixed']} mixed; median "
              f"prompt step {a['prompt_ms']:.2f} ms, the next {a['next_ms']:.2f}, both {a['both_ms']:.2f}")


if __name__ == "__main__":
    main()
