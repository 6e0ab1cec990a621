"""`splitspec generate`: offline generation in one process, on the shared runtime (no services).

All prompts run as one continuously batched group: one prefill forward, then one decode forward per
step over the requests still running. Greedy at temperature 0; otherwise position-keyed sampling.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from splitspec import engine_args, model_flags, speculation
from splitspec.generate_flags import build_parser  # noqa: F401  (cli.py finds a command's parser in its module)
from splitspec.log_format import setup_logging
from splitspec.tokenizer_loader import load_tokenizer  # noqa: F401 (for callers)
from splitspec.runtime.config import ConfigError, eos_token_ids
from splitspec.runtime.hub import ModelNotFoundError
from splitspec.runtime.kv_cache import OutOfPagesError
from splitspec.runtime.loader import CheckpointError
from splitspec.runtime.runner import ModelRunner
from splitspec.runtime.sampling_params import SamplingParams
from splitspec.verifier_svc.drafter_client import DrafterClient
from splitspec.verifier_svc.engine import Engine
from splitspec.verifier_svc.step_types import Request, SchedulerConfig, SpecConfig


logger = logging.getLogger("splitspec.generate")


def generate_ids(
    runner: ModelRunner,
    prompts: list[list[int]],
    params: list[SamplingParams],
    eos_ids: set[int],
    on_step: Callable[[int], None] | None = None,
    drafter: DrafterClient | None = None,
    spec: SpecConfig | None = None,
    scheduler: SchedulerConfig | None = None,
) -> list[Request]:
    """Every prompt to completion through the engine's step loop (speculative when a drafter is
    given); KV pages return to the pool as requests end. `on_step(num_tokens)` is called after each
    step with the tokens it produced (benchmarks time it)."""
    engine = Engine(runner, drafter, spec or SpecConfig(), eos_ids, scheduler)
    requests = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while engine.has_work:
        events = engine.step()
        if on_step is not None:
            on_step(sum(len(e.new_token_ids) for e in events))
    return requests


def _prompts(args, tokenizer) -> list[list[int]]:
    prompts = [tokenizer.encode(text) for text in args.prompt]
    for ids in args.input_ids:
        try:
            prompts.append([int(x) for x in ids.split(",") if x.strip()])
        except ValueError:
            raise ConfigError(f"--input-ids {ids!r}: expected comma-separated integers") from None
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ConfigError("give at least one non-empty --prompt or --input-ids")
    return prompts


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    try:
        return _run(args)
    except (ConfigError, CheckpointError, ModelNotFoundError, OutOfPagesError, ValueError) as exc:  # FlagError too
        print(f"splitspec generate: error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    model_flags.check_sglang_server_flags(args, "splitspec generate")
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
        max_new_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos, frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty, repetition_penalty=args.repetition_penalty,
    )
    model_dir = model_flags.resolve_model(args)
    tokenizer = load_tokenizer(Path(args.tokenizer_path or model_dir), required=bool(args.prompt))
    prompts = _prompts(args, tokenizer)
    settings = speculation.resolve(args)  # the flags' speculation, resolved once (None: off)
    # every prompt runs at once: each needs pages for its prompt, its new tokens and a full draft tree
    tree = settings.num_draft_tokens if settings is not None else 0
    needed_pages = sum(-(-(len(p) + args.max_new_tokens + tree) // args.page_size) for p in prompts)
    if args.max_total_tokens is not None and args.max_total_tokens < needed_pages * args.page_size:
        raise ConfigError(f"--max-total-tokens {args.max_total_tokens} is too small for these prompts: they need "
                          f"{needed_pages} pages of {args.page_size} tokens ({needed_pages * args.page_size} tokens)")
    runner = ModelRunner.load(model_flags.runtime_config(
        args, model_dir, default_max_total_tokens=needed_pages * args.page_size))
    engine_args.check_context([len(p) for p in prompts], args.max_new_tokens, runner.context_length, "--max-new-tokens")
    draft_tokens = needed_pages * args.page_size
    if settings is not None and settings.kind != "ngram":  # room for each request's beam nodes too
        draft_tokens += len(prompts) * (settings.num_steps * settings.topk + args.page_size)
    drafter, spec = engine_args.in_process_drafter(settings, max_total_tokens=draft_tokens, target=runner)
    vocab = runner.config.vocab_size
    bad = [t for p in prompts for t in p if not 0 <= t < vocab]
    if bad:
        raise ConfigError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    eos = eos_token_ids(model_dir, runner.config.eos_token_ids, tokenizer)
    gens = generate_ids(runner, prompts, [params] * len(prompts), eos, drafter=drafter, spec=spec,
                        scheduler=engine_args.scheduler_config(args))
    assert runner.kv_cache.allocator.num_used == 0, "KV pages leaked"
    for gen in gens:
        text = tokenizer.decode(gen.output_ids, skip_special_tokens=True) if tokenizer is not None else None
        if args.json:
            row = {"output_ids": gen.output_ids, "text": text, "prompt_ids": gen.prompt_ids,
                   "finish_reason": gen.finish_reason, "seed": gen.params.seed}
            if drafter is not None:
                row["speculative"] = engine_args.report(args.speculative_algorithm, gen.stats)
                if args.speculative_replay:  # the replay drafter's acceptance is drawn, not a draft model's
                    row["speculative"]["simulated"] = True
            print(json.dumps(row))
        else:
            print(text if text is not None else " ".join(map(str, gen.output_ids)))
    return 0
