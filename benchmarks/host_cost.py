"""The host (Python) time of a speculative step, piece by piece, on this machine's CPU.

A GPU step of the 8B-shaped target with an EAGLE-3 head at batch 32-64 is host-bound: the device waits while the
engine thread builds batches, plans attention, walks trees and hands states over. On a CPU that host work is the
same Python, so it can be measured here, without a GPU: `splitspec bench` runs in this process (the quick preset,
whose model compute is small, a dummy EAGLE-3 head drafting for real, acceptance simulated) with timers around the
engine's and the drafter's pieces, and prints each piece's own time (its callees named here excluded) per drafted
step of the speculative point. Model compute (and, on a CPU, the torch attention backend's planning inside the
forward) is reported apart: it is not what a GPU step's host pays.

    python -P benchmarks/host_cost.py --batch-size 64 --rounds 3

`--case ngram` runs the demo target with NGRAM's trie instead (real acceptance, 12-node trees). On a GPU machine
(`--device cuda --bench-args --dtype bfloat16`) each piece's wall time includes the device's waits inside it: where the
engine's thread spends a step there; `--per step` with `--bench-args ... --speculative-adaptive on` spreads the pieces
over every step of the point, the policy's drafting-off steps included.

An A/B against another commit: run it with that checkout's import tree first on the path (`PYTHONPATH=$(bash
OTHER/scripts/import_tree.sh /tmp/other-tree) python -P benchmarks/host_cost.py`), alternating, and compare the
medians. Runs on a busy 2-core machine move by 10-30% per piece; compare rounds of one invocation, and medians.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import inspect
import io
import json
import statistics
import sys
import tempfile
import time

PIECES = [  # (module, owner, attribute, label); "~": compute, reported apart
    ("splitspec.runtime.runner", "ModelRunner", "model_call", "~model compute"),
    ("splitspec.runtime.draft_loop", "DraftLoop", "_body", "~draft loop compute"),
    ("splitspec.runtime.runner", "ModelRunner", "_forward", "~forward (CPU attention planning)"),
    ("splitspec.runtime.attention.torch_backend", "TorchAttentionBackend", "plan_prefix", "~draft loop's CPU attention plan"),
    ("splitspec.verifier_svc.engine", "Engine", "step", STEP := "engine.step (the rest)"),
    ("splitspec.verifier_svc.engine", "Engine", "_schedule", "schedule"),
    ("splitspec.verifier_svc.engine", "Engine", "_draft", "engine._draft"),
    ("splitspec.verifier_svc.engine", "Engine", "_sequences", "sequences"),
    ("splitspec.verifier_svc.engine", "Engine", "_forward", "engine._forward"),
    ("splitspec.verifier_svc.engine", "Engine", "_accept_trees", "accept_trees"),
    ("splitspec.verifier_svc.engine", "Engine", "_request_drafts", "ask"),
    ("splitspec.verifier_svc.verification", None, "target_rows", "target_rows"),
    ("splitspec.runtime.runner", "ModelRunner", "batch", "runner.batch"),
    ("splitspec.drafter_svc.replay", "ReplayDrafter", "launch", "replay.launch (simulation only)"),
    ("splitspec.drafter_svc.eagle", "EagleDrafter", "launch", "eagle.launch"),
    ("splitspec.drafter_svc.eagle", "EagleDrafter", "_catch_up", "catch_up"),
    ("splitspec.runtime.draft_loop", "DraftLoop", "launch", "loop.launch"),
    ("splitspec.runtime.draft_loop", "LoopRun", "finish", "loop.finish (under the verification on a GPU)"),
    ("splitspec.runtime.draft_loop", "DraftLoop", "_trees", "loop.trees (under the verification on a GPU)"),
    ("splitspec.verifier_svc.drafter_client", "InProcessDrafterClient", "collect", "drafter_client.collect"),
    ("splitspec.verifier_svc.drafter_client", "InProcessDrafterClient", "request", "drafter_client.request"),
    ("splitspec.drafter_svc.ngram", "NgramDrafter", "draft", "ngram.draft"),
    ("splitspec.drafter_svc.ngram", "NgramDrafter", "extend", "ngram.extend"),
    ("splitspec.drafter_svc.ngram", "NgramDrafter", "idle", "ngram.idle"),
    ("splitspec.verifier_svc.engine", "Engine", "_retire", "retire"),
    ("splitspec.verifier_svc.engine", "Engine", "_close", "close (report, the policy's observation)"),
    ("splitspec.verifier_svc.engine", "Engine", "_forward_and_accept", "forward_and_accept (the rest)"),
    ("splitspec.verifier_svc.grammar_masks", "GrammarMasks", "build", "grammar masks"),
    ("splitspec.bench_in_process", None, "drive", DRIVE := "the bench's loop (its own)"),
    ("splitspec.verifier_svc.adaptive", "AdaptiveSpeculation", "choose", "adaptive.choose"),
    ("splitspec.verifier_svc.adaptive", "AdaptiveSpeculation", "observe", "adaptive.observe"),
    ("splitspec.verifier_svc.overlap", "OverlapSchedule", "_step_in_flight", "overlap: step_in_flight"),
    ("splitspec.verifier_svc.overlap", "OverlapSchedule", "_land", "overlap: land"),
    # the graph replay's pieces (a GPU's): FlashInfer's own plans where it is installed
    ("splitspec.runtime.cuda_graph", "StepGraphs", "run", "graphs.run (copies, replay, logits)"),
    ("splitspec.runtime.cuda_graph", "StepGraphs", "_pad", "graphs._pad"),
    ("splitspec.runtime.cuda_graph", "StepGraphs", "tokens_per_request", "graphs.tokens_per_request"),
    ("splitspec.runtime.rope", "RotaryEmbedding", "reserve", "rope.reserve"),
    ("splitspec.runtime.attention.flashinfer_backend", "FlashInferAttentionBackend", "plan", "flashinfer: eager plan"),
    ("splitspec.runtime.attention.flashinfer_backend", "FlashInferAttentionBackend", "graph_plan", "graph_plan"),
    ("splitspec.runtime.attention.flashinfer_backend", "FlashInferAttentionBackend", "_pages", "flashinfer: pages"),
    ("splitspec.runtime.attention.flashinfer_backend", "FlashInferAttentionBackend", "_plan_once", "flashinfer: plan (ours)"),
    ("splitspec.runtime.attention.flashinfer_backend", "FlashInferAttentionBackend", "_tree_mask", "flashinfer: tree masks"),
    ("splitspec.runtime.attention.flashinfer_backend", None, "replan", "flashinfer: graph replan (one copy)"),
    ("flashinfer.prefill", "BatchPrefillWithPagedKVCacheWrapper", "plan", "flashinfer: prefill wrapper.plan"),
    ("flashinfer.decode", "BatchDecodeWithPagedKVCacheWrapper", "plan", "flashinfer: decode wrapper.plan"),
]
CASES = {  # --case -> (the bench's arguments past the batch size, the piece whose calls count drafted steps)
    "eagle3-sim": (["--preset", "quick", "--draft-preset", "eagle3-quick", "--speculative-algorithm", "EAGLE3",
                    "--simulate-acceptance", "accept-length:6", "--steps", "5", "--topk", "1", "--num-draft-tokens", "6"],
                   "replay.launch (simulation only)"),
    # the demo target (the product's own small model) and NGRAM's trie in this process, fixed trees of 12 nodes
    "ngram": (["--speculative-algorithm", "NGRAM", "--num-draft-tokens", "12"], "ngram.draft"),
    # the demo target with its trained EAGLE-3 head (real acceptance; with --per step and --speculative-adaptive on,
    # what a step costs while the policy keeps drafting off: the head's feeds, the captured layers)
    "eagle3": (["--speculative-algorithm", "EAGLE3"], "loop.launch"),
}


class Timers:
    """Exclusive time per label, kept apart per `drive` call (a point of the bench, or its warm-up): the measured
    plain and speculative points are each kind's call with the most engine steps."""

    def __init__(self, counted: str):
        self.counted = counted  # the label whose calls are the speculative point's drafted steps
        self.stack: list[float] = []
        self.segments: list[tuple[bool, collections.Counter, collections.Counter]] = []  # (drafts?, seconds, calls)
        self.slowest: dict[str, tuple[float, int]] = {}  # label -> (its slowest call's own seconds, which call of the point)

    def wrap(self, function, label: str):
        @functools.wraps(function)
        def timed(*args, **kwargs):
            if label == DRIVE:  # drive(runner, drafter, ...): a new point
                self.segments.append((args[1] is not None, collections.Counter(), collections.Counter()))
                self.slowest = {}
            start = time.perf_counter()
            self.stack.append(0.0)
            try:
                return function(*args, **kwargs)
            finally:
                inner, spent = self.stack.pop(), time.perf_counter() - start
                if self.segments:
                    _, seconds, calls = self.segments[-1]
                    seconds[label] += spent - inner
                    calls[label] += 1
                    if spent - inner > self.slowest.get(label, (0.0, 0))[0]:  # a one-off (a first use) shows here
                        self.slowest[label] = (spent - inner, calls[label])
                if self.stack:
                    self.stack[-1] += spent
        return timed

    def point(self, drafts: bool) -> tuple[collections.Counter, collections.Counter]:
        """(seconds, calls) of the measured point of that kind."""
        return max(((s, c) for d, s, c in self.segments if d == drafts), key=lambda sc: sc[1][STEP])


