"""The one step loop (ARCHITECTURE.md §2): schedule -> draft -> verify -> accept -> commit.

Every running request decodes by verifying a tree rooted at its last token (the one the target has
not seen yet): a drafter's tree, or the root alone when there is no draft, which is plain decoding.
All prefills and trees of a step go through one target forward.

KV of a verified tree, for a request with L committed tokens (the tree's nodes were written at
logical slots L .. L+N-1 in node order):

    before commit   [ committed 0..L-1 | n0 n1 n2 n3 n4 ]      accepted path n0 -> n2 -> n4
    after commit    [ committed 0..L-1 | n0 n2 n4 ]             slots of n2, n4 copied down, rest freed

The bonus token is the next root and is not in the cache.

Scheduling is optimistic (SGLang's and vLLM's): a waiting request joins when the pool has room for its
prompt and one tree, not for its whole output. Each step reserves, oldest request first, the pages of
every decoding request's tree and of every prefill chunk; when the pool runs dry, the newest running
request is preempted: its KV goes to the prefix cache (or back to the pool), it returns to the front of
the waiting queue with the tokens it has, and on readmission prompt + output so far is prefilled again
(from the prefix cache where its pages survived). Outputs do not change: sampling is keyed by position.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from splitspec import kernels
from splitspec.runtime.batch import SequenceInput
from splitspec.runtime.kv_cache import BlockTable, OutOfPagesError
from splitspec.runtime.penalties import apply_penalties, path_tokens
from splitspec.runtime.runner import ModelRunner
from splitspec.runtime.sampling import FINAL_COIN_SALT, keyed_uniform, process_logits, sample
from splitspec.runtime.sampling_params import SamplingParams
from splitspec.runtime.tree import DraftTree, child_links, depths, positions, tree_mask
from splitspec.verifier_svc.acceptance import Acceptance, accept_target_tokens
from splitspec.verifier_svc.adaptive import AdaptiveConfig, AdaptiveSpeculation, StepShape, budget_ladder
from splitspec.verifier_svc.drafter_client import DRAFT_FAULT, DraftAsk, DrafterClient

_ARGMAX = SamplingParams(temperature=0.0)  # a row sample() argmaxes (its token unused, or a greedy request's)
logger = logging.getLogger(__name__)


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


@dataclass
class SpecStats:
    """Per-request speculation counts (SGLang's spec_verify_ct, vLLM's num_drafts/draft/accepted)."""

    verify_steps: int = 0  # steps that verified a tree with at least one draft
    draft_tokens: int = 0
    accepted_tokens: int = 0
    fallbacks: int = 0  # steps where a delivered tree was unusable and the request decoded plainly
    accepted_per_position: list[int] = field(default_factory=list)  # [d]: drafts accepted at depth d+1

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
    unsent_hidden: list = field(default_factory=list)  # hidden-state drafters: [k, H] blocks, one row per unsent token
    hidden_upto: int = 0  # prompt positions whose (next token, hidden state) pair was recorded
    num_prefilled: int = 0  # tokens of fill_ids already in the KV cache (chunked prefill)
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (at first admission)
    fill_len: int = 0  # tokens to prefill before decoding: the prompt, or prompt + output[:-1] after preemption
    arrival: int = 0  # admission priority: lower runs first and is preempted last
    num_preemptions: int = 0
    draft_budget: int = 0  # the next verify's tree budget, once decided (asked for when >= 2); 0: not yet
    logprobs: list = field(default_factory=list)  # TokenLogprob per output token, when params.logprobs is set

    def __post_init__(self):
        self.fill_len = self.fill_len or len(self.prompt_ids)

    @property
    def fill_ids(self) -> list[int]:
        return (self.prompt_ids + self.output_ids)[: self.fill_len]

    @property
    def decoding(self) -> bool:
        """Prefilled and holding a root token: the next step verifies a tree for it."""
        return bool(self.output_ids) and self.num_prefilled >= self.fill_len


@dataclass
class _Chunk:
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


@dataclass
class StepEvent:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None
    error: str = ""  # with finish_reason "error": what went wrong
    logprobs: list[TokenLogprob] | None = None  # one per new token when the request asked for them


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of an emitted token and of its most likely alternatives, from the raw
    logits (before penalties, temperature and filtering; vLLM's default `raw_logprobs`)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


def token_logprobs(logits: torch.Tensor, tokens: list[int], params: SamplingParams) -> list[TokenLogprob] | None:
    """logits [k, V]: row j predicts tokens[j]. None when the request did not ask for logprobs."""
    if params.logprobs is None:
        return None
    logprobs = logits.float().log_softmax(-1)
    chosen = logprobs[torch.arange(len(tokens), device=logits.device), torch.tensor(tokens, device=logits.device)].tolist()
    if not params.logprobs:
        return [TokenLogprob(lp) for lp in chosen]
    values, ids = logprobs.topk(min(params.logprobs, logprobs.shape[-1]), dim=-1)
    return [TokenLogprob(lp, tuple(zip(row_ids, row_values)))
            for lp, row_ids, row_values in zip(chosen, ids.tolist(), values.tolist())]


def adaptive_policy(spec: SpecConfig) -> AdaptiveSpeculation | None:
    """The load-adaptive policy the config asks for, or None (fixed trees)."""
    if not spec.adaptive:
        return None
    return AdaptiveSpeculation(AdaptiveConfig(spec.num_draft_tokens, spec.num_steps or spec.num_draft_tokens - 1,
                                              spec.topk == 1, spec.adaptive_hysteresis, spec.adaptive_probe_interval))


def verify_tree_sizes(spec: SpecConfig | None) -> tuple[int, ...]:
    """The tree sizes a target verifies (each gets CUDA graphs): the full budget, or with the adaptive policy
    every budget of its ladder (a budget that ran eagerly would cost more than its graph and mislead the policy)."""
    if spec is None:
        return ()
    return tuple(n for n in budget_ladder(spec.num_draft_tokens) if n > 1) if spec.adaptive else (spec.num_draft_tokens,)


FEED_EVERY = 16  # adaptive, speculation off: a request's new tokens go to the drafter in batches of this many


def _trim(tree: DraftTree, budget: int) -> DraftTree:
    """The tree's first `budget` nodes (parents come before children, so it is still a tree)."""
    return DraftTree(tree.tokens[:budget], tree.parents[:budget], tree.scores[:budget] if tree.scores else None)


