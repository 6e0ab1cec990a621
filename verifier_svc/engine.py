"""The one step loop (ARCHITECTURE.md §2): schedule -> draft -> verify -> accept -> commit.

Every running request decodes by verifying a tree rooted at its last token (the one the target has
not seen yet): a drafter's tree, or the root alone when there is no draft, which is plain decoding.
All prefills and trees of a step go through one target forward.

KV of a verified tree, for a request with L committed tokens (the tree's nodes were written at
logical slots L .. L+N-1 in node order):

    before commit   [ committed 0..L-1 | n0 n1 n2 n3 n4 ]      accepted path n0 -> n2 -> n4
    after commit    [ committed 0..L-1 | n0 n2 n4 ]             slots of n2, n4 copied down, rest freed

The bonus token is the next root and is not in the cache.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from splitspec.runtime.batch import SequenceInput
from splitspec.runtime.kv_cache import BlockTable
from splitspec.runtime.runner import ModelRunner
from splitspec.runtime.sampling import FINAL_COIN_SALT, keyed_uniform, process_logits, sample
from splitspec.runtime.sampling_params import SamplingParams
from splitspec.runtime.tree import DraftTree, child_links, depths, positions, tree_mask
from splitspec.verifier_svc.acceptance import Acceptance, accept_target_tokens, accept_with_coins
from splitspec.verifier_svc.drafter_client import DraftAsk, DrafterClient

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SpecConfig:
    num_draft_tokens: int = 8  # tree budget per request, root included (--speculative-num-draft-tokens)
    accept_threshold_single: float = 1.0  # below 1.0: SGLang's lossy coin rule for sampled requests
    accept_threshold_acc: float = 1.0
    force_greedy_verify: bool = False  # SGLANG_NGRAM_FORCE_GREEDY_VERIFY: accept by argmax even when sampling

    @property
    def lossless(self) -> bool:
        return self.accept_threshold_single >= 1.0 and self.accept_threshold_acc >= 1.0


@dataclass(frozen=True)
class SchedulerConfig:
    """SGLang's scheduling flags."""

    max_running_requests: int = 0  # 0 = no limit (--max-running-requests)
    chunked_prefill_size: int = 0  # prompt tokens prefilled per step in all; 0 or less = whole prompts


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


@dataclass
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
    num_prefilled: int = 0  # prompt tokens already in the KV cache (chunked prefill)
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache

    @property
    def prefilled(self) -> bool:
        return bool(self.output_ids)


@dataclass
class _Chunk:
    request: Request
    start: int
    end: int

    @property
    def last(self) -> bool:
        return self.end == len(self.request.prompt_ids)


@dataclass
class StepReport:
    """What one step did, for metrics: phase times and speculation counts."""

    seconds: dict[str, float] = field(default_factory=dict)  # schedule, draft, verify, accept_commit
    prefill_tokens: int = 0
    generated_tokens: int = 0
    accept_lengths: list[int] = field(default_factory=list)  # per verify with drafts: accepted + 1
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    fallbacks: int = 0
    finished: list[str] = field(default_factory=list)  # finish reasons of requests that ended
    cached_tokens: int = 0  # prompt tokens served from the prefix cache to requests admitted this step


@dataclass
class StepEvent:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None
    error: str = ""  # with finish_reason "error": what went wrong


@dataclass
class _Verify:
    request: Request
    tree: DraftTree
    seq_len: int  # committed KV length before the step


