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
    group.add_argument("--speculative-algorithm", default=None, choices=ALGORITHMS,
                       help="Draft with this algorithm and verify losslessly (default: no speculation). NGRAM: "
                       "suffix matches in a trie of the requests' own tokens; STANDALONE: a small draft LLM sharing "
                       "the target's tokenizer (--speculative-draft-model-path); EAGLE: an EAGLE-1/2 head "
                       "(--speculative-draft-model-path) drafting from the target's hidden states.")
    group.add_argument("--speculative-draft-model-path", default=None,
                       help="STANDALONE: the draft model; EAGLE: the EAGLE head (HF directory or hub id).")
    group.add_argument("--speculative-draft-model-revision", default=None,
                       help="Hub branch, tag or commit of the draft model (main when a hub id is given without one).")
    group.add_argument("--speculative-token-map", default=None,
                       help="FR-Spec: a list of frequent target token ids (torch.save'd; a path or <org>/<repo>/<file> "
                       "on the hub); the draft head keeps only those rows and drafted ids map back. EAGLE and STANDALONE.")
    group.add_argument("--speculative-num-steps", type=int, default=None,
                       help="Model drafters: drafting depth (auto: 3 for STANDALONE, 5 for EAGLE). Set all three of "
                       "--speculative-num-steps, --speculative-eagle-topk, --speculative-num-draft-tokens, or none.")
    group.add_argument("--speculative-eagle-topk", type=int, default=None,
                       help="Model drafters: branching factor per step (auto: 1 for STANDALONE, 4 for EAGLE).")
    group.add_argument("--speculative-num-draft-tokens", type=int, default=None,
                       help="Tree nodes verified per step, root included (NGRAM: the max match window size; "
                       "auto: 4 for STANDALONE, 8 for EAGLE; with --speculative-eagle-topk 1 it becomes num-steps + 1).")
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


ALGORITHMS = ("NGRAM", "STANDALONE", "EAGLE")
MODEL_ALGORITHMS = ("STANDALONE", "EAGLE")
HIDDEN_STATE_ALGORITHMS = ("EAGLE",)
# (num_steps, topk, num_draft_tokens) when all three are unset: SGLang's choices (its EAGLE auto is
# 5/4/8 for Llama targets, the family every target here belongs to)
AUTO_TREE = {"STANDALONE": (3, 1, 4), "EAGLE": (5, 4, 8)}


class FlagError(ValueError):
    """Flags that do not go together; the message says how to fix them."""


def tree_shape(args: argparse.Namespace) -> tuple[int, int, int]:
    """(num_steps, topk, num_draft_tokens) of a model drafter's tree, SGLang's rules: all three flags
    or none (auto); topk 1 makes the tree a chain of num_steps + 1 nodes."""
    given = {"--speculative-num-steps": args.speculative_num_steps, "--speculative-eagle-topk": args.speculative_eagle_topk,
             "--speculative-num-draft-tokens": args.speculative_num_draft_tokens}
    unset = [flag for flag, value in given.items() if value is None]
    if len(unset) == 3:
        steps, topk, tokens = AUTO_TREE[args.speculative_algorithm]
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


def num_draft_tokens(args: argparse.Namespace) -> int:
    if args.speculative_algorithm in MODEL_ALGORITHMS:
        return tree_shape(args)[2]
    return args.speculative_num_draft_tokens or args.speculative_ngram_max_match_window_size


def draft_model_dir(args: argparse.Namespace):
    if not args.speculative_draft_model_path:
        raise FlagError(f"--speculative-algorithm {args.speculative_algorithm} needs --speculative-draft-model-path")
    from splitspec.runtime.hub import resolve_model_dir

    return resolve_model_dir(args.speculative_draft_model_path, args.speculative_draft_model_revision)


def build_drafter(args: argparse.Namespace, max_total_tokens: int | None = None, target=None):
    """The drafter object --speculative-algorithm names, configured by the flags. A model drafter
    loads its model with the same --dtype, --device and --page-size, and a KV cache of
    --max-total-tokens (else max_total_tokens) tokens. EAGLE shares the target's embedding and head:
    `target` (a ModelRunner in this process), else read from --model-path."""
    from splitspec.drafter_svc.base import drafter_class

    cls = drafter_class(args.speculative_algorithm)
    if args.speculative_algorithm == "NGRAM":
        return cls(ngram_config(args))
    from splitspec.runtime.runner import ModelRunner, RuntimeConfig

    steps, topk, tokens = tree_shape(args)
    eagle = args.speculative_algorithm == "EAGLE"
    runner = ModelRunner.load(RuntimeConfig(
        model_path=str(draft_model_dir(args)), dtype=args.dtype, device=args.device, page_size=args.page_size,
        max_total_tokens=args.max_total_tokens or max_total_tokens,
        mem_fraction_static=getattr(args, "mem_fraction_static", None), attention_backend=args.attention_backend,
        family="eagle" if eagle else None))
    if eagle:
        if target is not None:
            embed, head = target.model.model.embed_tokens.weight, target.model.lm_head_weight
        else:
            from splitspec.runtime.loader import read_embed_and_head

            if not getattr(args, "model_path", None):
                raise FlagError("an EAGLE drafter needs the target's --model-path (it shares the target's embedding and head)")
            from splitspec.runtime.hub import resolve_model_dir

            embed, head = read_embed_and_head(resolve_model_dir(args.model_path, getattr(args, "revision", None)),
                                              runner.dtype, runner.device)
    token_map = None
    if getattr(args, "speculative_token_map", None):
        from splitspec.runtime.token_map import load_token_map

        vocab = target.config.vocab_size if target is not None else runner.config.vocab_size
        token_map = load_token_map(args.speculative_token_map, vocab)
        if len(token_map) < topk:
            raise FlagError(f"--speculative-token-map lists {len(token_map)} ids, fewer than --speculative-eagle-topk {topk}")
        if not eagle:
            runner.model.set_hot_tokens(token_map)
    if eagle:
        runner.model.share_target(embed, head if token_map is None else head[token_map.to(head.device)].contiguous())
    return cls(runner, topk=topk, num_steps=steps, num_draft_tokens=tokens, token_map=token_map)


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
        num_draft_tokens=num_draft_tokens(args),
        accept_threshold_single=args.speculative_accept_threshold_single,
        accept_threshold_acc=args.speculative_accept_threshold_acc,
        force_greedy_verify=args.speculative_algorithm == "NGRAM" and args.speculative_ngram_force_greedy_verify,
    )


def in_process_drafter(args: argparse.Namespace, max_total_tokens: int | None = None, target=None):
    """(DrafterClient or None, SpecConfig) for the flags: the drafter runs inside this process."""
    if args.speculative_algorithm is None:
        return None, spec_config(args)
    from splitspec.verifier_svc.drafter_client import InProcessDrafterClient

    spec = spec_config(args)
    return InProcessDrafterClient(build_drafter(args, max_total_tokens, target)), spec


def report(algorithm: str, stats: SpecStats) -> dict:
    return {"algorithm": algorithm, "verify_steps": stats.verify_steps, "draft_tokens": stats.draft_tokens,
            "accepted_tokens": stats.accepted_tokens, "mean_accept_length": round(stats.mean_accept_length, 4),
            "accepted_per_position": stats.accepted_per_position, "fallbacks": stats.fallbacks}
