"""Where the GPU waits for the host: read a Chrome trace that `SPLITSPEC_TORCH_PROFILE` wrote (a served verifier's
or an in-process point's, `splitspec/device_profile.py`) and report, per engine step, the device's busy time (its
kernels, copies and memsets, merged) against the step's wall time, and attribute every idle gap of the device to
what the engine thread was doing meanwhile: the innermost labelled phase (engine.*, draft.*, loop.*) and the
innermost op, or "<python>" when no op was running (Python between ops).

    python benchmarks/trace_gaps.py OUT/tprof_8b-eagle3-sim/served_bs32_spec.trace.json.gz

A step is host-bound where the idle time is a large part of it: the device finished what it was given and waited
for the host to give it more. Profiled runs are slower than unprofiled ones (each op is recorded); compare the
proportions within one trace, and traces of one call with each other."""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
import statistics

PHASES = ("engine.", "draft.", "loop.")
DEVICE = ("kernel", "gpu_memcpy", "gpu_memset")


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def busy_intervals(events: list[dict]) -> list[tuple[float, float]]:
    """The device's busy intervals (its events merged), in order."""
    merged: list[list[float]] = []
    for e in sorted((e for e in events if e.get("cat") in DEVICE), key=lambda e: e["ts"]):
        start, end = e["ts"], e["ts"] + e["dur"]
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def analyse(events: list[dict], step_phase: str = "engine.verify", min_gap_us: float = 30.0, samples: int = 10) -> dict:
    phases = sorted((e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith(PHASES)),
                    key=lambda e: e["ts"])
    starts = [e for e in phases if e["name"] == step_phase]
    if len(starts) < 3:
        raise SystemExit(f"fewer than 3 {step_phase} ranges in the trace: no whole step to measure")
    thread = starts[0]["tid"]
    t0, t1 = starts[1]["ts"], starts[-1]["ts"]  # whole steps only (the first and last may be cut)
    steps = len(starts) - 2
    busy = busy_intervals(events)
    busy_in = sum(min(b, t1) - max(a, t0) for a, b in busy if b > t0 and a < t1)
    gaps = [(busy[k][1], busy[k + 1][0]) for k in range(len(busy) - 1) if t0 <= busy[k][1] < t1]
    host = sorted((e for e in events if e.get("tid") == thread
                   and e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation")),
                  key=lambda e: e["ts"])
    host_starts = [e["ts"] for e in host]
    longest = max((e["dur"] for e in host), default=0)

    def active(x: float) -> list[dict]:  # host events running at time x, outermost first
        lo = bisect.bisect_left(host_starts, x - longest)
        hi = bisect.bisect_right(host_starts, x)
        return sorted((e for e in host[lo:hi] if e["ts"] + e["dur"] > x), key=lambda e: -e["dur"])

    by_phase, by_op = collections.Counter(), collections.Counter()
    for a, b in gaps:
        if b - a < min_gap_us:
            continue
        for k in range(samples):  # each gap's time split over what the thread ran at evenly spaced points of it
            stack = active(a + (b - a) * (k + 0.5) / samples)
            labelled = [e["name"] for e in stack if e.get("cat") == "user_annotation" and e["name"].startswith(PHASES)]
            ops = [e["name"] for e in stack if e.get("cat") != "user_annotation"]
            phase = labelled[-1] if labelled else "<no phase>"
            by_phase[phase] += (b - a) / samples
            by_op[f"{phase} | {ops[-1] if ops else '<python>'}"] += (b - a) / samples
    idle = sum(b - a for a, b in gaps)
    per_step = []  # (wall, device busy) of each whole step: a prefill among them shows here, not in the medians
    for s0, s1 in zip(starts[1:-1], starts[2:]):
        a, b = s0["ts"], s1["ts"]
        per_step.append(((b - a) / 1e3, sum(min(y, b) - max(x, a) for x, y in busy if y > a and x < b) / 1e3))
    return {"steps": steps, "step_ms": (t1 - t0) / steps / 1e3, "device_busy_ms": busy_in / steps / 1e3,
            "median_step_ms": statistics.median(w for w, _ in per_step),
            "median_device_busy_ms": statistics.median(d for _, d in per_step),
            "device_idle_ms": idle / steps / 1e3,
            "idle_in_gaps_over_ms": {"min_gap_us": min_gap_us,
                                     "ms": sum(b - a for a, b in gaps if b - a >= min_gap_us) / steps / 1e3,
                                     "gaps_per_step": sum(1 for a, b in gaps if b - a >= min_gap_us) / steps},
            "idle_by_phase_ms": {k: round(v / steps / 1e3, 3) for k, v in by_phase.most_common()},
            "idle_by_phase_and_op_ms": {k: round(v / steps / 1e3, 3) for k, v in by_op.most_common(25)}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+", help="Chrome traces (.json or .json.gz) written by SPLITSPEC_TORCH_PROFILE.")
    parser.add_argument("--step-phase", default="engine.verify", help="The phase that opens every step (default %(default)s).")
    parser.add_argument("--min-gap-us", type=float, default=30.0, help="Idle gaps shorter than this are counted, not "
                        "attributed (default %(default)s).")
    parser.add_argument("--json", action="store_true", help="One JSON object per trace instead of text.")
    args = parser.parse_args(argv)
    for path in args.traces:
        report = analyse(load(path), args.step_phase, args.min_gap_us)
        if args.json:
            print(json.dumps({"trace": path, **report}))
            continue
        print(f"{path}: {report['steps']} whole steps, {report['step_ms']:.2f} ms each; device busy "
              f"{report['device_busy_ms']:.2f} ms, idle {report['device_idle_ms']:.2f} ms "
              f"({report['idle_in_gaps_over_ms']['ms']:.2f} ms in {report['idle_in_gaps_over_ms']['gaps_per_step']:.0f} "
              f"gaps of >= {args.min_gap_us:.0f} us); median step {report['median_step_ms']:.2f} ms, of which the device "
              f"was busy {report['median_device_busy_ms']:.2f} ms")
        print("  device idle, by the engine thread's innermost phase (ms per step):")
        for name, ms in report["idle_by_phase_ms"].items():
            print(f"    {name:28s} {ms:7.2f}")
        print("  by phase and innermost op (<python>: no op running):")
        for name, ms in report["idle_by_phase_and_op_ms"].items():
            print(f"    {name:60s} {ms:7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
