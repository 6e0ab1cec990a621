"""Per-request sampling parameters. Torch-free: the gateway validates requests with this class."""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

MAX_SEED = 2**63 - 1
# As SGLang: a temperature this small means greedy (dividing logits by it would overflow).
GREEDY_TEMPERATURE_EPS = 1e-6
MAX_TOP_LOGPROBS = 20  # OpenAI's limit
# structured outputs (runtime/grammar.py): the grammar a request's output must match, by kind
GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "ebnf")


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
    # vLLM's penalties on the target's logits, before temperature: frequency and presence count the
    # output so far (OpenAI's range [-2, 2]); repetition divides (or, below zero, multiplies) the logits
    # of tokens seen in the prompt or the output (1.0 = off).
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # None: no logprobs; k >= 0: the chosen token's logprob and the k most likely tokens' (at most 20).
    logprobs: int | None = None
    # OpenAI's logit_bias: (token id, bias in [-100, 100]) added to the logits after the penalties
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    # SGLang's and vLLM's min_p: after top-k and top-p, tokens less likely than min_p x the most likely one are
    # removed (0 = off)
    min_p: float = 0.0
    # vLLM's and SGLang's min_tokens: until this many tokens are out, the stop tokens cannot be sampled;
    # min_tokens_ban holds them (stop_token_ids, and the model's EOS unless ignore_eos), filled by the engine
    min_tokens: int = 0
    min_tokens_ban: tuple[int, ...] = field(default_factory=tuple)
    # None: none; k >= 0: the prompt's logprobs (each prompt token after the first) with the k most likely tokens'
    prompt_logprobs: int | None = None
    # structured outputs: (kind, text), kind one of GRAMMAR_KINDS (json_object's text is empty); the target's
    # logits are masked to what the grammar allows at every verified position (lossless)
    grammar: tuple[str, str] | None = None

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
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= 10:
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        for token, bias in self.logit_bias:
            if token < 0:
                raise ValueError(f"logit_bias token ids must be >= 0, got {token}")
            if not -100.0 <= bias <= 100.0:  # NaN fails too
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {token}")
        if not 0.0 <= self.min_p <= 1.0:  # NaN fails too
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(f"min_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_tokens}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"prompt logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}")
        if self.max_new_tokens == 0 and self.prompt_logprobs is None:
            raise ValueError("max_new_tokens must be at least 1 (0 only with prompt_logprobs: the prompt's logprobs alone)")
        if self.grammar is not None and self.grammar[0] not in GRAMMAR_KINDS:
            raise ValueError(f"grammar kind must be one of {GRAMMAR_KINDS}, got {self.grammar[0]!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")

    @property
    def has_penalties(self) -> bool:
        """The target's logits are changed before sampling (penalties, logit_bias, min_tokens' ban): each node's own."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0 or self.logit_bias
                    or (self.min_tokens and self.min_tokens_ban))

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1

    def with_min_tokens_ban(self, eos_ids) -> "SamplingParams":
        """With min_tokens, the tokens it may not stop on before they are out: stop_token_ids, and the model's
        EOS tokens unless ignore_eos."""
        if not self.min_tokens:
            return self
        ban = set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_ids))
        return replace(self, min_tokens_ban=tuple(sorted(ban)))

    def with_seed(self) -> "SamplingParams":
        """This request with its seed fixed (a random one when unset), so its sampling is reproducible."""
        if self.seed is not None:
            return self
        return replace(self, seed=random.SystemRandom().randrange(MAX_SEED))
