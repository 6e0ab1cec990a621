"""Read step logs (SPLITSPEC_STEP_LOG=PREFIX: splitspec/step_log.py) back, one line per bench point and side: where
a point's wall time and its requests' time to first token went.

    python benchmarks/step_timeline.py PREFIX.*.jsonl [--json]

A served point pairs the bench client's log ("client": its requests and the point's window) with the verifier's
("verifier": arrivals, steps, publications in that window); an in-process point is one log ("in_process"). For
each point:
- steps by kind (decode: no prompt tokens; mixed: prompt chunks and decoding requests; prefill: prompt chunks
  alone), their count and mean duration, a decode cycle (one decode step's start to the next's: the step and the
  loop's turn after it), and how long the engine sat idle (over 1 ms at a time) between steps while the point ran;
- the mean time to first token split into its legs: in (sent by the client -> reached the engine's process),
  engine (-> the first token's publication) and out (-> the client has it); with the gateway's and the front's logs,
  the way in by the mean time from the send to each point it passes. Means of differences are differences
  of means, so no request has to be matched across processes; every log is on the machine's monotonic clock.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def read(path: Path) -> list[dict]:
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:  # a process killed mid-line leaves its last line torn
            continue
    return events


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1e3, 3)


def _time(e: dict) -> float:
    return e.get("received", e.get("began", e.get("at", 0.0)))


def point_report(point: dict, clients: list[dict], engine: list[dict]) -> dict:
    """One point: its clients (the requests the bench timed) against the engine events inside its window."""
    began, ended = point["began"], point["ended"]
    inside = [e for e in engine if began <= _time(e) <= ended]
    steps = [e for e in inside if e["kind"] == "step"]
    arrivals = [e["received"] for e in inside if e["kind"] == "arrive"]
    firsts = [e["at"] for e in inside if e["kind"] == "publish" for _ in range(e["first"])]
    kinds: dict[str, list[float]] = {"decode": [], "mixed": [], "prefill": []}
    for s in steps:
        decoding = s["forward_tokens"] > s["prefill_tokens"]
        kind = "decode" if not s["prefill_tokens"] else "mixed" if decoding else "prefill"
        kinds[kind].append(s["ended"] - s["began"])
    decodes = [s for s in steps if not s["prefill_tokens"]]
    phases = sorted({k for s in decodes for k in s["ms"]})
    gaps = [b["began"] - a["ended"] for a, b in zip(steps, steps[1:])]
    idle = [g for g in gaps if g > 1e-3]  # longer than the loop's own turn between two steps
    # a decode step's start to the next's, both decoding: the step and the loop's turn after it (a served verifier
    # publishes the step's deltas there, ~1 ms at batch 64 on an H200), so what sets a decode's throughput
    cycles = [b["began"] - a["began"] for a, b in zip(steps, steps[1:]) if not a["prefill_tokens"] and not b["prefill_tokens"]]
    sent = [c["sent"] for c in clients]
    first = [c["first"] for c in clients if c["first"] is not None]
    report = {
        "batch_size": point["batch_size"], "speculative": point["speculative"], "requests": len(clients),
        "wall_ms": _ms(ended - began),
        "steps": {k: {"count": len(v), "mean_ms": _ms(_mean(v)), "total_ms": _ms(sum(v))} for k, v in kinds.items()},
        "idle_between_steps_ms": _ms(sum(idle)), "idle_gaps": len(idle), "decode_cycle_ms": _ms(_mean(cycles)),
        "ttft_ms": _ms(_mean(first) - _mean(sent)) if first and len(first) == len(sent) else None,
        # a decode step's phases and what its thread got meanwhile (older logs: no cpu_ms, gc_ms, switches)
        "decode_step_ms": {k: round(statistics.fmean(s["ms"].get(k, 0.0) for s in decodes), 3) for k in phases},
        "decode_step_host": {k: round(statistics.fmean(f(s) for s in decodes), 3) for k, f in (
            ("cpu_ms", lambda s: s["cpu_ms"]), ("gc_ms", lambda s: s["gc_ms"]),
            ("involuntary_switches", lambda s: s["switches"][1]))} if decodes and "cpu_ms" in decodes[0] else None,
    }
    probes = [e for e in inside if e["kind"] == "probe"]
    if probes:  # the loop thread's speed at plain Python, the CPUs it ran on, the VM's steal time (step_log.py)
        steal = [e["steal_ticks"] for e in probes if e.get("steal_ticks") is not None]
        cpus = [e["cpu"] for e in probes]
        report["probes"] = {"count": len(probes), "calib_us_median": round(statistics.median(e["calib_us"] for e in probes), 1),
                            "cpus": sorted({c for c in cpus if c is not None}),
                            "moves": sum(1 for a, b in zip(cpus, cpus[1:]) if a != b),
                            "steal_ticks": steal[-1] - steal[0] if len(steal) > 1 else None}
    hops: dict[str, list[float]] = {}
    for e in inside:
        if e["kind"] == "hop":
            hops.setdefault(e["name"], []).append(e["at"])
    # the way in, leg by leg: the mean time from the client's send to each named point (gateway, front), then the engine
    report["in_hops_ms"] = {name: _ms(_mean(at) - _mean(sent)) for name, at in sorted(hops.items(), key=lambda kv: _mean(kv[1]))
                            if len(at) == len(sent)} or None
    if len(arrivals) == len(sent) and len(firsts) == len(first) == len(sent):
        report["ttft_legs_ms"] = {"in": _ms(_mean(arrivals) - _mean(sent)), "engine": _ms(_mean(firsts) - _mean(arrivals)),
                                  "out": _ms(_mean(first) - _mean(firsts))}
    else:  # a request the window cut (or a log left out): the legs would not add up
        report["ttft_legs_ms"] = None
        report["counts"] = {"sent": len(sent), "arrived": len(arrivals), "first_published": len(firsts),
                            "first_seen": len(first)}
    return report


def points_of(events: list[dict]) -> list[tuple[dict, list[dict]]]:
    """(point, its client events) in order: a point's client lines come right before it."""
    out, pending = [], []
    for e in events:
        if e["kind"] == "client":
            pending.append(e)
        elif e["kind"] == "point":
            out.append((e, pending))
            pending = []
    return out


