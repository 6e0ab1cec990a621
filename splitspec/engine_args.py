"""The engine's flags, SGLang's names: scheduling (--max-running-requests, --chunked-prefill-size) and
speculation (--speculative-*), and what they build: SchedulerConfig, the drafter and SpecConfig.

Only NGRAM runs in one process so far; the model drafters join with their issues.
"""

from __future__ import annotations

import argparse

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the drafter service uses these flags too and must not import the verifier
    from splitspec.verifier_svc.engine import SchedulerConfig, SpecStats


def add_scheduler_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("scheduling (SGLang's flags)")
    group.add_argument("--max-running-requests", type=int, default=0,
                       help="Requests decoding at once; the rest wait (0 = no limit).")
    group.add_argument("--chunked-prefill-size", type=int, default=8192,
                       help="Tokens one step computes in all: each decoding request's tree counts first "
                       "(--speculative-num-draft-tokens each, 1 without speculation), prompt chunks share the rest, "
                       "so long prompts are prefilled over several steps while others decode (-1 = no limit).")


def scheduler_config(args: argparse.Namespace) -> SchedulerConfig:
    from splitspec.verifier_svc.engine import SchedulerConfig

    return SchedulerConfig(max_running_requests=args.max_running_requests, chunked_prefill_size=args.chunked_prefill_size)


def add_speculative_args(parser: argparse.ArgumentParser, side: str = "verifier") -> None:
    """SGLang's --speculative-* flags; side="drafter" leaves out what only the verifier decides
    (acceptance rules)."""
    group = parser.add_argument_group("speculative decoding (SGLang's flags)")
    group.add_argument("--speculative-algorithm", default=None, choices=("NGRAM",),
                       help="Draft with this algorithm and verify losslessly (default: no speculation).")
    group.add_argument("--speculative-num-draft-tokens", type=int, default=None,
                       help="Tree nodes verified per step, root included (NGRAM default: the max match window size).")
    if side == "verifier":
        group.add_argument("--speculative-accept-threshold-single", type=float, default=1.0,
                           help="Below 1.0: SGLang's lossy rule accepts a draft whose target probability reaches this.")
        group.add_argument("--speculative-accept-threshold-acc", type=float, default=1.0,
                           help="Below 1.0: SGLang's lossy rule accepts when the coin is below accumulated mass / this.")
    group.add_argument("--speculative-ngram-min-match-window-size", type=int, default=1, help="NGRAM: shortest suffix matched.")
    group.add_argument("--speculative-ngram-max-match-window-size", type=int, default=12, help="NGRAM: longest suffix matched.")
    group.add_argument("--speculative-ngram-min-bfs-breadth", type=int, default=1, help="NGRAM: BFS breadth for the longest match.")
    group.add_argument("--speculative-ngram-max-bfs-breadth", type=int, default=10, help="NGRAM: BFS breadth for the shortest match.")
    group.add_argument("--speculative-ngram-match-type", default="BFS", choices=("BFS", "PROB"),
                       help="NGRAM: BFS (recency) or PROB (frequency) tree construction.")
    group.add_argument("--speculative-ngram-branch-length", type=int, default=18, help="NGRAM: recent tokens inserted per step.")
    group.add_argument("--speculative-ngram-capacity", type=int, default=10_000_000, help="NGRAM: trie nodes kept (LRU).")
    if side == "verifier":
        group.add_argument("--speculative-ngram-force-greedy-verify", action="store_true",
                           help="NGRAM: verify by target argmax even for sampled requests (SGLANG_NGRAM_FORCE_GREEDY_VERIFY=True).")


def build_drafter(args: argparse.Namespace):
    """The drafter object --speculative-algorithm names, configured by the flags (drafter side)."""
    from splitspec.drafter_svc.base import drafter_class

    return drafter_class(args.speculative_algorithm)(ngram_config(args))


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


def spec_config(args: argparse.Namespace):
    """SpecConfig for the flags (verifier side); speculation off gives the defaults."""
    from splitspec.verifier_svc.engine import SpecConfig

    if args.speculative_algorithm is None:
        return SpecConfig()
    return SpecConfig(
        num_draft_tokens=args.speculative_num_draft_tokens or args.speculative_ngram_max_match_window_size,
        accept_threshold_single=args.speculative_accept_threshold_single,
        accept_threshold_acc=args.speculative_accept_threshold_acc,
        force_greedy_verify=args.speculative_ngram_force_greedy_verify,
    )


def in_process_drafter(args: argparse.Namespace):
    """(DrafterClient or None, SpecConfig) for the flags: the drafter runs inside this process."""
    if args.speculative_algorithm is None:
        return None, spec_config(args)
    from splitspec.verifier_svc.drafter_client import InProcessDrafterClient

    return InProcessDrafterClient(build_drafter(args)), spec_config(args)


def report(algorithm: str, stats: SpecStats) -> dict:
    return {"algorithm": algorithm, "verify_steps": stats.verify_steps, "draft_tokens": stats.draft_tokens,
            "accepted_tokens": stats.accepted_tokens, "mean_accept_length": round(stats.mean_accept_length, 4),
            "accepted_per_position": stats.accepted_per_position, "fallbacks": stats.fallbacks}
