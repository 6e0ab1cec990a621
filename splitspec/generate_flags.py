"""`splitspec generate`'s flags (generate.py is the command): parsed without importing torch, so that `--help` and a
misspelt flag answer at once."""

from __future__ import annotations

import argparse

from splitspec import engine_args, model_flags


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="splitspec generate",
        description="Offline generation in one process on the splitspec runtime (no services).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    model_flags.add_model_args(parser)
    group = parser.add_argument_group("input")
    group.add_argument("--prompt", action="append", default=[], help="Prompt text; repeat the flag for a batch.")
    group.add_argument(
        "--input-ids", action="append", default=[],
        help="Prompt as comma-separated token ids, e.g. 1,2,3; repeat the flag for a batch.",
    )
    group.add_argument("--tokenizer-path", default=None, help="Tokenizer directory (default: the model's).")
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--max-new-tokens", type=int, default=32, help="Tokens to generate per prompt.")
    sampling.add_argument("--ignore-eos", action="store_true", help="Do not stop at the EOS token.")
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 = greedy.")
    sampling.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling mass (1.0 = off).")
    sampling.add_argument("--top-k", type=int, default=-1, help="Keep the k most likely tokens (-1 = off).")
    sampling.add_argument("--seed", type=int, default=None, help="Sampling seed (default: random per request).")
    sampling.add_argument("--frequency-penalty", type=float, default=0.0,
                          help="Subtract this per occurrence of a token in the output so far (-2..2).")
    sampling.add_argument("--presence-penalty", type=float, default=0.0,
                          help="Subtract this once from every token present in the output (-2..2).")
    sampling.add_argument("--repetition-penalty", type=float, default=1.0,
                          help="Divide positive (multiply negative) logits of tokens seen in prompt or output (1 = off).")
    engine_args.add_scheduler_args(parser)
    engine_args.add_speculative_args(parser)
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help='Print one JSON object per prompt: {"output_ids": [...], "text": ...}.')
    return parser
