"""Training a Llama-architecture causal LM from scratch on a prepared dataset (dataset.py).

The model is transformers' LlamaForCausalLM, so what is written is a plain HF directory that
transformers and the splitspec runtime both load. Training is seeded per step (the batch of step s
depends only on (seed, s)), so a run resumed from its last checkpoint sees the same batches as an
uninterrupted one. The weights kept are those of the best held-out evaluation.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from splitspec.train.configs import LMShape, TrainConfig  # noqa: F401  (defined there, torch-free; callers import them here too)
from splitspec.train.dataset import EOS_TOKEN, load_tokens, vocab_size_of
from splitspec.train.resume import clear_state, load_state, save_state

logger = logging.getLogger(__name__)

REPORT_FILE = "training.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def learning_rate(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to min_lr_ratio * lr."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def batch_for_step(tokens: torch.Tensor, step: int, cfg: TrainConfig) -> torch.Tensor:
    """[batch_size, seq_len + 1] random windows; depends only on (seed, step)."""
    generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    starts = torch.randint(0, tokens.numel() - cfg.seq_len - 1, (cfg.batch_size,), generator=generator)
    return torch.stack([tokens[s : s + cfg.seq_len + 1] for s in starts.tolist()])


def eval_windows(tokens: torch.Tensor, cfg: TrainConfig) -> torch.Tensor:
    """Non-overlapping [n, seq_len + 1] windows covering up to eval_tokens held-out tokens."""
    num = max(1, min(cfg.eval_tokens, tokens.numel() - 1) // cfg.seq_len)
    return torch.stack([tokens[i * cfg.seq_len : i * cfg.seq_len + cfg.seq_len + 1] for i in range(num)])


def bigram_loss(train: torch.Tensor, held_out: torch.Tensor, vocab_size: int) -> float:
    """Held-out cross-entropy (nats/token) of the best add-k bigram model fit on train: the baseline."""
    counts = torch.zeros(vocab_size * vocab_size, dtype=torch.float64)
    counts.index_add_(0, train[:-1] * vocab_size + train[1:], torch.ones(train.numel() - 1, dtype=torch.float64))
    counts = counts.view(vocab_size, vocab_size)
    rows = counts.sum(1)
    prev, nxt = held_out[:-1], held_out[1:]
    best = float("inf")
    for k in (0.001, 0.01, 0.03, 0.1, 0.3, 1.0):
        probs = (counts[prev, nxt] + k) / (rows[prev] + k * vocab_size)
        best = min(best, -probs.log().mean().item())
    return best


class LMTrainer:
    def __init__(self, dataset_dir: Path, out_dir: Path, shape: LMShape, cfg: TrainConfig):
        from transformers import LlamaConfig, LlamaForCausalLM

        self.dataset_dir, self.out_dir, self.shape, self.cfg = dataset_dir, out_dir, shape, cfg
        self.device = torch.device(cfg.device)
        splits = load_tokens(dataset_dir)
        self.train_tokens, self.held_out_tokens = splits["train"], splits["held_out"]
        self.vocab_size = vocab_size_of(dataset_dir)
        eos_id = json.loads((dataset_dir / "tokenizer.json").read_text())["model"]["vocab"][EOS_TOKEN]
        torch.manual_seed(cfg.seed)
        self.hf_config = LlamaConfig(vocab_size=self.vocab_size, bos_token_id=eos_id, eos_token_id=eos_id,
                                     pad_token_id=eos_id, rms_norm_eps=1e-5, rope_theta=10000.0, **asdict(shape))
        self.model = LlamaForCausalLM(self.hf_config).to(self.device)
        decay = [p for n, p in self.model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in self.model.named_parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=(0.9, 0.95), fused=self.device.type == "cuda",
        )
        self.step, self.best_loss, self.best_state, self.history = 0, float("inf"), None, []

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda")

    @torch.no_grad()
    def held_out_loss(self) -> float:
        self.model.eval()
        windows = eval_windows(self.held_out_tokens, self.cfg)
        total = 0.0
        for chunk in windows.split(self.cfg.batch_size):
            chunk = chunk.to(self.device)
            with self._autocast():
                total += _loss(self.model, chunk).item() * len(chunk)
        self.model.train()
        return total / len(windows)

    def _save_state(self) -> None:
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "step": self.step,
                 "best_loss": self.best_loss, "best_state": self.best_state, "history": self.history}
        save_state(self.out_dir, state)

    def _load_state(self) -> bool:
        state = load_state(self.out_dir, self.device)
        if state is None:
            return False
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.best_loss, self.history = state["step"], state["best_loss"], state["history"]
        self.best_state = state["best_state"]
        logger.info("resumed %s at step %d (best held-out loss %.4f)", self.out_dir, self.step, self.best_loss)
        return True

    def _evaluate(self) -> None:
        loss = self.held_out_loss()
        self.history.append({"step": self.step, "held_out_loss": round(loss, 5)})
        if loss < self.best_loss:
            self.best_loss = loss
            self.best_state = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def train(self) -> dict:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if not self._load_state():
            self._evaluate()  # the untrained model's held-out loss opens the history
        self.model.train()
        start, train_loss = time.perf_counter(), float("nan")
        bar = tqdm(total=self.cfg.steps, initial=self.step, desc=f"train {self.out_dir.name}", unit="step", disable=None)
        stopped_early = False
        while self.step < self.cfg.steps:
            if self.cfg.time_budget_s and time.perf_counter() - start > self.cfg.time_budget_s:
                logger.warning("time budget of %.0fs reached at step %d of %d", self.cfg.time_budget_s, self.step, self.cfg.steps)
                self._evaluate()
                stopped_early = True
                break
            for group in self.optimizer.param_groups:
                group["lr"] = learning_rate(self.step, self.cfg)
            batch = batch_for_step(self.train_tokens, self.step, self.cfg).to(self.device)
            with self._autocast():
                loss = _loss(self.model, batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            train_loss = loss.item()
            bar.update()
            bar.set_postfix(loss=f"{train_loss:.3f}", best=f"{self.best_loss:.3f}")
            if self.step % self.cfg.eval_every == 0 or self.step == self.cfg.steps:
                self._evaluate()
                logger.info("step %d: train loss %.4f, held-out %.4f", self.step, train_loss, self.history[-1]["held_out_loss"])
            if self.step % self.cfg.save_every == 0 and self.step < self.cfg.steps:
                self._save_state()
        bar.close()
        return self._finish(train_loss, time.perf_counter() - start, stopped_early)

    def _finish(self, train_loss: float, seconds: float, stopped_early: bool) -> dict:
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.cfg.save_dtype]
        self.model.load_state_dict(self.best_state)
        self.model.to(dtype).save_pretrained(self.out_dir, max_shard_size="15MB")
        for name in TOKENIZER_FILES:
            if (self.dataset_dir / name).is_file():
                shutil.copy(self.dataset_dir / name, self.out_dir / name)
        report = {
            "shape": asdict(self.shape), "train": asdict(self.cfg), "vocab_size": self.vocab_size,
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "steps": self.step, "tokens_seen": self.step * self.cfg.batch_size * self.cfg.seq_len,
            "train_tokens": self.train_tokens.numel(), "held_out_tokens": self.held_out_tokens.numel(),
            "final_train_loss": round(train_loss, 5), "best_held_out_loss": round(self.best_loss, 5),
            "bigram_held_out_loss": round(bigram_loss(self.train_tokens, self.held_out_tokens, self.vocab_size), 5),
            "history": self.history, "seconds_this_run": round(seconds, 1), "stopped_by_time_budget": stopped_early,
            "device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
        }
        (self.out_dir / REPORT_FILE).write_text(json.dumps(report, indent=1) + "\n")
        clear_state(self.out_dir)
        logger.info("saved %s: held-out loss %.4f (bigram baseline %.4f)", self.out_dir,
                    report["best_held_out_loss"], report["bigram_held_out_loss"])
        return report


def _loss(model, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of windows [B, T + 1]."""
    logits = model(batch[:, :-1]).logits  # [B, T, V]
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
