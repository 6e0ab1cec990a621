"""The engine's scheduler (verifier_svc/engine.py's schedule phase): admission, page reservations, chunked
prefill and preemption, as a part of Engine (it reads and changes the engine's queues and KV cache).

Scheduling is optimistic (SGLang's and vLLM's): a waiting request joins when the pool has room for its
prompt and one tree, not for its whole output. Each step reserves, oldest request first, the pages of
every decoding request's tree and of every prefill chunk; when the pool runs dry, the newest running
request is preempted: its KV goes to the prefix cache (or back to the pool), it returns to the front of
the waiting queue with the tokens it has, and on readmission prompt + output so far is prefilled again
(from the prefix cache where its pages survived). Outputs do not change: sampling is keyed by position.
"""

from __future__ import annotations

import logging
from concurrent.futures import FIRST_COMPLETED, wait

from splitspec.runtime.kv_cache import OutOfPagesError
from splitspec.verifier_svc.step_types import Chunk, Request, StepEvent

logger = logging.getLogger("splitspec.verifier_svc.engine")
LPM_MAX_WAITING = 128  # --schedule-policy lpm sorts at most this many waiting requests (SGLang's bound); more: arrival


class Scheduling:
    """Engine's schedule phase; the attributes it uses are Engine's (runner, scheduler, prefix_cache, waiting,
    running, report, drafter, needs_hidden, budget, _events)."""

    def _tree_tokens(self, request: Request) -> int:
        """KV slots a decoding request's next verify may write: its tree budget, or the root alone."""
        if not request.speculate:
            return 1
        return request.draft_budget or self.budget

    def _schedule(self) -> list[Chunk]:
        """Admit, then reserve this step's pages oldest request first, preempting the newest when the
        pool runs dry. Prompt chunks share the step's token budget (--chunked-prefill-size); whether the
        decoding requests' trees go in the same step is _mixes'."""
        self._admit()
        limit = self.scheduler.chunked_prefill_size
        self.mixed, trees = self._mixes(limit)
        budget = None if limit <= 0 else limit - trees
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
                chunks.append(Chunk(request, request.num_prefilled, request.num_prefilled + size))
                if budget is not None:
                    budget -= size
        return chunks

    def _mixes(self, limit: int) -> tuple[bool, int]:
        """Whether this step's prompt chunks go beside the decoding requests' trees, and the tokens those take of the
        step's budget then (0 otherwise; a step with no prompt is neither: nothing counted). Always with --enable-mixed-chunk;
        with a backlog of prompt tokens over the step's budget (a long prompt: the decodes never wait more than one
        step for it); and by default when the decoding requests outnumber the arriving ones, verify no drafts this step
        (drafting off, or none asked) and the budget leaves the prompts room: a request joining a running batch (a
        finished one's successor; in a speculating batch requests end at different steps, so they arrive one by one)
        would otherwise pause every other for a step of its own. Not a wave of arrivals into a small batch (it prefills
        alone and joins one decoding batch, SGLang's default, --disable-mixed-chunk), nor beside trees, whose rows a
        mixed step runs outside the captured graphs (served on an H200, the demo pair at batch 16, medians an arrival of
        its prompt step and the next: NGRAM beside trees 10.2 ms mixed against 7.5 prefilled alone; the EAGLE-3 chain
        with drafting off 5.4 against 8.0-10.8; docs/performance.md). Nor where the prompts alone replay a captured prompt
        graph (--prompt-cuda-graph-max-tokens): that step costs less than a mixed one's eager attention (on an H100, one
        128-token arrival into 15 requests with drafting off, for the same tokens: 3.05-3.10 ms alone, 3.69-4.02 mixed)."""
        prefilling = [r for r in self.running if not r.decoding and r.fill_len > r.num_prefilled]
        if not prefilling:  # a decode-only step, the usual one: nothing to weigh
            return False, 0
        decoding = [r for r in self.running if r.decoding]
        trees = sum(self._tree_tokens(r) for r in decoding)
        backlogs = [r.fill_len - r.num_prefilled for r in prefilling]
        pending = sum(backlogs)
        mixed = self.scheduler.mixed_chunk == "always" or 0 < limit < pending or (
            self.scheduler.mixed_chunk == "auto" and len(decoding) > len(prefilling) and trees == len(decoding)
            and (limit <= 0 or trees < limit) and self.runner.prompt_graph_size(len(prefilling), max(backlogs)) is None)
        return mixed, trees if mixed else 0

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
                                        f"and the cache has {self.runner.request_pages} for requests (--max-total-tokens)")
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
        if not self.waiting or 0 < limit <= len(self.running):
            return
        kv = self.runner.kv_cache
        available = kv.allocator.num_free - sum(kv.pages_for(r.table.num_tokens + self._tree_tokens(r)) - len(r.table.pages)
                                                for r in self.running if r.decoding)
        evictable = False  # the prefix cache's evictable pages: counted once, when free pages do not do (a walk)
        order = iter(self._admission_order())  # each waiting request looked at once a call
        while self.waiting and (limit <= 0 or len(self.running) < limit):
            # in --schedule-policy's order, but past a request whose grammar is still compiling; max_new_tokens 0 comes
            # with prompt_logprobs (SamplingParams): it prefills
            request = next((r for r in order if self._ready(r)), None)
            if request is None:
                if not self.running:  # only compiles to wait for: not in a busy loop of empty steps
                    wait([r.grammar for r in self.waiting if r.grammar is not None], timeout=0.005,
                         return_when=FIRST_COMPLETED)
                break
            cached = self._match_prefix(request)
            needed = kv.pages_for(request.fill_len + self._tree_tokens(request)) - len(cached)
            if self.running and needed > available and not evictable and self.prefix_cache is not None:
                available += self.prefix_cache.num_evictable
                evictable = True
            if self.running and needed > available:
                break
            self.waiting.remove(request)
            available -= needed
            if evictable:  # counted in: the cached pages it now holds are no longer evictable
                available -= sum(1 for page in cached if kv.allocator.refcount(page) == 1)
            if request.speculate and not request.num_preemptions:  # a hidden-state drafter gets the rest paired, later
                self.drafter.open(request.request_id, request.prompt_ids[:1] if self.needs_hidden else request.prompt_ids,
                                  request.params.grammar, len(request.prompt_ids))
            if cached:
                kv.allocator.incref(cached)
                request.table.pages = list(cached)
                request.table.num_tokens = request.num_prefilled = len(cached) * kv.page_size
                self.report.cached_tokens += request.num_prefilled
                if not request.num_preemptions:
                    request.cached_tokens = request.num_prefilled
            self.running.append(request)

    def _admission_order(self) -> list[Request]:
        """The waiting requests in the order --schedule-policy admits them, those sent back by preemption first (in
        their order). lpm sorts by the prefix cache's match (stable: arrival order among equals), and only up to
        LPM_MAX_WAITING requests (a walk of the cache each), as SGLang does."""
        waiting, policy = list(self.waiting), self.scheduler.schedule_policy
        if policy == "fcfs" or len(waiting) < 2 or (policy == "lpm" and (self.prefix_cache is None
                                                                         or len(waiting) > LPM_MAX_WAITING)):
            return waiting
        back, fresh = [r for r in waiting if r.num_preemptions], [r for r in waiting if not r.num_preemptions]
        if policy == "lpm":
            fresh.sort(key=lambda r: -len(self._match_prefix(r)))
        else:  # lof
            fresh.sort(key=lambda r: -r.params.max_new_tokens)
        return back + fresh

    def _ready(self, request: Request) -> bool:
        """A request's grammar (if any) is compiled: its matcher made. One whose grammar failed ends here."""
        if request.grammar is None:
            return True
        if not request.grammar.done():
            return False
        future, request.grammar = request.grammar, None
        if future.exception() is not None:
            self.waiting.remove(request)
            request.finish_reason = "error"
            self._events.append(StepEvent(request.request_id, [], "error", f"INVALID_ARGUMENT: {future.exception()}"))
            return False
        request.matcher = self.grammars.matcher(future.result())
        return True

    def _match_prefix(self, request: Request) -> list[int]:
        """Cached pages of the longest cached prefix of what the request must prefill. A fresh prompt's
        last token is always computed: its logits give the first output token."""
        if self.prefix_cache is None:
            return []
        if (self.needs_hidden and request.speculate and not request.output_ids) or request.wants_prompt_logprobs:
            return []  # the drafter needs the prompt's hidden states, or the caller its logprobs: recompute
        fill = request.fill_ids
        return self.prefix_cache.match(fill if request.output_ids else fill[:-1])
