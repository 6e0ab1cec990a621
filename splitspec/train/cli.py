"""`splitspec train lm`: a tokenizer and a Llama-architecture causal LM from scratch, on the Python
standard library (or a dataset prepared earlier), written as an HF directory."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

from splitspec.runtime.args import LOG_LEVELS, setup_logging
from splitspec.train.presets import DEMO_VOCAB_SIZE, PRESETS

logger = logging.getLogger("splitspec.train")

SHAPE_FLAGS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size")
TRAIN_FLAGS = ("steps", "batch_size", "seq_len", "lr", "warmup_steps", "weight_decay", "eval_every", "save_every",
               "seed", "save_dtype")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitspec train", description="Train models for splitspec.")
    sub = parser.add_subparsers(dest="what", required=True, metavar="{lm}", help="What to train.")
    lm = sub.add_parser("lm", help="a tokenizer and a causal LM from scratch", description=__doc__,
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_lm_args(lm)
    return parser


def add_lm_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="Output HF model directory (resumes a run interrupted there).")
    parser.add_argument("--dataset", default=None,
                        help="Prepared dataset directory (tokenizer + token ids + corpus manifest); built there "
                        "from the standard library when missing. Default: <out>/dataset.")
    parser.add_argument("--vocab-size", type=int, default=DEMO_VOCAB_SIZE, help="BPE vocabulary when a dataset is built.")
    parser.add_argument("--preset", default="demo-target", choices=sorted(PRESETS),
                        help="Shape and training settings; the flags below override single values.")
    shape = parser.add_argument_group("shape (override the preset)")
    for name in SHAPE_FLAGS:
        shape.add_argument("--" + name.replace("_", "-"), type=int, default=None, help=f"Model {name.replace('_', ' ')}.")
    train = parser.add_argument_group("training (override the preset)")
    train.add_argument("--steps", type=int, default=None, help="Optimizer steps.")
    train.add_argument("--batch-size", type=int, default=None, help="Sequences per step.")
    train.add_argument("--seq-len", type=int, default=None, help="Tokens per sequence.")
    train.add_argument("--lr", type=float, default=None, help="Peak learning rate (cosine decay after warm-up).")
    train.add_argument("--warmup-steps", type=int, default=None, help="Linear warm-up steps.")
    train.add_argument("--weight-decay", type=float, default=None, help="AdamW weight decay of matrices.")
    train.add_argument("--eval-every", type=int, default=None, help="Held-out evaluation interval (steps); the best is kept.")
    train.add_argument("--save-every", type=int, default=None, help="Resumable checkpoint interval (steps).")
    train.add_argument("--seed", type=int, default=None, help="Seed of the initial weights and of every batch.")
    train.add_argument("--save-dtype", default=None, choices=("float32", "bfloat16", "float16"), help="Dtype of the saved weights.")
    parser.add_argument("--device", default="auto", help="cpu, cuda or cuda:N; auto = cuda when available.")
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="Logging level.")


def resolve_settings(args: argparse.Namespace):
    """The preset's shape and training config with the given flags applied."""
    import torch

    shape, cfg = PRESETS[args.preset]
    shape = dataclasses.replace(shape, **{k: getattr(args, k) for k in SHAPE_FLAGS if getattr(args, k) is not None})
    overrides = {k: getattr(args, k) for k in TRAIN_FLAGS if getattr(args, k) is not None}
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    return shape, dataclasses.replace(cfg, device=device, **overrides)


def train_lm(out: Path, dataset: Path, vocab_size: int, shape, cfg) -> dict:
    from splitspec.train.dataset import TOKENS_FILE, check_manifest, prepare_dataset
    from splitspec.train.lm import LMTrainer

    if not (dataset / TOKENS_FILE).is_file():
        logger.info("preparing dataset %s from the standard library (vocab %d)", dataset, vocab_size)
        prepare_dataset(dataset, vocab_size)
    else:
        for difference in check_manifest(dataset):
            logger.warning("dataset %s differs from this machine's corpus: %s", dataset, difference)
    return LMTrainer(dataset, out, shape, cfg).train()


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    shape, cfg = resolve_settings(args)
    out = Path(args.out)
    dataset = Path(args.dataset) if args.dataset else out / "dataset"
    if shape.hidden_size % shape.num_attention_heads or shape.num_attention_heads % shape.num_key_value_heads:
        print("splitspec train: error: hidden size must divide by heads, and heads by kv heads", file=sys.stderr)
        return 2
    report = train_lm(out, dataset, args.vocab_size, shape, cfg)
    print(json.dumps({k: report[k] for k in ("parameters", "steps", "best_held_out_loss", "bigram_held_out_loss")}))
    return 0
