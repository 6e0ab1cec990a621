"""Training windows the target writes itself (`splitspec train eagle|eagle3 --regenerate N`).

A head drafts, when serving, the target's own continuations, not the training text: trained on the text, it learns
what the corpus says next, while what it is asked is what the target says next (a small target's greedy text
repeats itself in ways no corpus does). SpecForge's data regeneration and EAGLE's training on target-written
answers close that gap the same way: each window is a prompt of the text (prompt_len tokens at a seeded random
offset) completed by the target to the window's length, greedily (temperature 0, as a greedy benchmark or a
deterministic API call decodes) or sampled with seeded samples, through the serving engine itself (its kernels
and its dtype on that device), past EOS as a benchmark's ignore_eos runs on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

logger = logging.getLogger(__name__)

FILE = "regenerated_windows.pt"  # beside a run's checkpoint, so that a resumed run trains on the same windows


@dataclass(frozen=True)
class Regeneration:
    windows: int  # windows of the training text (0: train on the text as it is)
    seq_len: int  # tokens per window, less one (a window holds seq_len + 1 tokens, as HeadTrainer.batch cuts them)
    prompt_len: int = 64
    temperature: float = 0.0
    seed: int = 0
    batch_size: int = 512  # windows completed together


def target_runner(target_dir: Path, plan: Regeneration, device: str):
    """The target through the serving engine's runner, with KV room for one batch of windows."""
    from splitspec.runtime.runner import ModelRunner, RuntimeConfig

    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    return ModelRunner.load(RuntimeConfig(model_path=str(target_dir), dtype=dtype, device=device,
                                          max_total_tokens=max(1, min(plan.batch_size, plan.windows)) * (plan.seq_len + 17)))


def regenerate(runner, tokens: torch.Tensor, plan: Regeneration, desc: str = "regenerate") -> torch.Tensor:
    """[plan.windows, plan.seq_len + 1] token ids: prompts of `tokens` completed by the target (target_runner)."""
    from splitspec.generate import generate_ids
    from splitspec.runtime.sampling_params import SamplingParams

    length = plan.seq_len + 1
    if not 0 < plan.prompt_len < length:
        raise ValueError(f"--regenerate-prompt-len {plan.prompt_len}: must be at least 1 and below --seq-len + 1 ({length})")
    if tokens.numel() <= plan.prompt_len:
        raise ValueError(f"{tokens.numel()} tokens of text: too few for prompts of {plan.prompt_len}")
    generator = torch.Generator().manual_seed(plan.seed)
    starts = torch.randint(0, tokens.numel() - plan.prompt_len, (plan.windows,), generator=generator).tolist()
    batch = max(1, min(plan.batch_size, plan.windows))
    new = length - plan.prompt_len
    rows = []
    with tqdm(total=plan.windows * new, desc=desc, unit="tok", unit_scale=True, disable=None) as bar:
        for first in range(0, plan.windows, batch):
            prompts = [tokens[s : s + plan.prompt_len].tolist() for s in starts[first : first + batch]]
            params = [SamplingParams(temperature=plan.temperature, max_new_tokens=new, ignore_eos=True,
                                     seed=plan.seed * 1_000_003 + first + i if plan.temperature > 0 else None)
                      for i in range(len(prompts))]
            done = generate_ids(runner, prompts, params, set(), on_step=bar.update)
            rows += [prompt + request.output_ids for prompt, request in zip(prompts, done)]
    return torch.tensor(rows, dtype=torch.long)


def regenerated(out_dir: Path, target_dir: Path, train: torch.Tensor, held_out: torch.Tensor, plan: Regeneration,
                held_out_windows: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(training windows, held-out windows) the target wrote, read back from out_dir when a run interrupted there made
    them with the same plan (else made, and kept there until the run ends: forget())."""
    path = Path(out_dir) / FILE
    held_plan = Regeneration(held_out_windows, plan.seq_len, plan.prompt_len, plan.temperature, plan.seed + 1,
                             plan.batch_size)
    key = repr((plan, held_plan))  # every field of both: another plan's windows are not these
    if path.is_file():
        saved = torch.load(path, weights_only=True)
        if saved.get("key") == key:
            logger.info("training on the %d windows the target wrote before (%s)", len(saved["train"]), path)
            return saved["train"], saved["held_out"]
    logger.info("the target writes %d training and %d held-out windows of %d tokens (prompts of %d, temperature %g)",
                plan.windows, held_out_windows, plan.seq_len + 1, plan.prompt_len, plan.temperature)
    runner = target_runner(target_dir, plan, device)
    windows = regenerate(runner, train, plan, "regenerate training windows")
    held = regenerate(runner, held_out, held_plan, "regenerate held-out windows")
    del runner  # its KV cache, before training allocates
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    torch.save({"train": windows, "held_out": held, "key": key}, path)
    return windows, held


def forget(out_dir: Path) -> None:
    """The kept windows removed (the run finished: its directory holds the head alone)."""
    (Path(out_dir) / FILE).unlink(missing_ok=True)
