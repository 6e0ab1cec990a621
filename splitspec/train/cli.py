"""`splitspec train lm`: a tokenizer and a Llama-architecture causal LM from scratch, on the Python
standard library (or a dataset prepared earlier), written as an HF directory."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.util
import json
import logging
import sys
from pathlib import Path

from splitspec.log_format import setup_logging
from splitspec.log_format import LOG_LEVELS
from splitspec.train.configs import HeadTrainConfig
from splitspec.train.presets import DEMO_VOCAB_SIZE, PRESETS

logger = logging.getLogger("splitspec.train")

SHAPE_FLAGS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size")
TRAIN_FLAGS = ("steps", "batch_size", "seq_len", "lr", "warmup_steps", "weight_decay", "eval_every", "save_every",
               "seed", "save_dtype")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitspec train", description="Train models for splitspec.")
    sub = parser.add_subparsers(dest="what", required=True, metavar="{lm,eagle,eagle3}", help="What to train.")
    lm = sub.add_parser("lm", help="a tokenizer and a causal LM from scratch", description=__doc__,
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_lm_args(lm)
    for kind, label in (("eagle", "an EAGLE-2 head (EAGLE-1 format)"), ("eagle3", "an EAGLE-3 head")):
        head = sub.add_parser(kind, help=f"{label} for a target", description=module_doc("splitspec.train.heads"),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
        add_head_args(head, kind)
    return parser


def module_doc(name: str) -> str | None:
    """A module's docstring read from its source, not imported (the trainers import torch: `--help` would wait ~3 s);
    None where its source is not there to read (an install of bytecode alone)."""
    origin = importlib.util.find_spec(name).origin
    try:
        return ast.get_docstring(ast.parse(Path(origin).read_text(encoding="utf-8")))
    except (OSError, TypeError, ValueError, SyntaxError):  # no file, no origin, not text, not Python source
        return None


def add_head_args(parser: argparse.ArgumentParser, kind: str) -> None:
    defaults = HeadTrainConfig(kind=kind)
    parser.add_argument("--model-path", "--model", dest="model_path", required=True,
                        help="The target (HF directory or hub id) whose hidden states the head drafts from.")
    parser.add_argument("--data", nargs="+", required=True,
                        help="Training text: files and directories (every 20th file held out; one file: its last 5%%), "
                        "`stdlib` for this machine's Python standard library (the demo models' corpus), or a dataset "
                        "directory prepared for `train lm` in the target's tokenizer. Text's token ids are cached under "
                        "~/.cache/splitspec/tokens ($SPLITSPEC_TOKEN_CACHE), keyed by the tokenizer and every text.")
    parser.add_argument("--out", required=True, help="Output head directory (resumes a run interrupted there).")
    train = parser.add_argument_group("training")
    for name, help_text in (
        ("steps", "Optimizer steps."), ("batch_size", "Windows per step."), ("seq_len", "Tokens per window."),
        ("lr", "Peak learning rate (cosine decay after warm-up)."), ("warmup_steps", "Linear warm-up steps."),
        ("grad_clip", "Gradient norm clip."),
        ("eval_every", "Held-out evaluation interval (steps); the best weights are kept."),
        ("eval_windows", "Held-out windows per evaluation."), ("save_every", "Resumable checkpoint interval (steps)."),
        ("seed", "Seed of the initial weights and of every batch."),
        ("intermediate_size", "MLP width of the head (0 = the target's)."),
        ("time_budget_s", "Stop after this many seconds of training (0 = none); the best weights so far are saved."),
        ("accept_prompts", "Held-out prompts of the final accept-length estimate through the real engine (0 = skip)."),
        ("accept_new_tokens", "Tokens generated per prompt in that estimate."),
        ("regenerate", "Train on this many windows the target writes itself (0 = on the text as it is): each a prompt "
         "of the text at a random offset completed by the target through the serving engine, as SpecForge regenerates "
         "data; the held-out windows too. A head drafts the target's text, not the corpus's."),
        ("regenerate_prompt_len", "Tokens of text that prompt each regenerated window."),
        ("regenerate_temperature", "Sampling temperature of the regenerated windows (0 = greedy)."),
    ):
        default = getattr(defaults, name)
        train.add_argument("--" + name.replace("_", "-"), type=type(default), default=default,
                           help=f"{help_text} Default: {default}.")
    if kind == "eagle3":
        train.add_argument("--ttt-steps", type=int, default=defaults.ttt_steps,
                           help=f"Training-time test depth: steps the head is unrolled on its own outputs. Default: {defaults.ttt_steps}.")
        train.add_argument("--draft-vocab-size", type=int, default=defaults.draft_vocab_size,
                           help="Draft vocabulary: the most frequent target ids of the data (at most the target's). "
                           f"Default: {defaults.draft_vocab_size}.")
    parser.add_argument("--save-dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"),
                        help="Dtype of the saved weights. Default: bfloat16.")
    parser.add_argument("--device", default="auto", help="cpu, cuda or cuda:N; auto = cuda when available (bf16 autocast there).")
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="Logging level.")


def run_head(args: argparse.Namespace) -> int:
    import torch

    from splitspec.runtime.hub import resolve_model_dir
    from splitspec.train.heads import HeadTrainer
    from splitspec.train.text_tokens import load_text_tokens

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    fields = {f for f in HeadTrainConfig.__dataclass_fields__} - {"kind", "device"}
    cfg = HeadTrainConfig(kind=args.what, device=device, **{k: v for k, v in vars(args).items() if k in fields})
    try:
        target = resolve_model_dir(args.model_path)
        train, held_out = load_text_tokens(args.data, target)
        report = HeadTrainer(target, Path(args.out), train, held_out, cfg).train()
    except (ValueError, OSError) as exc:
        print(f"splitspec train {args.what}: error: {exc}", file=sys.stderr)
        return 2
    summary = {k: report[k] for k in ("kind", "parameters", "steps", "best_held_out_loss")}
    if "held_out_accept" in report:
        summary["held_out_mean_accept_length"] = report["held_out_accept"]["mean_accept_length"]
    print(json.dumps(summary))
    return 0


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
    if args.what in ("eagle", "eagle3"):
        return run_head(args)
    shape, cfg = resolve_settings(args)
    out = Path(args.out)
    dataset = Path(args.dataset) if args.dataset else out / "dataset"
    if shape.hidden_size % shape.num_attention_heads or shape.num_attention_heads % shape.num_key_value_heads:
        print("splitspec train: error: hidden size must divide by heads, and heads by kv heads", file=sys.stderr)
        return 2
    report = train_lm(out, dataset, args.vocab_size, shape, cfg)
    print(json.dumps({k: report[k] for k in ("parameters", "steps", "best_held_out_loss", "bigram_held_out_loss")}))
    return 0