def analyse(paths: list[Path]) -> list[dict]:
    by_name: dict[str, list[dict]] = {}
    for path in paths:
        name = path.name.split(".")[-3] if path.name.count(".") >= 2 else path.stem
        by_name.setdefault(name, []).extend(read(path))
    rows = []
    for side, client_name, engine_name in (("served", "client", "verifier"), ("in_process", "in_process", "in_process")):
        if client_name not in by_name:
            continue
        hops = [e for name in ("gateway", "front") for e in by_name.get(name, [])] if side == "served" else []
        engine = sorted([e for e in by_name.get(engine_name, []) if e["kind"] in ("arrive", "step", "publish", "probe")] + hops,
                        key=_time)
        for point, clients in points_of(by_name[client_name]):
            rows.append({"side": side, **point_report(point, clients, engine)})
    return rows


def line(row: dict) -> str:
    steps = "; ".join(f"{k} {v['count']}" + (f" x {v['mean_ms']:.2f} ms" if v["count"] else "")
                      + (f" (a cycle {row['decode_cycle_ms']:.2f} ms)" if k == "decode" and row.get("decode_cycle_ms") else "")
                      for k, v in row["steps"].items())
    legs = row["ttft_legs_ms"]
    ttft = "n/a" if row["ttft_ms"] is None else f"{row['ttft_ms']:.1f} ms"
    if legs:
        ttft += f" = in {legs['in']:.1f} + engine {legs['engine']:.1f} + out {legs['out']:.1f}"
    if row.get("in_hops_ms"):
        ttft += " (in: " + ", ".join(f"{k} {v:.1f}" for k, v in row["in_hops_ms"].items()) + ")"
    text = (f"{row['side']:<10} bs{row['batch_size']:<3} {'spec ' if row['speculative'] else 'plain'}: "
            f"{row['requests']} requests in {row['wall_ms']:.0f} ms; steps: {steps}; idle between steps "
            f"{row['idle_between_steps_ms']:.1f} ms in {row['idle_gaps']} gaps; TTFT {ttft}")
    if row["decode_step_ms"]:
        text += "\n    decode step phases (ms): " + " ".join(f"{k} {v:.2f}" for k, v in row["decode_step_ms"].items())
    if row["decode_step_host"]:
        host = row["decode_step_host"]
        text += (f"; its thread's CPU {host['cpu_ms']:.2f} ms, GC {host['gc_ms']:.2f} ms, "
                 f"{host['involuntary_switches']:.2f} involuntary switches")
    if row.get("probes"):
        p = row["probes"]
        text += (f"\n    thread probes: {p['count']}, plain-Python calibration {p['calib_us_median']:.1f} us (median), "
                 f"CPUs {p['cpus']} ({p['moves']} moves), steal {p['steal_ticks']} ticks")
    return text


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", type=Path, help="PREFIX.<name>.<pid>.jsonl files (one case)")
    parser.add_argument("--json", action="store_true", help="One JSON object per point instead of text.")
    args = parser.parse_args(argv)
    for row in analyse(args.logs):
        print(json.dumps(row) if args.json else line(row))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