@dataclass
class _Verify:
    request: Request
    tree: DraftTree
    seq_len: int  # committed KV length before the step


class Engine:
    def __init__(self, runner: ModelRunner, drafter: DrafterClient | None, spec: SpecConfig, eos_ids: set[int],
                 scheduler: SchedulerConfig | None = None, prefix_cache=None, sync_timing: bool = False):
        """sync_timing: on a GPU, wait for the device at each phase boundary, so that the step's phase
        times (report.seconds) are the device's too, not only the host's launches (`splitspec bench`)."""
        self.sync_timing = sync_timing and runner.device.type == "cuda"
        self.runner, self.drafter, self.spec, self.eos_ids = runner, drafter, spec, eos_ids
        self.scheduler = scheduler or SchedulerConfig()
        self.prefix_cache = prefix_cache
        if prefix_cache is not None:
            runner.kv_cache.evictor = prefix_cache.evict
        self.waiting: list[Request] = []  # by arrival, preempted requests back at the front
        self.running: list[Request] = []
        self._ids = itertools.count()
        self.report = StepReport()  # the last step's
        self._events: list[StepEvent] = []  # ended by the scheduler this step (requests that can never fit)
        # EAGLE-style drafters get, with every token after the first, the target's state(s) of the position
        # before it (REFERENCES §1.4: token t[p+1] pairs with h[p]): the final normed state, or the inputs
        # of the layers the runner captures (EAGLE-3, concatenated)
        self.needs_hidden = drafter is not None and drafter.needs_hidden_states
        self.adaptive = adaptive_policy(spec) if drafter is not None else None
        self.budget = spec.num_draft_tokens  # the tree budget of the asks being made (adaptive: chosen per step)
        # the policy needs the forward's own time: on a GPU, wait for it (the accept phase that follows waits anyway)
        self._sync_verify = self.adaptive is not None and runner.device.type == "cuda"
        self._unobserved: tuple[StepShape, float, float] | None = None  # the last step: (shape, start, seconds)
        # called once per step with a forward, right after the forward is queued and before its results are
        # read: on a GPU the caller's host work for the last step (its metrics and streams) runs under the
        # device's (the serving loop's overlap; EngineWorker)
        self.while_forward: Callable[[], None] | None = None

    def add_request(self, prompt_ids: list[int], params: SamplingParams, speculate: bool = True) -> Request:
        number = next(self._ids)
        request = Request(f"r{number}", list(prompt_ids), params.with_seed(), speculate and self.drafter is not None,
                          arrival=number)
        self.waiting.append(request)
        return request

    def abort(self, request: Request) -> bool:
        """Stop a request between steps; its pages and drafter state are released. False if it had ended."""
        if request.finish_reason is not None:
            return False
        request.finish_reason = "abort"
        request.unsent_hidden = []
        if request in self.waiting:
            self.waiting.remove(request)
            if request.speculate and request.num_preemptions:  # opened at first admission
                self.drafter.release(request.request_id)
        else:
            self._retire()
        return True

    def restart_adaptive(self) -> None:
        """The load-adaptive policy forgets what it learned (e.g. the warm-up's forwards, which compiled)."""
        if self.adaptive is not None:
            self.adaptive = adaptive_policy(self.spec)
            self._unobserved = None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _clock(self) -> float:
        if self.sync_timing:
            torch.cuda.synchronize(self.runner.device)
        return time.perf_counter()

    def step(self) -> list[StepEvent]:
        self.report = StepReport(budget=self.budget)
        start = self._clock()
        if self._unobserved is not None:  # the last step's whole cycle is known now: the caller's handling of its
            shape, began, seconds = self._unobserved  # events (streaming, detokenizing) is part of its cost too
            self._unobserved = None
            shape.base_seconds += max(min(start - began, 2 * seconds) - seconds, 0.0)  # not an idle wait
            self.adaptive.observe(shape)
        prefills = self._schedule()
        scheduled = self._clock()
        trees = self._draft()
        drafted = self._clock()
        verifies = [_Verify(r, trees.get(r.request_id) or DraftTree((r.output_ids[-1],), (-1,)), r.table.num_tokens)
                    for r in self.running if r.decoding]
        events = self._events + self._forward_and_accept(prefills, verifies)
        self._events = []
        self._retire()
        asking = self._clock()
        self._request_drafts()  # the next trees, as soon as acceptance is known
        self.report.seconds.update(schedule=scheduled - start, draft=drafted - scheduled, ask=self._clock() - asking)
        self.report.prefill_tokens = sum(c.end - c.start for c in prefills)
        self.report.generated_tokens = sum(len(e.new_token_ids) for e in events)
        self.report.finished = [e.finish_reason for e in events if e.finish_reason]
        if self.adaptive is not None:
            self._observe(verifies, start)
        return events

    def _observe(self, verifies: list[_Verify], start: float) -> None:
        """What this step did, for the adaptive policy: fed at the next step's start, when the whole cycle is
        known. Its base is everything but the forward and the speculation phases (schedule, accept, commit,
        the engine's own bookkeeping, and then the caller's)."""
        seconds = self.report.seconds
        speculating = sum(1 for v in verifies if v.request.speculate)
        verify, spec = seconds.get("verify", 0.0), seconds.get("draft", 0.0) + seconds.get("ask", 0.0)
        own = self._clock() - start
        self._unobserved = (StepShape(
            budget=self.report.budget, speculating=speculating, plain=len(verifies) - speculating,
            forward_tokens=self.report.forward_tokens, verify_seconds=verify, spec_seconds=spec,
            base_seconds=max(own - verify - spec, 0.0),
            accepts=list(zip(self.report.tree_depths, [n - 1 for n in self.report.accept_lengths]))), start, own)

    def _choose_budget(self) -> int:
        """The tree budget of the next step's asks: fixed, or the adaptive policy's choice for the batch that
        will decode next."""
        if self.adaptive is None:
            return self.spec.num_draft_tokens
        limit = self.scheduler.chunked_prefill_size  # a prefill that fits the next chunk decodes next step too
        decoding = [r for r in self.running if r.decoding or limit <= 0 or r.fill_len - r.num_prefilled <= limit]
        speculating = sum(1 for r in decoding if r.speculate)
        return self.adaptive.choose(speculating, len(decoding) - speculating, self.report.prefill_tokens)

    # schedule ------------------------------------------------------------------------------------
    def _tree_tokens(self, request: Request) -> int:
        """KV slots a decoding request's next verify may write: its tree budget, or the root alone."""
        if not request.speculate:
            return 1
        return request.draft_budget or self.budget

    def _schedule(self) -> list[_Chunk]:
        """Admit, then reserve this step's pages oldest request first, preempting the newest when the
        pool runs dry. The step's token budget (--chunked-prefill-size) counts every decoding request's
        tree first; prompt chunks share what is left."""
        self._admit()
        limit = self.scheduler.chunked_prefill_size
        budget = None if limit <= 0 else limit - sum(self._tree_tokens(r) for r in self.running if r.decoding)
        chunks = []
        for request in sorted(self.running, key=lambda r: r.arrival):
            if request not in self.running:  # preempted by an older request this step
                continue
            if request.decoding:
                self._reserve(request, request.table.num_tokens + self._tree_tokens(request))
                continue
            size = request.fill_len - request.num_prefilled
            if budget is not None:
                size = min(size, budget)
            if size <= 0:
                continue
            if self._reserve(request, request.num_prefilled + size):
                chunks.append(_Chunk(request, request.num_prefilled, request.num_prefilled + size))
                if budget is not None:
                    budget -= size
        return chunks

    def _reserve(self, request: Request, num_tokens: int) -> bool:
        """Pages for num_tokens slots of request, preempting newer requests as needed. False when the
        request itself was preempted (or ended: it cannot fit even alone)."""
        kv = self.runner.kv_cache
        while True:
            try:
                kv.reserve(request.table, num_tokens)
                return True
            except OutOfPagesError:
                victim = max(self.running, key=lambda r: r.arrival)
                if victim is request and len(self.running) == 1:
                    self._fail(request, f"RESOURCE_EXHAUSTED: the request needs {kv.pages_for(num_tokens)} KV pages "
                                        f"and the cache has {kv.num_pages} (--max-total-tokens)")
                    return False
                self._preempt(victim)
                if victim is request:
                    return False

    def _preempt(self, request: Request) -> None:
        """Back to the waiting queue's front; the KV it computed is offered to the prefix cache."""
        logger.info("preempting %s (%d tokens in KV, %d generated): out of KV pages", request.request_id,
                    request.table.num_tokens, len(request.output_ids))
        self._cache_and_release(request)
        request.fill_len = len(request.prompt_ids) + max(len(request.output_ids) - 1, 0)
        request.num_prefilled = 0
        request.num_preemptions += 1
        self.report.preemptions += 1
        request.draft_budget = 0  # asked again once it decodes
        self.running.remove(request)
        position = next((i for i, r in enumerate(self.waiting) if r.arrival > request.arrival), len(self.waiting))
        self.waiting.insert(position, request)

    def _fail(self, request: Request, message: str) -> None:
        logger.warning("ending %s: %s", request.request_id, message)
        request.finish_reason = "error"
        self._events.append(StepEvent(request.request_id, [], "error", message))
        self._retire()

    def _admit(self) -> None:
        """Waiting requests join in order, up to --max-running-requests, while the pool (free pages and
        pages only the prefix cache holds) has room for their prefill and first tree beyond what the
        running requests' next trees take."""
        limit = self.scheduler.max_running_requests
        kv = self.runner.kv_cache
        available = kv.allocator.num_free + (self.prefix_cache.num_evictable if self.prefix_cache is not None else 0)
        available -= sum(kv.pages_for(r.table.num_tokens + self._tree_tokens(r)) - len(r.table.pages)
                         for r in self.running if r.decoding)
        while self.waiting and (limit <= 0 or len(self.running) < limit):
            request = self.waiting[0]
            if request.params.max_new_tokens == 0:
                self.waiting.pop(0)
                request.finish_reason = "length"
                continue
            cached = self._match_prefix(request)
            needed = kv.pages_for(request.fill_len + self._tree_tokens(request)) - len(cached)
            if self.running and needed > available:
                break
            self.waiting.pop(0)
            available -= needed + sum(1 for page in cached if kv.allocator.refcount(page) == 1)
            if request.speculate and not request.num_preemptions:  # a hidden-state drafter gets the rest paired, later
                self.drafter.open(request.request_id, request.prompt_ids[:1] if self.needs_hidden else request.prompt_ids)
            if cached:
                kv.allocator.incref(cached)
                request.table.pages = list(cached)
                request.table.num_tokens = request.num_prefilled = len(cached) * kv.page_size
                self.report.cached_tokens += request.num_prefilled
                if not request.num_preemptions:
                    request.cached_tokens = request.num_prefilled
            self.running.append(request)

    def _match_prefix(self, request: Request) -> list[int]:
        """Cached pages of the longest cached prefix of what the request must prefill. A fresh prompt's
        last token is always computed: its logits give the first output token."""
        if self.prefix_cache is None:
            return []
        if self.needs_hidden and request.speculate and not request.output_ids:
            return []  # the drafter needs the prompt's hidden states, which cached pages do not keep: recompute
        fill = request.fill_ids
        return self.prefix_cache.match(fill if request.output_ids else fill[:-1])

    # draft ---------------------------------------------------------------------------------------
    def _request_drafts(self, only_missing: bool = False) -> None:
        """Ask the drafter for the next tree of every decoding request that speculates, with this step's budget
        (adaptive: the policy's choice; below 2, no tree: its new tokens still reach the drafter every
        FEED_EVERY tokens, so that speculation resumes without a catch-up). A hidden-state drafter also gets
        each prefill chunk's (token, state) pairs as they are computed (a budget of 0: no tree), so it catches
        up on a long prompt alongside chunked prefill, not all at once."""
        if not only_missing:
            was = self.adaptive is not None and self.adaptive.budget >= 2
            self.budget = self._choose_budget()
            if self.adaptive is not None and was != (self.adaptive.budget >= 2):  # not for a probe's one step
                logger.info("adaptive speculation: %s at %d decoding requests (predicted tokens/s by budget: %s)",
                            "drafting again" if self.adaptive.budget >= 2 else "drafting off", len(self.running),
                            {n: round(v) for n, v in self.adaptive.predicted.items()})
        asks = []
        for request in self.running:
            if not request.speculate:
                continue
            if request.decoding and not (only_missing and request.draft_budget):
                request.draft_budget = self.budget
                if self.budget >= 2:
                    budget = self.budget
                elif len(request.unsent) >= FEED_EVERY:
                    budget = 0  # feed only
                else:
                    continue
            elif not request.decoding and not only_missing and self.needs_hidden and request.unsent:
                budget = 0  # feed only
            else:
                continue
            hidden = torch.cat(request.unsent_hidden) if request.unsent_hidden else None
            asks.append(DraftAsk(request.request_id, request.unsent, budget, hidden))
            request.unsent, request.unsent_hidden = [], []
        if asks:
            self.drafter.request(asks)

    def _draft(self) -> dict[str, DraftTree | None]:
        """Collect this step's trees (asking now for requests that began decoding since)."""
        self._request_drafts(only_missing=True)
        asked = {}
        for request in self.running:
            if request.speculate and request.decoding:
                if request.draft_budget >= 2:
                    asked[request.request_id] = request
                else:  # no tree this step
                    request.draft_budget = 0
        if not asked:
            return {}
        trees = self.drafter.collect(list(asked))
        for request_id, request in asked.items():
            budget, request.draft_budget = request.draft_budget, 0
            tree = trees.get(request_id)
            if isinstance(tree, DraftTree) and tree.num_nodes > budget:  # a bet drafted under a larger budget
                tree = trees[request_id] = _trim(tree, budget)
            if tree is DRAFT_FAULT or (tree is not None and not self._usable(request, tree, budget)):
                trees[request_id] = None
                request.stats.fallbacks += 1
                self.report.fallbacks += 1
        return trees

    def _usable(self, request: Request, tree: DraftTree, budget: int) -> bool:
        vocab = self.runner.config.vocab_size
        # tokens past a request's limit are dropped at emit
        return (tree.tokens[0] == request.output_ids[-1] and tree.num_nodes <= budget
                and all(0 <= t < vocab for t in tree.tokens))

    # verify + accept -----------------------------------------------------------------------------
    def _forward_and_accept(self, prefills: list[_Chunk], verifies: list[_Verify]) -> list[StepEvent]:
        sequences = [SequenceInput(c.request.table, c.request.fill_ids[c.start : c.end], logits="last" if c.samples else "none")
                     for c in prefills]
        pad = 0 if prefills else self._pad_size(verifies)
        for v in verifies:
            tokens, parents = list(v.tree.tokens), list(v.tree.parents)
            if pad > len(tokens):  # filler children of the root, never walked: their rows are not read
                self.report.padding_tokens += pad - len(tokens)
                tokens += [tokens[0]] * (pad - len(tokens))
                parents += [0] * (pad - len(parents))
            sequences.append(SequenceInput(v.request.table, tokens, positions(parents, v.seq_len),
                                           tree_mask(parents) if len(tokens) > 1 else None, "all"))
        if not sequences:
            return []
        forward_start = self._clock()
        batch = self.runner.batch(sequences)
        output = self.runner.forward(batch, return_hidden=self.needs_hidden and not self.runner.capture_layers)
        hidden_work = 0.0
        if self.while_forward is not None:  # the forward is queued on the device: the caller's host work runs under it
            began = time.perf_counter()
            self.while_forward()
            hidden_work = time.perf_counter() - began
        features = output.aux_hidden_states if self.runner.capture_layers else output.hidden_states
        logits = output.logits  # [rows, V]
        if self._sync_verify and not self.sync_timing:
            torch.cuda.synchronize(self.runner.device)
        self.report.seconds["verify"] = self._clock() - forward_start - hidden_work
        self.report.forward_tokens = sum(batch.attention.q_lens)
        accept_start = self._clock()
        rows = [0]  # first row of each sequence among the batch's new tokens
        for q_len in batch.attention.q_lens:
            rows.append(rows[-1] + q_len)
        # the target's own token at every row of every request that accepts by it (greedy, or keyed sampling),
        # from one sampling kernel over the batch and one transfer, not one per request; requests with
        # penalties or coins use their own rows below
        targets = self._target_rows(logits, batch.cu_logits, prefills, verifies)
        events = []
        for i, chunk in enumerate(prefills):
            request = chunk.request
            samples = chunk.samples
            self.runner.kv_cache.set_length(request.table, chunk.end)
            request.num_prefilled = chunk.end
            hidden = None
            if self.needs_hidden and request.speculate and not request.output_ids:
                hidden = self._pair_prompt_states(request, chunk, features[rows[i] : rows[i + 1]])
            if samples:
                row = batch.cu_logits[i]
                self.report.prompt_tokens += len(request.prompt_ids)
                row_logits = logits[row : row + 1]
                if targets is not None and not request.params.has_penalties:
                    token = targets[row]
                else:
                    token = sample(apply_penalties(row_logits, request.params, request.prompt_ids, []), [request.params],
                                   [0]).item()
                events.append(self._emit(request, [token], hidden, token_logprobs(row_logits, [token], request.params)))
        commit_seconds, move_src, move_dst, lengths, accepted = 0.0, [], [], [], []
        for i, v in enumerate(verifies, start=len(prefills)):
            first, end = batch.cu_logits[i], batch.cu_logits[i] + v.tree.num_nodes  # a padded tree's own rows
            node_logits = logits[first:end]
            acceptance = self._accept(v, node_logits, targets[first:end] if targets is not None else None)
            commit_start = time.perf_counter()  # host work only: no device sync per request, even when timing
            self._kv_moves(v, acceptance, move_src, move_dst)
            lengths.append((v.request.table, v.seq_len + len(acceptance.path)))
            commit_seconds += time.perf_counter() - commit_start
            self._count(v, acceptance)
            accepted.append((v, acceptance, node_logits, rows[i]))
        # the accepted paths' states pair with the emitted tokens: every request's rows in one gather, each
        # request keeping a slice of that step-sized copy (not of the whole forward's states)
        states = {}
        picks = [(v.request.request_id, [row + node for node in acceptance.path]) for v, acceptance, _, row in accepted
                 if self.needs_hidden and v.request.speculate]
        if picks:
            flat = [r for _, request_rows in picks for r in request_rows]
            gathered = features.index_select(0, torch.tensor(flat, device=features.device))
            start = 0
            for request_id, request_rows in picks:
                states[request_id] = gathered[start : start + len(request_rows)]
                start += len(request_rows)
        for v, acceptance, node_logits, _ in accepted:
            logprobs = (token_logprobs(node_logits[list(acceptance.path)], acceptance.tokens, v.request.params)
                        if v.request.params.logprobs is not None else None)
            events.append(self._emit(v.request, acceptance.tokens, states.get(v.request.request_id), logprobs))
        commit_start = self._clock()
        kv = self.runner.kv_cache
        if move_src:  # every request's compaction in one kernel, before any page is freed
            kv.copy_slots(move_src, move_dst)
        for table, length in lengths:
            kv.set_length(table, length)
        commit_seconds += self._clock() - commit_start
        self.report.seconds["accept"] = self._clock() - accept_start - commit_seconds
        self.report.seconds["commit"] = commit_seconds
        return events

    def _pad_size(self, verifies: list[_Verify]) -> int:
        """The node count every tree of a decode-only batch is padded to, 0 for none: trees of different sizes
        (NGRAM's fill what its trie knows; a request without a tree this step verifies its root alone) run as
        one replay of the captured verification graph of the smallest size that holds them, not eagerly.
        Filler nodes are children of the root in slots the request's pages already hold (its reservation
        covers its tree budget); only where every request's pages hold the padded tree."""
        if not verifies:
            return 0
        sizes = [v.tree.num_nodes for v in verifies]
        largest = max(sizes)
        if largest == 1 or (min(sizes) == largest and largest in self.runner.tree_pad_sizes + (
                tuple(self.runner.graphs.tree_sizes) if self.runner.graphs is not None else ())):
            return 0  # plain decode, or already graph-shaped
        q = self.runner.padded_tree_size(len(verifies), largest)
        page = self.runner.kv_cache.page_size
        if q is None or any(len(v.request.table.pages) * page < v.seq_len + q for v in verifies):
            return 0
        return q

    def _by_target(self, params: SamplingParams) -> bool:
        """Verified by the target's own token at each node of its unmodified logits: its argmax, or its keyed
        sample (lossless); not with penalties (each node's logits differ) or coins."""
        return not params.has_penalties and (params.is_greedy or self.spec.force_greedy_verify or self.spec.lossless)

    def _target_rows(self, logits: torch.Tensor | None, cu_logits: list[int], prefills: list[_Chunk],
                     verifies: list[_Verify]) -> list[int] | None:
        """The target's token at every logits row, on the host, when some request decides by it: each row
        sampled with its request's parameters at its output position (a tree node: the request's output
        length plus the node's depth), exactly as the request's own rows would be, in one `sample` over the
        batch and one transfer. Rows of requests that do not decide by it are argmaxed and never read."""
        if logits is None:
            return None
        params, output_positions, used = [_ARGMAX] * logits.shape[0], [0] * logits.shape[0], False
        for i, chunk in enumerate(prefills):
            if chunk.samples and not chunk.request.params.has_penalties:
                params[cu_logits[i]], used = chunk.request.params, True  # a fresh prompt's first token: position 0
        for i, v in enumerate(verifies, start=len(prefills)):
            request = v.request
            if not self._by_target(request.params):
                continue
            used = True
            if request.params.is_greedy or self.spec.force_greedy_verify:
                continue  # argmax rows already
            base = len(request.output_ids)
            for row, depth in zip(range(cu_logits[i], cu_logits[i + 1]), depths(v.tree.parents)):
                params[row], output_positions[row] = request.params, base + depth
        return sample(logits, params, output_positions).tolist() if used else None

    def _accept(self, v: _Verify, node_logits: torch.Tensor, targets: list[int] | None = None) -> Acceptance:
        """targets: the target's token at each of node_logits' rows, already on the host (_target_rows)."""
        request, tree = v.request, v.tree
        next_token, next_sibling = child_links(tree.parents)
        if targets is not None and self._by_target(request.params):
            return accept_target_tokens(list(tree.tokens), next_token, next_sibling, targets)
        node_depths = depths(tree.parents)
        output_positions = [len(request.output_ids) + d for d in node_depths]
        params = request.params
        if params.has_penalties:  # each node with the drafts on its own path counted (lossless, see penalties)
            node_logits = apply_penalties(node_logits, params, request.prompt_ids, request.output_ids,
                                          path_tokens(list(tree.parents), list(tree.tokens)))
        if params.is_greedy or self.spec.force_greedy_verify or self.spec.lossless:
            greedy = params.is_greedy or self.spec.force_greedy_verify
            target = node_logits.argmax(-1) if greedy else sample(node_logits, [params] * tree.num_nodes, output_positions)
            return accept_target_tokens(list(tree.tokens), next_token, next_sibling, target.tolist())
        probs = process_logits(node_logits, torch.full((tree.num_nodes,), params.temperature, device=node_logits.device),
                               torch.full((tree.num_nodes,), params.top_k, device=node_logits.device),
                               torch.full((tree.num_nodes,), params.top_p, device=node_logits.device)).softmax(-1)
        coins = keyed_uniform(params.seed, output_positions)  # one walk uses one node, so one coin, per depth
        final_coins = keyed_uniform(params.seed, output_positions, salt=FINAL_COIN_SALT)
        # the walk and the bonus draw in one kernel on a GPU (the host reference: acceptance.accept_with_coins)
        device = node_logits.device
        links = torch.tensor([list(tree.tokens), next_token, next_sibling], dtype=torch.long, device=device)
        coin_rows = torch.tensor([coins, final_coins], dtype=torch.float32, device=device)
        index, length, bonus = kernels.accept_tree_coins(
            links[0:1], links[1:2], links[2:3], probs[None], coin_rows[0:1], coin_rows[1:2],
            self.spec.accept_threshold_single, self.spec.accept_threshold_acc, max(node_depths))
        walk = torch.cat([index[0], length, bonus]).tolist()  # one transfer
        path = walk[: walk[-2] + 1]
        return Acceptance(path, [tree.tokens[i] for i in path[1:]] + [walk[-1]])

    # commit --------------------------------------------------------------------------------------
    def _kv_moves(self, v: _Verify, acceptance: Acceptance, src: list[int], dst: list[int]) -> None:
        """The flat slot moves that compact the accepted path's KV to the front of the tree's slots (path
        nodes increase, so moving them down in order never overwrites a later source)."""
        pages, size = v.request.table.pages, self.runner.kv_cache.page_size
        for j, node in enumerate(acceptance.path):
            if node != j:
                a, b = v.seq_len + node, v.seq_len + j
                src.append(pages[a // size] * size + a % size)
                dst.append(pages[b // size] * size + b % size)

    def _count(self, v: _Verify, acceptance: Acceptance) -> None:
        if v.tree.num_drafts == 0:
            return
        for stats in (v.request.stats, self.report):
            stats.draft_tokens += v.tree.num_drafts
            stats.accepted_tokens += acceptance.num_accepted
            while len(stats.accepted_per_position) < acceptance.num_accepted:
                stats.accepted_per_position.append(0)
            for d in range(acceptance.num_accepted):
                stats.accepted_per_position[d] += 1
        v.request.stats.verify_steps += 1
        self.report.accept_lengths.append(acceptance.num_accepted + 1)
        if self.adaptive is not None:
            self.report.tree_depths.append(max(depths(v.tree.parents)))
        self.drafter.accepted(v.request.request_id, v.tree.num_drafts, acceptance.num_accepted)

    def _pair_prompt_states(self, request: Request, chunk: _Chunk, hidden: torch.Tensor) -> torch.Tensor | None:
        """Record (prompt token p+1, hidden state p) for the chunk's positions not recorded before; the
        state of the prompt's last position is returned, to pair with the first output token."""
        start = max(chunk.start, request.hidden_upto)
        last = request.fill_len - 1
        inner_end = min(chunk.end, last)
        if start < inner_end:
            request.unsent.extend(request.prompt_ids[start + 1 : inner_end + 1])
            request.unsent_hidden.append(hidden[start - chunk.start : inner_end - chunk.start].clone())
        request.hidden_upto = max(request.hidden_upto, chunk.end)
        return hidden[last - chunk.start :][:1].clone() if chunk.end == request.fill_len else None  # not a view of the step

    def _emit(self, request: Request, tokens: list[int], hidden: torch.Tensor | None = None,
              logprobs: list[TokenLogprob] | None = None) -> StepEvent:
        """Append tokens until a stop condition; what follows a stop is dropped. hidden: one state per
        token (a hidden-state drafter's pairing; a copy of its own, not a view of the whole step's states),
        kept for the emitted ones."""
        emitted = []
        for token in tokens:
            request.output_ids.append(token)
            emitted.append(token)
            if token in request.params.stop_token_ids or (not request.params.ignore_eos and token in self.eos_ids):
                request.finish_reason = "stop"
            elif len(request.output_ids) >= request.params.max_new_tokens:
                request.finish_reason = "length"
            if request.finish_reason:
                break
        if request.speculate and request.finish_reason is None:  # a finished request is never asked again
            request.unsent.extend(emitted)
            if self.needs_hidden:
                request.unsent_hidden.append(hidden[: len(emitted)])
        if logprobs is not None:
            logprobs = logprobs[: len(emitted)]
            request.logprobs.extend(logprobs)
        return StepEvent(request.request_id, emitted, request.finish_reason, logprobs=logprobs)

    def _retire(self) -> None:
        for request in self.running:
            if request.finish_reason is not None:
                request.unsent_hidden = []  # never sent now; do not hold device memory
                self._cache_and_release(request)
                if request.speculate:
                    self.drafter.release(request.request_id)
        self.running = [r for r in self.running if r.finish_reason is None]

    def _cache_and_release(self, request: Request) -> None:
        if self.prefix_cache is not None and request.finish_reason != "error":
            # KV slot i holds token i of prompt + output (the last output token is not in it)
            sequence = (request.prompt_ids + request.output_ids)[: request.table.num_tokens]
            self.prefix_cache.insert(sequence, request.table.pages)
        self.runner.kv_cache.release(request.table)

    def run(self, prompts: list[list[int]], params: list[SamplingParams], speculate: bool = True) -> list[Request]:
        """Offline: all prompts to completion."""
        requests = [self.add_request(p, sp, speculate) for p, sp in zip(prompts, params)]
        while self.has_work:
            self.step()
        return requests
