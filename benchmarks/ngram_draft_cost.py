"""NGRAM's drafting cost on the host: a step's trees for --batch requests from the C trie one call per request
(the drafter's way before draft_batch) against one call for the batch, alternating, on this machine's CPU.

    python -P benchmarks/ngram_draft_cost.py --batch 16 --rounds 5

The trie is filled with windows of a small-vocabulary random text (many matches, full trees); contexts are cut
from it. Prints the median microseconds per step of each way, and checks that both give the same trees."""

from __future__ import annotations

import argparse
import random
import statistics
import time

from splitspec.drafter_svc.ngram import NgramConfig
from splitspec.drafter_svc.ngram_native import NativeNgramTrie


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--budget", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200, help="Steps timed per round and way.")
    args = parser.parse_args()
    config = NgramConfig()
    trie, rng = NativeNgramTrie(config), random.Random(0)
    texts = [[rng.randrange(30) for _ in range(600)] for _ in range(args.batch)]
    for end in range(config.branch_length, 400):
        trie.insert_windows([text[end - config.branch_length : end] for text in texts])
    budgets = [args.budget] * args.batch
    steps = [[text[: 400 + s][-40:] for text in texts] for s in range(args.steps)]
    assert all(trie.draft_batch(c, budgets) == [trie.draft(x, args.budget) for x in c] for c in steps[:20])
    one, batch = [], []
    for _ in range(args.rounds):
        began = time.perf_counter()
        for contexts in steps:
            [trie.draft(context, budget) for context, budget in zip(contexts, budgets)]
        one.append((time.perf_counter() - began) / args.steps * 1e6)
        began = time.perf_counter()
        for contexts in steps:
            trie.draft_batch(contexts, budgets)
        batch.append((time.perf_counter() - began) / args.steps * 1e6)
    print(f"{args.batch} trees of up to {args.budget} nodes per step: one call each {statistics.median(one):.0f} us, "
          f"one call for the batch {statistics.median(batch):.0f} us (medians of {args.rounds} rounds)")


if __name__ == "__main__":
    main()
