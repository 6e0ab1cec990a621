"""The speculative flags' rules that need no model: the error a bad combination raises, which algorithms
draft with a model, SGLang's rule for a model drafter's tree shape and the NGRAM drafter's configuration.
Pure functions of the parsed flags, below both splitspec.engine_args (the flags of the engine) and
splitspec.draft_models (which resolves what depends on the target), which both use them.
"""

from __future__ import annotations

import argparse

MODEL_ALGORITHMS = ("STANDALONE", "EAGLE", "EAGLE3")


class FlagError(ValueError):
    """Flags that do not go together; the message says how to fix them."""


def tree_shape(args: argparse.Namespace, auto: tuple[int, int, int]) -> tuple[int, int, int]:
    """(num_steps, topk, num_draft_tokens) of a model drafter's tree, SGLang's rules: all three flags
    or none (`auto`, which splitspec.draft_models chooses for the target); topk 1 makes the tree a chain
    of num_steps + 1 nodes."""
    given = {"--speculative-num-steps": args.speculative_num_steps, "--speculative-eagle-topk": args.speculative_eagle_topk,
             "--speculative-num-draft-tokens": args.speculative_num_draft_tokens}
    unset = [flag for flag, value in given.items() if value is None]
    if len(unset) == 3:
        steps, topk, tokens = auto
    elif unset:
        raise FlagError(f"set all of --speculative-num-steps, --speculative-eagle-topk and --speculative-num-draft-tokens, "
                        f"or none of them for the automatic choice ({', '.join(unset)} missing)")
    else:
        steps, topk, tokens = args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens
    if steps < 1 or topk < 1 or tokens < 2:
        raise FlagError(f"--speculative-num-steps {steps}, --speculative-eagle-topk {topk}, --speculative-num-draft-tokens "
                        f"{tokens}: need at least 1, 1 and 2")
    if topk == 1:
        tokens = steps + 1
    return steps, topk, tokens


def ngram_config(args: argparse.Namespace):
    from splitspec.drafter_svc.ngram import NgramConfig

    return NgramConfig(
        min_match_window_size=args.speculative_ngram_min_match_window_size,
        max_match_window_size=args.speculative_ngram_max_match_window_size,
        min_bfs_breadth=args.speculative_ngram_min_bfs_breadth,
        max_bfs_breadth=args.speculative_ngram_max_bfs_breadth,
        match_type=args.speculative_ngram_match_type,
        branch_length=args.speculative_ngram_branch_length,
        capacity=args.speculative_ngram_capacity,
    )
