"""Per-request sampling parameters. Torch-free: the gateway validates requests with this class."""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

MAX_SEED = 2**63 - 1
# As SGLang: a temperature this small means greedy (dividing logits by it would overflow).
GREEDY_TEMPERATURE_EPS = 1e-6


@dataclass(frozen=True)
class SamplingParams:
    """temperature < 1e-6 (or top_k 1) = greedy; top_k -1 and top_p 1.0 = off."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None  # None: a random seed is drawn when the request starts
    max_new_tokens: int = 128
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in [0, 2^63), got {self.seed}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1

    def with_seed(self) -> "SamplingParams":
        """This request with its seed fixed (a random one when unset), so its sampling is reproducible."""
        if self.seed is not None:
            return self
        return replace(self, seed=random.SystemRandom().randrange(MAX_SEED))
