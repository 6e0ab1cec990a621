"""Where a drafter's time goes in overlap (bets) against a fresh tree: one request of a dummy target's shape
(--preset) with a dummy EAGLE-3 head (--draft-preset) on --device, driven the way `splitspec drafter` is in the
steady state of overlap with every bet's outcome coming true (the full accept length with the right bonus):

    per step    take_bet(0); extend(outcome, hidden states); draft_bets(num_bets)

and, for comparison, the steady state without overlap (extend(S+1 tokens); draft). JSON out, no assertions:

    python benchmarks/profile_bets.py --device cuda --out bets.json

wall_ms: per step, nothing synchronised but the step's end. phases_ms: the same steps with the device
synchronised around each phase (catch-up, each forward, the draft loop, ...), so the phases add up (slower
than wall_ms by the lost overlap of host and device). gpu_busy_ms: the kernels' own time per step
(torch.profiler). A phase far above its GPU time is host work: Python, planning, launches.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

from splitspec.draft_models import build_drafter
from splitspec.speculation import resolve
from splitspec.drafter_svc import server as drafter_server
from splitspec.model_shapes import dummy_model_dir


class Phases:
    """Wall time per named phase, the device synchronised at both ends; nested phases count in their own
    name only (the outer one keeps what is left)."""

    def __init__(self, device):
        self.device, self.on = torch.device(device), False
        self.totals: dict[str, float] = collections.defaultdict(float)
        self.stack: list[list] = []

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def wrap(self, owner, attr: str, name: str) -> None:
        inner = getattr(owner, attr)

        def timed(*args, **kwargs):
            if not self.on:
                return inner(*args, **kwargs)
            self.sync()
            start = time.perf_counter()
            label = name
            if self.stack and name == "forward":  # which forward of the phase it runs in
                self.stack[-1][2] += 1
                label = f"{self.stack[-1][0]}: forward {self.stack[-1][2]}"
            self.stack.append([label, 0.0, 0])
            try:
                return inner(*args, **kwargs)
            finally:
                self.sync()
                took = time.perf_counter() - start
                label, nested, _ = self.stack.pop()
                self.totals[label] += took - nested
                if self.stack:
                    self.stack[-1][1] += took

        setattr(owner, attr, timed)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-3.1-8b", help="The dummy target's shape (its embedding feeds the head).")
    parser.add_argument("--draft-preset", default="eagle3-llama-3.1-8b", help="The dummy head's shape.")
    parser.add_argument("--algorithm", default="EAGLE3", help="EAGLE3 or EAGLE.")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=5, help="--speculative-num-steps")
    parser.add_argument("--topk", type=int, default=1, help="--speculative-eagle-topk")
    parser.add_argument("--num-draft-tokens", type=int, default=8)
    parser.add_argument("--num-bets", default="1,2,6", help="Comma-separated bet counts to profile.")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--iters", type=int, default=30, help="Steps timed per measurement.")
    parser.add_argument("--extra", default="", help="More `splitspec drafter` flags, e.g. '--disable-cuda-graph'.")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    flags = ["--speculative-algorithm", args.algorithm, "--model-path", str(dummy_model_dir(args.preset)),
             "--load-format", "dummy", "--speculative-draft-model-path", str(dummy_model_dir(args.draft_preset)),
             "--speculative-draft-load-format", "dummy", "--device", args.device, "--dtype", "bfloat16",
             "--speculative-num-steps", str(args.steps), "--speculative-eagle-topk", str(args.topk),
             "--speculative-num-draft-tokens", str(args.num_draft_tokens), "--max-total-tokens", "65536",
             "--cuda-graph-max-bs", "16", *args.extra.split()]
    ns = drafter_server.build_parser().parse_args(flags)
    drafter = build_drafter(resolve(ns), max_total_tokens=65536)
    runner = drafter.runner
    feature = len(drafter.hidden_state_layers) * runner.config.hidden_size if args.algorithm == "EAGLE3" \
        else runner.config.hidden_size
    vocab = min(runner.config.vocab_size, 32000)
    generator = torch.Generator().manual_seed(0)

    def hidden(n):
        return (torch.randn(n, feature, generator=generator) * 0.5).to(runner.device, runner.dtype)

    def tokens(n):
        return torch.randint(3, vocab, (n,), generator=generator).tolist()

    phases = Phases(runner.device)
    phases.wrap(runner, "forward", "forward")
    phases.wrap(runner, "batch", "batch (host metadata)")
    phases.wrap(drafter, "_bet_roots", "catch-up")
    phases.wrap(drafter, "_catch_up", "catch-up")
    phases.wrap(drafter.loop, "run", "draft loop")
    phases.wrap(runner.kv_cache, "fork", "kv forks")
    phases.wrap(runner.kv_cache, "fork_many", "kv forks")
    phases.wrap(drafter, "draft_bets", "bets (rest)")
    phases.wrap(drafter, "draft", "draft (rest)")
    phases.wrap(drafter, "extend", "extend")

    def start(rid):
        prompt = tokens(args.prompt_len)
        drafter.open(rid, prompt[:1])
        drafter.extend(rid, prompt[1:], hidden(len(prompt) - 1))
        return drafter.draft([rid], [args.num_draft_tokens])[0]

    def bet_step(rid, num_bets):
        bets = drafter.draft_bets([rid], num_bets)[0]
        drafter.take_bet(rid, 0)
        outcome = list(bets[0].outcome)
        drafter.extend(rid, outcome, hidden(len(outcome)))

    def fresh_step(rid, tree):
        new = list(tree.tokens[1 : args.steps + 1]) + tokens(1)
        drafter.extend(rid, new, hidden(len(new)))
        return drafter.draft([rid], [args.num_draft_tokens])[0]

    def measure(step, *step_args):
        for _ in range(5):
            step(*step_args)
        phases.sync()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            step(*step_args)
        phases.sync()
        wall = (time.perf_counter() - t0) / args.iters * 1e3
        phases.totals.clear()
        phases.on = True
        for _ in range(args.iters):
            step(*step_args)
        phases.on = False
        split = {k: round(v / args.iters * 1e3, 3) for k, v in sorted(phases.totals.items(), key=lambda kv: -kv[1])}
        busy = top = None
        if runner.device.type == "cuda":
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(args.iters):
                    step(*step_args)
                torch.cuda.synchronize()
            kernels = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)
            busy = sum(e.self_device_time_total for e in kernels) / 1e3 / args.iters
            top = {e.key[:60]: round(e.self_device_time_total / 1e3 / args.iters, 4) for e in kernels[:8]}
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.iters):
            step(*step_args)
        phases.sync()
        profiler.disable()
        stats = pstats.Stats(profiler)
        host = sorted(((f"{Path(f).name}:{line}:{name}", tt / args.iters * 1e3, ct / args.iters * 1e3)
                       for (f, line, name), (_, _, tt, ct, _) in stats.stats.items()), key=lambda x: -x[1])[:25]
        return {"wall_ms": round(wall, 3), "phases_ms": split,
                "host_top_ms (function: own, cumulative)": {k: [round(a, 3), round(b, 3)] for k, a, b in host}, "phases_sum_ms": round(sum(split.values()), 3),
                "gpu_busy_ms": None if busy is None else round(busy, 3), "top_kernels_ms": top if busy else None}

    results = {}
    with torch.inference_mode():
        tree = start("fresh")
        holder = {"tree": tree}

        def fresh(rid):
            holder["tree"] = fresh_step(rid, holder["tree"])

        results["fresh_tree"] = measure(fresh, "fresh")
        drafter.release("fresh")
        for num_bets in [int(n) for n in args.num_bets.split(",")]:
            rid = f"bets{num_bets}"
            start(rid)
            results[f"bets_{num_bets}"] = measure(bet_step, rid, num_bets)
            drafter.release(rid)
            print(num_bets, results[f"bets_{num_bets}"], file=sys.stderr)
    report = {"what": "one request's drafter time per step: a fresh tree vs overlap's bets (benchmarks/profile_bets.py)",
              "command": " ".join(["python benchmarks/profile_bets.py", *sys.argv[1:]]),
              "device": torch.cuda.get_device_name(runner.device) if runner.device.type == "cuda" else "cpu",
              "torch": torch.__version__, "algorithm": args.algorithm, "steps": args.steps, "topk": args.topk,
              "num_draft_tokens": args.num_draft_tokens, "results": results}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
