"""Sums up py-spy raw samples (benchmarks/spy_engine.sh) of the engine thread, served against in process: of the
samples under Engine.step, each function's share (inclusive) and where the thread was when it was not in a step.

    python3 benchmarks/spy_compare.py spy_served.txt spy_in_process.txt [--top 40]
"""

from __future__ import annotations

import argparse
import collections
import re
import sys

STEP = "Engine.step ("
FRAME = re.compile(r"^(.*) \((.*?):\d+\)$")
# the served services import the mapped packages (verifier_svc/...), the bench splitspec.verifier_svc: one name each
MAPPED = re.compile(r"\(splitspec/(verifier_svc|drafter_svc|gateway|protos|kernels)/")
# a step's one-off setup (the first step captures the graphs, Triton compiles): not what a step costs
SETUP = ("ModelRunner.capture_cuda_graphs (", "ModelRunner.capture_feature_graphs (", "warm_and_capture (",
         "JITFunction._do_compile (")


def load(path: str) -> dict:
    """The engine thread's samples: those under Engine.step (inclusive counts by function) and the rest."""
    threads: dict[str, list[tuple[list[str], int]]] = collections.defaultdict(list)
    for line in open(path):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        frames = stack.split(";")
        threads[frames[0].split(":")[0]].append(([MAPPED.sub(r"(\1/", FRAME.sub(r"\1 (\2)", f)) for f in frames[1:]],
                                                 int(count)))
    engine = max(threads, key=lambda t: sum(n for frames, n in threads[t] if any(f.startswith(STEP) for f in frames)))
    inside, outside, steps, setup = collections.Counter(), collections.Counter(), 0, 0
    for frames, n in threads[engine]:
        if any(f.startswith(SETUP) for f in frames):
            setup += n
            continue
        at = next((i for i, f in enumerate(frames) if f.startswith(STEP)), None)
        if at is None:
            outside[frames[-1] if frames else "?"] += n
            continue
        steps += n
        for f in set(frames[at:]):
            inside[f] += n
    return {"thread": engine, "in_step": steps, "inside": inside, "outside": outside, "setup": setup,
            "thread_samples": sum(n for _, n in threads[engine]) - setup}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("served")
    parser.add_argument("in_process")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args(argv)
    sides = {"served": load(args.served), "in_process": load(args.in_process)}
    for name, side in sides.items():
        print(f"{name}: engine thread {side['thread']}, {side['thread_samples']} samples, {side['in_step']} under Engine.step "
              f"({side['setup']} more capturing graphs or compiling, left out)")
    served, inside = sides["served"], sides["in_process"]
    names = sorted(set(served["inside"]) | set(inside["inside"]),
                   key=lambda f: -max(served["inside"][f] / max(served["in_step"], 1), inside["inside"][f] / max(inside["in_step"], 1)))
    print(f"\n{'served %':>9} {'in proc %':>9}  function (share of the samples under Engine.step, inclusive)")
    for f in names[: args.top]:
        print(f"{100 * served['inside'][f] / max(served['in_step'], 1):9.1f} {100 * inside['inside'][f] / max(inside['in_step'], 1):9.1f}  {f}")
    print("\nserved engine thread outside Engine.step (leaf frames, share of its samples):")
    for f, n in served["outside"].most_common(12):
        print(f"{100 * n / max(served['thread_samples'], 1):9.1f}  {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
