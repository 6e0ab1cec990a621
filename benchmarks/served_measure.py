"""What benchmarks/served.py measures beside the benches' own reports: the served services' processes and their
CPU, the machine's host speed while each side runs, the served verifier's engine loop from its /metrics; and the two
reports' points paired round by round (ratios)."""

from __future__ import annotations

import os
import time
import urllib.request
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """Every process below pid (Linux /proc; `up` starts each service in a session of its own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], list(children.get(pid, []))
    while todo:
        out.append(todo.pop())
        todo += children.get(out[-1], [])
    return out


def service_name(argv: list[str]) -> str:
    """A service's name from its command line: `python -m splitspec gateway ...` -> gateway, `python -m
    splitspec.verifier_svc.front_process ...` -> front_process."""
    if "-m" in argv[:-1]:
        module = argv[argv.index("-m") + 1]
        rest = argv[argv.index("-m") + 2:]
        return rest[0] if module == "splitspec" and rest else module.rsplit(".", 1)[-1]
    return Path(argv[0]).name if argv else "?"


def process_cpu(pids: list[int]) -> dict[int, tuple[str, float]]:
    """{pid: (service name, CPU seconds so far: user + system)} of these processes (Linux /proc)."""
    ticks, out = os.sysconf("SC_CLK_TCK"), {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            argv = [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
        except OSError:
            continue
        out[pid] = (service_name(argv), (int(fields[11]) + int(fields[12])) / ticks)
    return out


def cpu_report(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], wall: float,
               requests: int) -> dict:
    """Each service's CPU over the timed served run, summed over its processes: seconds, the share of the run's wall
    time (near 1.0 per process: that process was the queue) and per request."""
    out: dict[str, dict] = {}
    for pid, (name, seconds) in after.items():
        entry = out.setdefault(name, {"processes": 0, "cpu_s": 0.0})
        entry["processes"] += 1
        entry["cpu_s"] += seconds - before.get(pid, (name, 0.0))[1]
    for entry in out.values():
        entry["cpu_s"] = round(entry["cpu_s"], 2)
        entry["share_of_wall"] = round(entry["cpu_s"] / wall, 3) if wall else None
        entry["per_request_ms"] = round(1e3 * entry["cpu_s"] / requests, 3) if requests else None
    return out


class HostSpeed:
    """The machine's CPU speed while a side runs: a thread of this (otherwise waiting) process times a fixed
    plain-Python loop (splitspec.step_log.calibration_us) every `period` seconds. On a lent VM it moved by 2x within a
    minute, between runs and within one (docs/performance.md, 2026-12-02), so a host-bound point's served/in-process
    ratio compares CPUs as much as code unless both sides' speeds are alike; the report carries both."""

    def __init__(self, period: float = 0.1):
        import threading

        self.period, self.samples, self.times, self.stop = period, [], [], threading.Event()
        self.thread = threading.Thread(target=self._run, name="host-speed", daemon=True)

    def _run(self) -> None:
        from splitspec.step_log import calibration_us

        while not self.stop.wait(self.period):
            self.samples.append(calibration_us())
            self.times.append(time.perf_counter())

    def __enter__(self) -> "HostSpeed":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()

    def during(self, windows: list[list[float]] | None) -> float | None:
        """The median sample taken within a bench row's windows (its rounds' windows_s, else its window_s;
        perf_counter is the system's monotonic clock, the same in the bench's process as in this one); None without
        samples there."""
        import statistics

        inside = [us for us, at in zip(self.samples, self.times)
                  if any(w[0] <= at <= w[1] for w in windows or [])]
        return round(statistics.median(inside), 1) if inside else None

    def mark_rows(self, report: dict) -> None:
        """Each row of a bench report gets host_us: the machine's speed while that point ran."""
        for row in report.get("rows", []):
            row["host_us"] = self.during(row.get("windows_s") or ([row["window_s"]] if row.get("window_s") else None))

    def report(self, windows: list[list[float]] | None = None) -> dict:
        """The samples' median and spread: all of them, or those taken within these windows."""
        import statistics

        samples = [us for us, at in zip(self.samples, self.times)
                   if windows is None or any(w[0] <= at <= w[1] for w in windows)]
        if not samples:
            return {"samples": 0}
        q = statistics.quantiles(samples, n=10) if len(samples) > 1 else [samples[0]] * 9
        return {"samples": len(samples), "median_us": round(statistics.median(samples), 1),
                "p10_us": round(q[0], 1), "p90_us": round(q[-1], 1)}


def loop_totals(metrics_url: str) -> dict[str, float]:
    """The verifier's engine-loop and step-phase histograms' sums and counts, by part and phase."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in ("splitspec:engine_loop_seconds", "splitspec:step_phase_seconds"):
            continue
        for sample in family.samples:
            if sample.name.endswith(("_sum", "_count")):
                key = f"{sample.labels.get('part') or sample.labels.get('phase')}{sample.name[sample.name.rindex('_'):]}"
                totals[key] = totals.get(key, 0.0) + sample.value
    return totals


def loop_report(before: dict[str, float], after: dict[str, float]) -> dict:
    """Per busy loop iteration (one engine step) over the served bench: mean ms of each part and phase."""
    steps = after.get("step_count", 0.0) - before.get("step_count", 0.0)
    names = sorted({k.rsplit("_", 1)[0] for k in after if k.endswith("_sum")})
    return {"steps": int(steps), "mean_ms": {name: round((after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0))
                                                          / steps * 1e3, 4) if steps else None for name in names}}


def _median(values: list[float], digits: int = 3) -> float | None:
    import statistics

    values = [v for v in values if v is not None]
    return round(statistics.median(values), digits) if values else None


def ratios(served: dict, in_process: dict) -> list[dict]:
    """Every point both sides measured (batch size, plain or speculative): each side's tok/s (the median of its rounds'),
    served over in process (the median of the rounds' paired ratios) and, speculative, each side's speedup over its
    own plain decoding (the median of the rounds' ratios)."""
    def rounds_of(report: dict) -> dict[tuple[int, bool], dict[int, dict]]:
        out: dict[tuple[int, bool], dict[int, dict]] = {}
        for row in report["rows"]:  # the first grid point's rows (served runs the server's one tree)
            out.setdefault((row["batch_size"], row["speculative"] is not None), {}).setdefault(row.get("round", 0), row)
        return out

    outside, inside = rounds_of(served), rounds_of(in_process)
    out = []
    for key, rows in outside.items():
        twins = inside.get(key, {})
        pairs = [(rows[r], twins[r]) for r in sorted(rows) if r in twins]
        if not pairs:
            continue
        split = [(s["output_tok_s"], i["output_tok_s"]) for s, i in pairs]
        point = {"batch_size": key[0], "speculative": pairs[0][0]["speculative"],
                 "served_tok_s": _median([s for s, _ in split]), "in_process_tok_s": _median([i for _, i in split]),
                 "served_over_in_process": _median([s / i if i else None for s, i in split]),
                 "served_accept_length": _median([s.get("accept_length") for s, _ in pairs]),
                 "in_process_accept_length": _median([i.get("accept_length") for _, i in pairs]),
                 # the share of output tokens drafted steps made: low, and a speedup is the undrafted steps'
                 "served_drafted_token_share": _median([s.get("drafted_token_share") for s, _ in pairs]),
                 "in_process_drafted_token_share": _median([i.get("drafted_token_share") for _, i in pairs]),
                 "served_errors": sum(len(s.get("errors") or []) for s, _ in pairs),
                 # the host's speed during each side's point (HostSpeed, median us of its loop; lower is faster)
                 "host_us": {"served": _median([s.get("host_us") for s, _ in pairs]),
                             "in_process": _median([i.get("host_us") for _, i in pairs])},
                 # the load's client's own CPU over the served point (a share near 1: the client limits it)
                 "served_client_cpu_share": _median([(s.get("client_cpu") or {}).get("share_of_wall") for s, _ in pairs],
                                                    digits=5)}
        if len(pairs) > 1:
            point["rounds"] = [{"served_tok_s": s, "in_process_tok_s": i, "ratio": round(s / i, 3) if i else None}
                               for s, i in split]
        if key[1]:  # speculation's gain as each side sees it, round by round
            for side, plain_rows in (("served", outside.get((key[0], False), {})),
                                     ("in_process", inside.get((key[0], False), {}))):
                mine = rows if side == "served" else twins
                point[f"{side}_speedup"] = _median([mine[r]["output_tok_s"] / plain_rows[r]["output_tok_s"]
                                                    for r in mine if r in plain_rows and plain_rows[r]["output_tok_s"]])
        out.append(point)
    return out
