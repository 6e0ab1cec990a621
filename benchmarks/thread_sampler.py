"""Which threads of which processes use the machine's CPUs, and on which CPUs, while a benchmark runs.

    python benchmarks/thread_sampler.py --out threads.txt --interval 0.5 &   # then run the benchmark; kill it after

Reads /proc (no dependency): every interval, each thread's CPU time since the last sample (utime + stime) and the
CPU it last ran on. Writes the CPU topology first (which logical CPUs share a physical core), then one line per
sample for the busiest threads (over --min-percent of one CPU), and on SIGTERM / SIGINT a summary: per thread,
its mean share of a CPU over the samples it was busy in and the CPUs it ran on. Used to tell whether a served
engine thread shares its physical core (a hyperthread sibling) or its CPU with the gateway, the front or the client.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from collections import defaultdict
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


def topology() -> str:
    cores = defaultdict(list)
    for cpu in sorted(Path("/sys/devices/system/cpu").glob("cpu[0-9]*"), key=lambda p: int(p.name[3:])):
        siblings = cpu / "topology" / "thread_siblings_list"
        if siblings.exists():
            cores[siblings.read_text().strip()].append(int(cpu.name[3:]))
    return f"{os.cpu_count()} logical CPUs, {len(cores)} physical cores; siblings: " + " ".join(sorted(cores, key=lambda s: int(s.split(",")[0].split("-")[0])))


def threads() -> dict[tuple[int, int], tuple[str, str, int, int]]:
    """(pid, tid) -> (process name, thread name, cpu ticks, last CPU)."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            name = " ".join(a.decode(errors="replace") for a in cmdline[:6] if a).replace("\n", " ")[-60:] or proc.name
            for task in (proc / "task").iterdir():
                stat = (task / "stat").read_text()
                comm = stat[stat.index("(") + 1 : stat.rindex(")")]
                fields = stat[stat.rindex(")") + 2 :].split()
                found[(int(proc.name), int(task.name))] = (name, comm, int(fields[11]) + int(fields[12]), int(fields[36]))
        except (OSError, ValueError, IndexError):
            continue
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="Text file to write.")
    parser.add_argument("--interval", type=float, default=0.5, help="Seconds between samples.")
    parser.add_argument("--min-percent", type=float, default=10.0, help="Threads using less of a CPU are not listed.")
    args = parser.parse_args()
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    busy = defaultdict(list)  # (pid, tid) -> [percent, ...] over the samples it was listed in
    cpus = defaultdict(set)
    names = {}
    with open(args.out, "w") as out:
        out.write(topology() + "\n")
        before, then = threads(), time.monotonic()
        while not stop:
            time.sleep(args.interval)
            now_threads, now = threads(), time.monotonic()
            elapsed = now - then
            rows = []
            for key, (name, comm, ticks, cpu) in now_threads.items():
                if key in before:
                    percent = 100.0 * (ticks - before[key][2]) / TICKS / elapsed
                    if percent >= args.min_percent:
                        rows.append((percent, key, name, comm, cpu))
                        busy[key].append(percent)
                        cpus[key].add(cpu)
                        names[key] = (name, comm)
            rows.sort(reverse=True)
            out.write(f"t={now:.1f} " + "; ".join(f"{p:.0f}% cpu{c} {k[1]} {comm} [{name}]" for p, k, name, comm, c in rows[:12])
                      + "\n")
            out.flush()
            before, then = now_threads, now
        out.write("summary: thread, samples busy, mean % of a CPU while busy, CPUs it ran on\n")
        for key, percents in sorted(busy.items(), key=lambda kv: -sum(kv[1])):
            name, comm = names[key]
            out.write(f"  {key[0]}/{key[1]} {comm} [{name}]: {len(percents)} samples, {sum(percents) / len(percents):.0f}%, "
                      f"cpus {sorted(cpus[key])}\n")


if __name__ == "__main__":
    main()