def install(timers: Timers) -> None:
    import importlib

    for module_name, owner_name, attribute, label in PIECES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # FlashInfer where it is not installed
            continue
        owner = module if owner_name is None else getattr(module, owner_name)
        timed = timers.wrap(getattr(owner, attribute), label)
        static = isinstance(inspect.getattr_static(owner, attribute), staticmethod)
        setattr(owner, attribute, staticmethod(timed) if static else timed)
    engine = importlib.import_module("splitspec.verifier_svc.engine")
    engine.target_rows = importlib.import_module("splitspec.verifier_svc.verification").target_rows  # its own name


def one_round(args, timers: Timers) -> dict[str, float]:
    from splitspec import cli

    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        sys.argv = ["splitspec", "bench", *CASES[args.case][0], "--speculative-adaptive", "off", "--batch-size",
                    str(args.batch_size), "--num-prompts", str(args.prompts_per_slot * args.batch_size), "--prompt-len",
                    "128", "--output-len", "128", "--no-phase-sync", "--device", args.device, *args.bench_args,
                    "--log-level", "warning", "--out", out.name]
        timers.segments.clear()
        with contextlib.redirect_stdout(io.StringIO()):  # the bench's own report
            cli.main()
        with open(out.name) as f:
            rows = json.load(f)["rows"]
        for row in rows:
            print(f"  bench row: {row['speculative'] or 'plain'} at batch {row['batch_size']}: {row['output_tok_s']} tok/s, "
                  f"step_ms {row.get('step_ms')}, accept length {row.get('accept_length')}, budgets {row.get('budgets')}")
    plain_seconds, plain_calls = timers.point(False)
    seconds, calls = timers.point(True)
    drafted, steps = calls[timers.counted], calls[STEP]
    print(f"  round: {drafted} drafted steps of {steps} engine steps (plain: {plain_calls[STEP]})")
    slowest = sorted(timers.slowest.items(), key=lambda kv: -kv[1][0])[:6]  # the speculative point's (it runs last)
    print("  slowest single calls: " + ", ".join(f"{label} {ms * 1e3:.2f} ms (call {n})" for label, (ms, n) in slowest))
    per = drafted if args.per == "drafted" else steps
    out = {label: seconds[label] / per * 1e3 for label in seconds}
    out.update({f"plain: {label}": plain_seconds[label] / plain_calls[STEP] * 1e3 for label in plain_seconds})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=sorted(CASES), default="eagle3-sim",
                        help="eagle3-sim: the quick preset with a dummy EAGLE-3 head, acceptance simulated at 6 (steps 5, "
                        "top-1); ngram: the demo target with NGRAM's trie, 12-node trees, its own acceptance; eagle3: the "
                        "demo target with its trained EAGLE-3 head.")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--prompts-per-slot", type=int, default=4, help="Prompts per batch slot (ngram: 2 is enough).")
    parser.add_argument("--device", default="cpu", help="cuda: each piece's wall time on a GPU host, the device's waits "
                        "inside the pieces that wait for it (what the engine's thread spends there).")
    parser.add_argument("--bench-args", nargs=argparse.REMAINDER, default=[],
                        help="The rest of the command line goes to `splitspec bench` (e.g. --dtype bfloat16).")
    parser.add_argument("--per", choices=["drafted", "step"], default="drafted",
                        help="What the times are divided by: drafted steps, or every engine step of the speculative point "
                        "(with --bench-args --speculative-adaptive on: the policy's drafting-off steps too).")
    parser.add_argument("--rounds", type=int, default=3, help="Speculative points measured; medians are printed.")
    parser.add_argument("--out", default=None, help="JSON of every round's pieces (ms per drafted or engine step).")
    args = parser.parse_args()
    timers = Timers(CASES[args.case][1])
    install(timers)
    rounds = [one_round(args, timers) for _ in range(args.rounds)]
    labels = sorted({k.removeprefix("plain: ") for r in rounds for k in r}, key=lambda k: (k.startswith("~"), -statistics.median(
        r.get(k, 0.0) for r in rounds)))
    unit = "drafted step" if args.per == "drafted" else "engine step"
    print(f"{args.case} at batch {args.batch_size}: each piece's own time (ms; median of {args.rounds} rounds, then each "
          f"round), per {unit} of the speculative point | per engine step of the plain point")

    def column(key: str) -> str:
        values = [r.get(key, 0.0) for r in rounds]
        return f"{statistics.median(values):7.3f} ({' '.join(f'{v:.3f}' for v in values)})"

    for label in labels:
        print(f"  {label:42s} {column(label)} | {column('plain: ' + label)}")
    host = [sum(v for k, v in r.items() if not k.startswith(("~", "plain: "))) for r in rounds]
    plain = [sum(v for k, v in r.items() if k.startswith("plain: ") and not k.startswith("plain: ~")) for r in rounds]
    for r, h, p in zip(rounds, host, plain):
        r["host pieces in all"], r["plain: host pieces in all"] = h, p
    print(f"  {'host pieces in all':42s} {column('host pieces in all')} | {column('plain: host pieces in all')}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"case": args.case, "batch_size": args.batch_size, "per": args.per, "rounds": rounds}, f, indent=1)


if __name__ == "__main__":
    main()
