"""The training runs' settings and model shapes (`splitspec train`, its presets): plain dataclasses, torch-free, so
that the command's flags and presets load without the trainers (lm.py, heads.py import torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LMShape:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False

    def num_parameters(self, vocab_size: int) -> int:
        head_dim = self.hidden_size // self.num_attention_heads
        attention = 2 * self.hidden_size * self.hidden_size + 2 * self.hidden_size * self.num_key_value_heads * head_dim
        layer = attention + 3 * self.hidden_size * self.intermediate_size + 2 * self.hidden_size
        embeddings = vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * layer + embeddings + self.hidden_size


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    batch_size: int = 32
    seq_len: int = 512
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_tokens: int = 65536
    save_every: int = 200
    seed: int = 0
    device: str = "cpu"
    save_dtype: str = "float32"
    time_budget_s: float = 0.0  # > 0: stop after this many seconds of training (recorded in the report)


@dataclass(frozen=True)
class HeadTrainConfig:
    kind: str = "eagle3"  # eagle | eagle3
    steps: int = 2000
    batch_size: int = 8
    seq_len: int = 512
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    grad_clip: float = 0.5
    ttt_steps: int = 3  # EAGLE-3 training-time test depth (1 = no test); EAGLE-2 trains one step
    draft_vocab_size: int = 32000  # EAGLE-3; at most the target's vocabulary
    intermediate_size: int = 0  # 0 = the target's
    eval_every: int = 100
    eval_windows: int = 32
    save_every: int = 200
    seed: int = 0
    device: str = "cpu"
    save_dtype: str = "float32"
    time_budget_s: float = 0.0  # > 0: stop after this many seconds of training
    accept_prompts: int = 8  # held-out prompts of the final accept-length estimate (0 = skip it)
    accept_new_tokens: int = 64
    regenerate: int = 0  # > 0: train on this many windows the target writes from the text's prompts (train.regenerate)
    regenerate_prompt_len: int = 64
    regenerate_temperature: float = 0.0
