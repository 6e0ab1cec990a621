"""What the step loop works on and reports: the speculation and scheduling configs, a request as the engine
holds it (with its speculation counts), a prompt chunk, and what a step hands back (events, a report)."""

from __future__ import annotations

from dataclasses import dataclass, field

from splitspec.runtime.kv_cache import BlockTable
from splitspec.runtime.penalties import PenaltyCounts
from splitspec.runtime.sampling_params import SamplingParams


@dataclass(frozen=True)
class SpecConfig:
    num_draft_tokens: int = 8  # tree budget per request, root included (--speculative-num-draft-tokens)
    accept_threshold_single: float = 1.0  # below 1.0: SGLang's lossy coin rule for sampled requests
    accept_threshold_acc: float = 1.0
    force_greedy_verify: bool = False  # SGLANG_NGRAM_FORCE_GREEDY_VERIFY: accept by argmax even when sampling
    adaptive: bool = False  # --speculative-adaptive: each step's budget follows load and acceptance (adaptive.py)
    num_steps: int = 0  # the drafter's depth (--speculative-num-steps); 0: num_draft_tokens - 1
    topk: int = 0  # the drafter's branching (--speculative-eagle-topk); 0: not a beam drafter (NGRAM: trees)
    adaptive_hysteresis: float = 0.015
    adaptive_probe_interval: int = 200

    @property
    def lossless(self) -> bool:
        return self.accept_threshold_single >= 1.0 and self.accept_threshold_acc >= 1.0


@dataclass(frozen=True)
class SchedulerConfig:
    """SGLang's scheduling flags."""

    max_running_requests: int = 0  # 0 = no limit (--max-running-requests)
    chunked_prefill_size: int = 0  # tokens per step in all: tree tokens first, prompt chunks in the rest; <= 0 = no limit
    # when a step with prompt chunks verifies the decoding requests' trees too (scheduling._schedule): "auto" when the
    # decoding requests outnumber the arriving ones and verify no drafts, "always" (--enable-mixed-chunk, vLLM's way), "prefill-first"
    # (--disable-mixed-chunk, SGLang's default); any of them mixes a backlog over the step's budget
    mixed_chunk: str = "auto"
    # the order waiting requests are admitted in (--schedule-policy): "fcfs" arrival, "lpm" the longest prefix cached
    # first, "lof" the longest output asked first; requests sent back by preemption first whatever it is
    schedule_policy: str = "fcfs"


@dataclass
class SpecStats:
    """Per-request speculation counts (SGLang's spec_verify_ct, vLLM's num_drafts/draft/accepted)."""

    verify_steps: int = 0  # steps that verified a tree with at least one draft
    draft_tokens: int = 0
    accepted_tokens: int = 0
    fallbacks: int = 0  # steps where a delivered tree was unusable and the request decoded plainly
    accepted_per_position: list[int] = field(default_factory=list)  # [d]: drafts accepted at depth d+1

    def add(self, num_drafts: int, num_accepted: int) -> None:
        """One verify step with drafts."""
        _add_acceptance(self, num_drafts, num_accepted)
        self.verify_steps += 1

    @property
    def mean_accept_length(self) -> float:
        """Tokens per verify step: accepted drafts + the bonus token (SGLang's accept length)."""
        return 1 + self.accepted_tokens / self.verify_steps if self.verify_steps else 1.0