class Engine:
    def __init__(self, runner: ModelRunner, drafter: DrafterClient | None, spec: SpecConfig, eos_ids: set[int],
                 scheduler: SchedulerConfig | None = None, prefix_cache=None):
        self.runner, self.drafter, self.spec, self.eos_ids = runner, drafter, spec, eos_ids
        self.scheduler = scheduler or SchedulerConfig()
        self.prefix_cache = prefix_cache
        if prefix_cache is not None:
            runner.kv_cache.evictor = prefix_cache.evict
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._ids = itertools.count()
        self.report = StepReport()  # the last step's

    def add_request(self, prompt_ids: list[int], params: SamplingParams, speculate: bool = True) -> Request:
        request = Request(f"r{next(self._ids)}", list(prompt_ids), params.with_seed(), speculate and self.drafter is not None)
        self.waiting.append(request)
        return request

    def abort(self, request: Request) -> bool:
        """Stop a request between steps; its pages and drafter state are released. False if it had ended."""
        if request.finish_reason is not None:
            return False
        request.finish_reason = "abort"
        if request in self.waiting:
            self.waiting.remove(request)
        else:
            self._retire()
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[StepEvent]:
        self.report = StepReport()
        start = time.perf_counter()
        self._admit()
        prefills = self._prefill_chunks()
        scheduled = time.perf_counter()
        trees = self._draft()
        drafted = time.perf_counter()
        verifies = [_Verify(r, trees.get(r.request_id) or DraftTree((r.output_ids[-1],), (-1,)), r.table.num_tokens)
                    for r in self.running if r.prefilled]
        events = self._forward_and_accept(prefills, verifies)
        self._retire()
        self.report.seconds.update(schedule=scheduled - start, draft=drafted - scheduled)
        self.report.prefill_tokens = sum(c.end - c.start for c in prefills)
        self.report.generated_tokens = sum(len(e.new_token_ids) for e in events)
        self.report.finished = [e.finish_reason for e in events if e.finish_reason]
        return events

    # schedule ------------------------------------------------------------------------------------
    def _admit(self) -> None:
        """Waiting requests join, in arrival order, up to --max-running-requests."""
        limit = self.scheduler.max_running_requests
        while self.waiting and (limit <= 0 or len(self.running) < limit):
            request = self.waiting.pop(0)
            if request.params.max_new_tokens == 0:
                request.finish_reason = "length"
                continue
            if request.speculate:
                self.drafter.open(request.request_id, request.prompt_ids)
            self._reuse_prefix(request)
            self.running.append(request)

    def _reuse_prefix(self, request: Request) -> None:
        """Start the request's KV with the cached pages of its prompt's longest cached prefix (at least
        the last prompt token is always computed: its logits give the first output token)."""
        if self.prefix_cache is None:
            return
        pages = self.prefix_cache.match(request.prompt_ids[:-1])
        if pages:
            self.runner.kv_cache.allocator.incref(pages)
            request.table.pages = list(pages)
            request.table.num_tokens = request.num_prefilled = request.cached_tokens = len(pages) * self.runner.kv_cache.page_size
            self.report.cached_tokens += request.cached_tokens

    def _prefill_chunks(self) -> list[_Chunk]:
        """This step's prompt chunks, oldest request first, within --chunked-prefill-size tokens."""
        budget = self.scheduler.chunked_prefill_size if self.scheduler.chunked_prefill_size > 0 else None
        chunks = []
        for request in self.running:
            remaining = len(request.prompt_ids) - request.num_prefilled
            if request.prefilled or remaining == 0:
                continue
            size = remaining if budget is None else min(remaining, budget)
            if size <= 0:
                break
            chunks.append(_Chunk(request, request.num_prefilled, request.num_prefilled + size))
            if budget is not None:
                budget -= size
        return chunks

    # draft ---------------------------------------------------------------------------------------
    def _draft(self) -> dict[str, DraftTree | None]:
        asks = [DraftAsk(r.request_id, r.unsent, self.spec.num_draft_tokens) for r in self.running
                if r.speculate and r.prefilled]
        if not asks:
            return {}
        trees = self.drafter.propose(asks)
        for request in self.running:
            if request.request_id in trees:
                request.unsent = []
                tree = trees[request.request_id]
                if tree is not None and not self._usable(request, tree):
                    trees[request.request_id] = None
                    request.stats.fallbacks += 1
                    self.report.fallbacks += 1
        return trees

    def _usable(self, request: Request, tree: DraftTree) -> bool:
        vocab = self.runner.config.vocab_size
        # the budget is the same for every request; tokens past a request's limit are dropped at emit
        return (tree.tokens[0] == request.output_ids[-1] and tree.num_nodes <= self.spec.num_draft_tokens
                and all(0 <= t < vocab for t in tree.tokens))

    # verify + accept -----------------------------------------------------------------------------
    def _forward_and_accept(self, prefills: list[_Chunk], verifies: list[_Verify]) -> list[StepEvent]:
        sequences = [SequenceInput(c.request.table, c.request.prompt_ids[c.start : c.end], logits="last" if c.last else "none")
                     for c in prefills]
        for v in verifies:
            parents = list(v.tree.parents)
            sequences.append(SequenceInput(v.request.table, list(v.tree.tokens), positions(parents, v.seq_len),
                                           tree_mask(parents) if v.tree.num_nodes > 1 else None, "all"))
        if not sequences:
            return []
        forward_start = time.perf_counter()
        batch = self.runner.batch(sequences)
        logits = self.runner.forward(batch).logits  # [rows, V]
        self.report.seconds["verify"] = time.perf_counter() - forward_start
        accept_start = time.perf_counter()
        events = []
        for i, chunk in enumerate(prefills):
            request = chunk.request
            self.runner.kv_cache.set_length(request.table, chunk.end)
            request.num_prefilled = chunk.end
            if chunk.last:
                row = batch.cu_logits[i]
                events.append(self._emit(request, [sample(logits[row : row + 1], [request.params], [0]).item()]))
        for i, v in enumerate(verifies, start=len(prefills)):
            node_logits = logits[batch.cu_logits[i] : batch.cu_logits[i + 1]]
            acceptance = self._accept(v, node_logits)
            self._commit_kv(v, acceptance)
            self._count(v, acceptance)
            events.append(self._emit(v.request, acceptance.tokens))
        self.report.seconds["accept_commit"] = time.perf_counter() - accept_start
        return events

    def _accept(self, v: _Verify, node_logits: torch.Tensor) -> Acceptance:
        request, tree = v.request, v.tree
        next_token, next_sibling = child_links(tree.parents)
        output_positions = [len(request.output_ids) + d for d in depths(tree.parents)]
        params = request.params
        if params.is_greedy or self.spec.force_greedy_verify or self.spec.lossless:
            greedy = params.is_greedy or self.spec.force_greedy_verify
            target = node_logits.argmax(-1) if greedy else sample(node_logits, [params] * tree.num_nodes, output_positions)
            return accept_target_tokens(list(tree.tokens), next_token, next_sibling, target.tolist())
        probs = process_logits(node_logits, torch.full((tree.num_nodes,), params.temperature, device=node_logits.device),
                               torch.full((tree.num_nodes,), params.top_k, device=node_logits.device),
                               torch.full((tree.num_nodes,), params.top_p, device=node_logits.device)).softmax(-1)
        coins = keyed_uniform(params.seed, output_positions)  # one walk uses one node, so one coin, per depth
        final_coins = keyed_uniform(params.seed, output_positions, salt=FINAL_COIN_SALT)
        return accept_with_coins(list(tree.tokens), next_token, next_sibling, probs, coins, final_coins,
                                 self.spec.accept_threshold_single, self.spec.accept_threshold_acc)

    # commit --------------------------------------------------------------------------------------
    def _commit_kv(self, v: _Verify, acceptance: Acceptance) -> None:
        kv, table = self.runner.kv_cache, v.request.table
        moves = [(node, j) for j, node in enumerate(acceptance.path) if node != j]
        if moves:  # path nodes are increasing, so copying down in order never overwrites a later source
            src = kv.slot_ids(table, v.seq_len, v.seq_len + v.tree.num_nodes)
            kv.copy_slots(src[[node for node, _ in moves]], src[[j for _, j in moves]])
        kv.set_length(table, v.seq_len + len(acceptance.path))

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

    def _emit(self, request: Request, tokens: list[int]) -> StepEvent:
        """Append tokens until a stop condition; what follows a stop is dropped."""
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
        if request.speculate:
            request.unsent.extend(emitted)
        return StepEvent(request.request_id, emitted, request.finish_reason)

    def _retire(self) -> None:
        for request in self.running:
            if request.finish_reason is not None:
                if self.prefix_cache is not None and request.finish_reason != "error":
                    # KV slot i holds token i of prompt + output (the last output token is not in it)
                    sequence = (request.prompt_ids + request.output_ids)[: request.table.num_tokens]
                    self.prefix_cache.insert(sequence, request.table.pages)
                self.runner.kv_cache.release(request.table)
                if request.speculate:
                    self.drafter.release(request.request_id)
        self.running = [r for r in self.running if r.finish_reason is None]

    def run(self, prompts: list[list[int]], params: list[SamplingParams], speculate: bool = True) -> list[Request]:
        """Offline: all prompts to completion."""
        requests = [self.add_request(p, sp, speculate) for p, sp in zip(prompts, params)]
        while self.has_work:
            self.step()
        return requests