@dataclass(eq=False)  # one request is one object: `in` and remove() on the queues compare identity, not every field
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    speculate: bool = True
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    table: BlockTable = field(default_factory=BlockTable)
    stats: SpecStats = field(default_factory=SpecStats)
    unsent: list[int] = field(default_factory=list)  # tokens the drafter has not been told about
    unsent_hidden: list = field(default_factory=list)  # hidden-state drafters: StateRows, one row per unsent token
    hidden_upto: int = 0  # prompt positions whose (next token, hidden state) pair was recorded
    num_prefilled: int = 0  # tokens of fill_ids already in the KV cache (chunked prefill)
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (at first admission)
    fill_len: int = 0  # tokens to prefill before decoding: the prompt, or prompt + output[:-1] after preemption
    arrival: int = 0  # admission priority: lower runs first and is preempted last
    num_preemptions: int = 0
    draft_budget: int = 0  # the next verify's tree budget, once decided (asked for when >= 2); 0: not yet
    penalties: PenaltyCounts = field(default_factory=PenaltyCounts)  # with penalties: its counts, kept across steps
    logprobs: list = field(default_factory=list)  # TokenLogprob per output token, when params.logprobs is set
    prompt_logprobs: list = field(default_factory=list)  # TokenLogprob per prompt token after the first, when asked
    grammar: object = None  # structured outputs: the Future of its compiled grammar, until admitted
    matcher: object = None  # then its grammar matcher (xgrammar), advanced by every emitted token

    def __post_init__(self):
        self.fill_len = self.fill_len or len(self.prompt_ids)

    def emit(self, tokens: list[int], eos_ids: set[int], hidden=None, logprobs: list[TokenLogprob] | None = None,
             told: bool = False) -> StepEvent:
        """Append tokens until a stop condition; what follows a stop is dropped. hidden: one state per
        token (a hidden-state drafter's pairing: draft_features.StateRows), kept for the emitted ones; the tokens
        (and states) the drafter has not been told about grow, unless told (it has them: a catch-up ahead)."""
        emitted = []
        for token in tokens:
            self.output_ids.append(token)
            emitted.append(token)
            if self.matcher is not None and (not self.matcher.accept_token(token) or self.matcher.is_terminated()):
                self.finish_reason = "stop"  # the grammar is complete (its stop token taken; never a refusal: masked)
            elif token in self.params.stop_token_ids or (not self.params.ignore_eos and token in eos_ids):
                self.finish_reason = "stop"
            elif len(self.output_ids) >= self.params.max_new_tokens:
                self.finish_reason = "length"
            if self.finish_reason:
                break
        if self.speculate and self.finish_reason is None and not told:  # a finished request is never asked again
            self.unsent.extend(emitted)
            if hidden is not None:
                self.unsent_hidden.append(hidden.first(len(emitted)))
        if logprobs is not None:
            logprobs = logprobs[: len(emitted)]
            self.logprobs.extend(logprobs)
        first = self.params.prompt_logprobs is not None and len(self.output_ids) == len(emitted)
        return StepEvent(self.request_id, emitted, self.finish_reason, logprobs=logprobs,
                         prompt_logprobs=self.prompt_logprobs if first else None)

    def prompt_only(self) -> StepEvent:
        """max_new_tokens 0: the prompt's logprobs were all it asked for; it ends without a token."""
        self.finish_reason = "length"
        return StepEvent(self.request_id, [], "length", prompt_logprobs=self.prompt_logprobs)

    @property
    def fill_ids(self) -> list[int]:
        return (self.prompt_ids + self.output_ids)[: self.fill_len]

    @property
    def wants_prompt_logprobs(self) -> bool:
        """A fresh prompt whose logprobs were asked for: every prefill row's logits are kept."""
        return self.params.prompt_logprobs is not None and not self.output_ids

    @property
    def decoding(self) -> bool:
        """Prefilled and holding a root token: the next step verifies a tree for it."""
        return bool(self.output_ids) and self.num_prefilled >= self.fill_len


@dataclass
class Chunk:
    request: Request
    start: int
    end: int

    @property
    def samples(self) -> bool:
        """The chunk that completes a fresh prompt: its last row's logits give the first output token."""
        return self.end == self.request.fill_len and not self.request.output_ids


@dataclass
class StepReport:
    """What one step did, for metrics: phase times and speculation counts."""

    seconds: dict[str, float] = field(default_factory=dict)  # schedule, draft, verify, accept, commit
    prefill_tokens: int = 0  # tokens prefilled this step (recomputation after preemption included)
    prompt_tokens: int = 0  # prompt tokens of requests that got their first token this step
    new_requests: int = 0  # requests that got their first token this step (from their prompt's last chunk)
    decode_requests: int = 0  # requests whose next tokens this step verified (a root alone: plain decoding)
    generated_tokens: int = 0
    accept_lengths: list[int] = field(default_factory=list)  # per verify with drafts: accepted + 1
    tree_depths: list[int] = field(default_factory=list)  # per verify with drafts: the tree's depth
    budget: int = 0  # the tree budget this step's speculating requests verified (1: plain decoding)
    forward_tokens: int = 0  # tokens in the target forward
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    fallbacks: int = 0
    finished: list[str] = field(default_factory=list)  # finish reasons of requests that ended
    cached_tokens: int = 0  # tokens served from the prefix cache to requests admitted this step
    preemptions: int = 0  # running requests sent back to wait for pages
    padding_tokens: int = 0  # filler tree nodes that made the verify batch one captured graph's shape
    prompt_padding_tokens: int = 0  # filler tokens after prompt chunks that made a prefill step a prompt graph's shape
    grammar_pruned: int = 0  # drafted nodes a request's grammar forbids, pruned before verification
    caught_up_ahead: int = 0  # verified chains whose drafter caught up on them before acceptance (catch_up_ahead.py)
    deferred: bool = False  # a plain step launched and left in flight: its tokens come with the next step's (overlap.py)
    quiet: bool = False  # a settled drafting-off run's step: the policy not asked nor told now (policy_link.QuietRun)

    def add(self, num_drafts: int, num_accepted: int) -> None:
        """One request's verify with drafts in this step."""
        _add_acceptance(self, num_drafts, num_accepted)


@dataclass
class StepEvent:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None
    error: str = ""  # with finish_reason "error": what went wrong
    logprobs: list[TokenLogprob] | None = None  # one per new token when the request asked for them
    prompt_logprobs: list[TokenLogprob] | None = None  # with the first tokens: one per prompt token after the first


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of an emitted token and of its most likely alternatives, from the raw
    logits (before penalties, temperature and filtering; vLLM's default `raw_logprobs`)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


def _add_acceptance(stats, num_drafts: int, num_accepted: int) -> None:
    """One verify with drafts into counts that have draft_tokens, accepted_tokens and accepted_per_position."""
    stats.draft_tokens += num_drafts
    stats.accepted_tokens += num_accepted
    while len(stats.accepted_per_position) < num_accepted:
        stats.accepted_per_position.append(0)
    for d in range(num_accepted):
        stats.accepted_per_position[d] += 1
