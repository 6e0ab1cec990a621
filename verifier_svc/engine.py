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
from collections.abc import Callable

import torch

from splitspec.device_profile import phase as device_phase
from splitspec.drafter_svc.base import FEED_EVERY
from splitspec.runtime.batch import ForwardBatch, SequenceInput, device_tensor
from splitspec.runtime.inference import inference
from splitspec.runtime.launched_draft import PendingChain, write_chains
from splitspec.runtime.penalties import apply_penalties
from splitspec.runtime.runner import ModelRunner
from splitspec.runtime.sampling import sample
from splitspec.runtime.sampling_params import SamplingParams
from splitspec.runtime.tree import DraftTree, depths, positions, tree_mask
from splitspec.verifier_svc.acceptance import Acceptance
from splitspec.verifier_svc.adaptive import adaptive_policy
from splitspec.verifier_svc.adaptive_estimates import StepShape
from splitspec.verifier_svc.catch_up_ahead import CatchUpAhead
from splitspec.verifier_svc.device_fed import DeviceFedSteps, FedFlight
from splitspec.verifier_svc.draft_features import RunStates, pair_prompt_states, path_states, unsent_states
from splitspec.verifier_svc.drafter_client import DRAFT_FAULT, DraftAsk, DrafterClient
from splitspec.verifier_svc.grammar_masks import GrammarMasks, draft_guide, no_grammars
from splitspec.verifier_svc.overlap import InFlight, OverlapSchedule
from splitspec.verifier_svc.policy_link import PolicyLink, QuietRun
from splitspec.verifier_svc.scheduling import Scheduling
from splitspec.verifier_svc.step_types import (Chunk, Request, SchedulerConfig, SpecConfig, StepEvent,
                                               StepReport)
from splitspec.verifier_svc.verification import (Verify, accept_tree, accepted_logprobs, by_target, kv_moves, pad_size,
                                                 penalized_targets, prompt_logprobs, target_rows, token_logprobs, usable)

logger = logging.getLogger(__name__)


class Engine(Scheduling, OverlapSchedule, DeviceFedSteps, PolicyLink):
    def __init__(self, runner: ModelRunner, drafter: DrafterClient | None, spec: SpecConfig, eos_ids: set[int],
                 scheduler: SchedulerConfig | None = None, prefix_cache=None, sync_timing: bool = False,
                 grammars=None, overlap_schedule: bool = False):
        """sync_timing: on a GPU, wait for the device at each phase boundary, so that the step's phase
        times (report.seconds) are the device's too, not only the host's launches (`splitspec bench`).
        grammars: a runtime.grammar.Compiler for structured outputs (None: requests with a grammar fail).
        overlap_schedule: a plain decoding step is launched before the last one's tokens reach the host (overlap.py;
        not with sync_timing, which waits for the device at every phase)."""
        self.grammars = grammars
        self.sync_timing = sync_timing and runner.device.type == "cuda"
        self.overlap_schedule = overlap_schedule and not self.sync_timing
        self.in_flight: InFlight | None = None  # a launched plain step whose tokens have not landed (overlap.py)
        self.fed: FedFlight | None = None  # a drafted step whose acceptance has not landed (device_fed.py)
        self.device_fed = self.overlap_schedule and self.fed_enabled()
        self.run_states, self.quiet = RunStates(), QuietRun()  # a drafting-off run's states, its held-back choices
        self.unsent_max: int | None = None  # in such a run, the most unsent tokens of a request (None: not counted)
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
        self.mixed = False  # this step verifies trees beside its prompt chunks (scheduling._schedule decides)
        # EAGLE-style drafters get, with every token after the first, the target's state(s) of the position
        # before it (REFERENCES §1.4: token t[p+1] pairs with h[p]): the final normed state, or the inputs
        # of the layers the runner captures (EAGLE-3, concatenated)
        self.needs_hidden = drafter is not None and drafter.needs_hidden_states
        self.adaptive = adaptive_policy(spec) if drafter is not None else None
        self.budget = spec.num_draft_tokens  # the tree budget of the asks being made (adaptive: chosen per step)
        # the policy needs the forward's own time: on a GPU, wait for it (the accept phase that follows waits anyway)
        self._sync_verify = self.adaptive is not None and runner.device.type == "cuda"
        self._unobserved: tuple[StepShape | None, float, float] | None = None  # the last step: (shape, start, seconds)
        # called once per step with a forward, right after the forward is queued and before its results are
        # read: on a GPU the caller's host work for the last step (its metrics and streams) runs under the
        # device's (the serving loop's overlap; EngineWorker)
        self.while_forward: Callable[[], None] | None = None

    def add_request(self, prompt_ids: list[int], params: SamplingParams, speculate: bool = True) -> Request:
        number = next(self._ids)
        request = Request(f"r{number}", list(prompt_ids), params.with_seed().with_min_tokens_ban(self.eos_ids),
                          speculate and self.drafter is not None, arrival=number)
        if params.grammar is not None:  # compiled off this thread; admitted once it is (scheduling._ready)
            request.grammar = self.grammars.compile(params.grammar) if self.grammars is not None else no_grammars()
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
            self._unobserved, self.quiet = None, QuietRun()

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.in_flight or self.fed)

    def _clock(self) -> float:
        if self.sync_timing:
            torch.cuda.synchronize(self.runner.device)
        return time.perf_counter()

    # nothing here trains: the kernels the step calls itself (sampling, acceptance) run as kernels, and the forwards and
    # drafts it calls find inference mode on (runtime.inference: no enter and exit of their own)
    @inference
    def step(self) -> list[StepEvent]:
        """schedule -> draft (collect the trees asked for) -> verify, accept and commit (one forward) -> ask
        (the next trees, as soon as acceptance is known); each phase timed into the step's report. A step
        with prompt chunks verifies the decoding requests' trees beside them when scheduling._mixes says so (a
        request joining a running batch); else it prefills alone and the asked trees wait for the next step (a
        wave of arrivals is prefilled before the batch decodes again, as SGLang does)."""
        self.report = StepReport(budget=self.budget)
        start = self._clock()
        self._observe_last(start)
        events = []
        if self.in_flight is not None:  # the overlap schedule: the next plain step launched before this one lands
            events, launched = self._step_in_flight()
            if launched:  # the same batch again: nothing to schedule or draft; observed as a whole cycle (_observe)
                return self._close(events, [], self.in_flight.verifies, start)
        if self.fed is not None:  # a drafted step's acceptance still on the device: the next launched, then it lands
            return self._step_fed(start)
        prefills = self._timed("schedule", self._schedule)
        decode = not prefills or self.mixed  # else the decoding requests wait a step
        trees = self._timed("draft", self._draft) if decode else {}
        verifies = [Verify(r, trees.get(r.request_id) or DraftTree.root(r.output_ids[-1]), r.table.num_tokens)
                    for r in self.running if r.decoding] if decode else []
        masks = GrammarMasks.build(prefills, verifies, self.runner.config.vocab_size) if self.grammars else None
        self.report.grammar_pruned = masks.pruned_nodes if masks is not None else 0
        events += self._events + self._forward_and_accept(prefills, verifies, masks)
        self._events = []
        self._retire()
        self._timed("ask", lambda: self._request_drafts(trees=not self.report.deferred))
        # a step that only launched (the first the overlap schedule leaves in flight) is no cycle: not observed
        return self._close(events, prefills, verifies, start, observe=not self.report.deferred)

    def _close(self, events: list[StepEvent], prefills: list[Chunk], verifies: list[Verify], start: float,
               observe: bool = True) -> list[StepEvent]:
        """The step's report completed (and observed by the adaptive policy); its events returned."""
        self.report.prefill_tokens = sum(c.end - c.start for c in prefills)
        self.report.generated_tokens = sum(len(e.new_token_ids) for e in events)
        self.report.decode_requests = len(verifies)
        self.report.finished = [e.finish_reason for e in events if e.finish_reason]
        if self.adaptive is not None and observe:
            self._observe(verifies, start)
        return events

    def _timed(self, phase: str, run: Callable):
        began = self._clock()
        with device_phase(f"engine.{phase}"):
            out = run()
        self.report.seconds[phase] = self._clock() - began
        return out

    # draft ---------------------------------------------------------------------------------------
    def _request_drafts(self, only_missing: bool = False, trees: bool = True, continuing: bool = False) -> None:
        """Ask the drafter for the next tree of every decoding request that speculates, with this step's budget
        (adaptive: the policy's choice; below 2, no tree: its new tokens still reach the drafter every
        FEED_EVERY tokens, so that speculation resumes without a catch-up). A hidden-state drafter also gets
        each prefill chunk's (token, state) pairs as they are computed (a budget of 0: no tree), so it catches
        up on a long prompt alongside chunked prefill, not all at once. trees False (the overlap schedule has a step
        in flight: a tree asked now would grow from a token that is no longer the last): the budget is chosen and
        feeds go, but a budget of 2 or more asks nothing; the step in flight lands first and _draft asks then.
        continuing: an overlapped run's step (the same batch, every request decoding, one token more each): with
        drafting off, nothing per request until a feed is due."""
        if not only_missing:
            was = self.adaptive is not None and self.adaptive.budget >= 2
            self.budget = self._choose_budget(continuing)
            if self.adaptive is not None and was != (self.adaptive.budget >= 2):  # not for a probe's one step
                logger.info("adaptive speculation: %s at %d decoding requests (predicted tokens/s by budget: %s)",
                            "drafting again" if self.adaptive.budget >= 2 else "drafting off", len(self.running),
                            {n: round(v) for n, v in self.adaptive.predicted.items()})
        if not trees and self.budget >= 2:  # asked by _draft once the step in flight has landed
            for request in self.running:
                if request.draft_budget < 2:
                    request.draft_budget = 0
            return
        # drafting off: when one request has FEED_EVERY tokens unsent, every request's unsent tokens go in the same
        # feed (one catch-up forward of the drafter for all, not one per request as each reaches the mark)
        if continuing and self.budget < 2:  # the most unsent grows by one a step: counted once a run, not scanned
            self.unsent_max = max((len(r.unsent) for r in self.running if r.speculate), default=0) \
                if self.unsent_max is None else self.unsent_max + 1
            if self.unsent_max < FEED_EVERY:
                return
            self.unsent_max, feed = 0, True  # every speculating request's unsent tokens go now
        else:
            feed = self.budget < 2 and not only_missing and any(
                len(r.unsent) >= FEED_EVERY for r in self.running if r.speculate and r.decoding)
        self.run_states.flush()  # before its requests' states are sent
        asks, states = [], []
        for request in self.running:
            if not request.speculate:
                continue
            if request.decoding and not (only_missing and request.draft_budget) and request.draft_budget < 2:
                request.draft_budget = self.budget
                if self.budget >= 2:
                    budget = self.budget
                elif feed and request.unsent:
                    budget = 0  # feed only
                else:
                    continue
            elif not request.decoding and not only_missing and self.needs_hidden and request.unsent:
                budget = 0  # feed only
            else:
                continue
            guide = (draft_guide(request, self.runner.config.vocab_size)
                     if budget and self.grammars and self.drafter.uses_guides else None)
            asks.append(DraftAsk(request.request_id, request.unsent, budget, guide=guide))
            states.append(request.unsent_hidden)
            request.unsent, request.unsent_hidden = [], []
        if asks and self.needs_hidden:  # every ask's states cut out together
            for ask, hidden in zip(asks, unsent_states(states)):
                ask.hidden = hidden
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
            if isinstance(tree, PendingChain):  # still on the device: its shape is all a verification batch needs
                if request.matcher is None and tree.num_nodes <= budget:
                    continue
                tree = trees[request_id] = tree.resolve(request.output_ids[-1], self.runner.config.vocab_size)  # a grammar reads it
            if isinstance(tree, DraftTree) and tree.num_nodes > budget:  # a bet drafted under a larger budget
                tree = trees[request_id] = tree.first(budget)
            if tree is DRAFT_FAULT or (tree is not None and not usable(tree, request, budget, self.runner.config.vocab_size)):
                trees[request_id] = None
                request.stats.fallbacks += 1
                self.report.fallbacks += 1
        return trees

    # verify + accept -----------------------------------------------------------------------------
    def _forward_and_accept(self, prefills: list[Chunk], verifies: list[Verify], masks=None) -> list[StepEvent]:
        with device_phase("engine.sequences"):
            sequences, chains = self._sequences(prefills, verifies)
        if not sequences:
            return []
        defer = self._defers(prefills, verifies, masks)  # its tokens land at the next step (overlap.py)
        ahead = None if defer else CatchUpAhead.plan(self.spec, self.drafter, prefills, verifies, chains, masks)
        with device_phase("engine.verify"):
            batch, logits, features = self._forward(sequences, sync=not defer, chains=chains, ahead=ahead)
        if ahead is not None and self._feeds(ahead, verifies):  # lands at the next step, after its successor's launch
            self.fed = FedFlight.of(verifies, batch, ahead, features)
            self.report.deferred = True
            return []
        if chains:  # drafts verified on the device before they reached the host: their tokens now
            vocab = self.runner.config.vocab_size
            for v in verifies:
                if isinstance(v.tree, PendingChain):
                    v.tree = v.tree.resolve(v.request.output_ids[-1], vocab)
        if defer:
            self.in_flight = self._launch(verifies, logits, pending=0, features=features)
            return []
        accept_start = self._clock()
        if masks is not None:  # structured outputs: what each constrained row's grammar forbids is -inf
            masks.apply(logits, batch.cu_logits)
        rows = [0]  # first row of each sequence among the batch's new tokens
        for q_len in batch.attention.q_lens:
            rows.append(rows[-1] + q_len)
        # the target's own token at every row of every request that accepts by it (greedy, or keyed sampling),
        # from one sampling kernel over the batch and one transfer, not one per request; requests with
        # penalties or coins use their own rows below
        with device_phase("engine.target_rows"):
            targets = (ahead.targets() if ahead is not None else
                       target_rows(self.spec, logits, batch.cu_logits, prefills, verifies))
        with device_phase("engine.accept"):
            events = self._first_tokens(prefills, batch.cu_logits, logits, targets, rows, features)
            events += self._accept_trees(verifies, len(prefills), batch.cu_logits, logits, targets, rows, features,
                                         ahead.caught_up if ahead is not None else frozenset())
        self.report.seconds["accept"] = self._clock() - accept_start - self.report.seconds["commit"]
        return events

    def _sequences(self, prefills: list[Chunk], verifies: list[Verify]) -> tuple[list[SequenceInput], list[tuple[int, PendingChain]]]:
        """The forward's sequences: prompt chunks, then every decoding request's tree (padded to one captured
        graph's shape where that helps: verification.pad_size); and (sequence index, chain) for each draft still on
        the device, whose sequence holds its root in every node's place until _forward writes the drafts in."""
        sequences = [SequenceInput(c.request.table, c.request.fill_ids[c.start : c.end], logits="all" if
                                   c.request.wants_prompt_logprobs else "last" if c.samples else "none") for c in prefills]
        if not verifies:  # a step that only prefills: its chunks padded to a captured prompt graph's shape, where one is
            padded = self.runner.pad_prompts(sequences)
            self.report.prompt_padding_tokens += sum(s.padding for s in padded)
            return padded, []
        pad = 0 if prefills else pad_size(self.runner, verifies)
        chains = []
        for v in verifies:
            if v.tree.num_nodes == 1 and not pad:  # plain decoding's root
                sequences.append(SequenceInput(v.request.table, [v.tree.tokens[0]], [v.seq_len], None, "all"))
                continue
            if isinstance(v.tree, PendingChain):
                chains.append((len(sequences), v.tree))
                tokens, parents = [v.request.output_ids[-1]] * v.tree.num_nodes, list(v.tree.parents)
            else:
                tokens, parents = list(v.tree.tokens), list(v.tree.parents)
            if pad > len(tokens):  # filler children of the root, never walked: their rows are not read
                self.report.padding_tokens += pad - len(tokens)
                tokens += [tokens[0]] * (pad - len(tokens))
                parents += [0] * (pad - len(parents))
            tree = tuple(parents) if len(tokens) > 1 else None
            sequences.append(SequenceInput(v.request.table, tokens, positions(parents, v.seq_len),
                                           tree_mask(tree) if tree else None, "all", tree))
        return sequences, chains

    def _forward(self, sequences: list[SequenceInput] | ForwardBatch, roots: torch.Tensor | None = None, sync: bool = True,
                 chains: list[tuple[int, PendingChain]] = (), ahead: CatchUpAhead | None = None):
        """One target forward over the step's sequences: (batch, logits [rows, V], the drafter's features).
        sequences: or their batch, built. roots: the input ids on the device, one per sequence (the overlap schedule's
        tokens not landed; with chains, each chain's root: a device-fed step's). sync: the
        adaptive policy may wait for the forward to time it (not for a step the overlap schedule leaves in flight).
        chains: (sequence index, draft on the device) whose drafts go into their sequences' rows on the device.
        ahead: the drafter's catch-up queued right behind it (catch_up_ahead.py); a wait is then for the target's
        tokens only."""
        forward_start = self._clock()
        batch = sequences if isinstance(sequences, ForwardBatch) else self.runner.batch(sequences)
        if roots is not None and not chains:  # the ids are the roots: a graph's replay copies them in once
            batch.adopt_ids(roots)
        if chains:
            starts = list(itertools.accumulate(batch.attention.q_lens, initial=0))
            if roots is not None:
                batch.input_ids.index_copy_(0, device_tensor([starts[i] for i, _ in chains], roots.device), roots)
            write_chains(batch.input_ids, [starts[i] for i, _ in chains], [c for _, c in chains],
                         self.runner.config.vocab_size)
        # a step caught up ahead reads the verification graph's own outputs (no clones): its logits within the step,
        # its states by the catch-up queued right behind it; a catch-up the drafter declines keeps a copy of them
        output = self.runner.forward(batch, return_hidden=self.needs_hidden and not self.runner.capture_layers,
                                     borrow=ahead is not None)
        features = output.aux_hidden_states if self.runner.capture_layers else output.hidden_states
        if ahead is not None:
            ahead.launch(self.spec, self.drafter, batch, output.logits, features)
            if not ahead.caught_up and features is not None:
                features = features.clone()
        # the forward is queued on the device: the drafter's deferred bookkeeping and the caller's host work run
        # under it (on a CPU device the forward has run already: they cost what they cost, after it)
        began = time.perf_counter()
        if self.drafter is not None:
            self.drafter.idle()
        if self.while_forward is not None:
            self.while_forward()
        hidden_work = time.perf_counter() - began
        if self._sync_verify and sync and not self.sync_timing:
            if ahead is not None:
                ahead.wait()
            else:
                torch.cuda.synchronize(self.runner.device)
        self.report.seconds["verify"] = self._clock() - forward_start - hidden_work
        self.report.forward_tokens = sum(batch.attention.q_lens)
        return batch, output.logits, features

    def _first_tokens(self, prefills: list[Chunk], cu_logits: list[int], logits: torch.Tensor, targets: list[int] | None,
                      rows: list[int], features) -> list[StepEvent]:
        """Prompt chunks: their KV committed; a chunk that completes a fresh prompt samples its first token."""
        events, prompt_lps = [], prompt_logprobs(prefills, cu_logits, logits)
        for i, chunk in enumerate(prefills):
            request = chunk.request
            self.runner.kv_cache.set_length(request.table, chunk.end)
            request.num_prefilled = chunk.end
            hidden = None
            if self.needs_hidden and request.speculate and not request.output_ids:
                hidden = pair_prompt_states(request, chunk, features[rows[i] : rows[i + 1]])
            request.prompt_logprobs += prompt_lps.get(i, [])
            if chunk.samples and not request.params.max_new_tokens:  # the prompt's logprobs were all it asked for
                events.append(request.prompt_only())
            elif chunk.samples:
                row = cu_logits[i + 1] - 1  # its last row (the only one, unless the prompt's logprobs were asked)
                self.report.prompt_tokens += len(request.prompt_ids)
                self.report.new_requests += 1
                row_logits = logits[row : row + 1]
                if targets is not None and not request.params.has_penalties:
                    token = targets[row]
                else:
                    token = sample(apply_penalties(row_logits, request.params, request.prompt_ids, []), [request.params],
                                   [0]).item()
                events.append(request.emit([token], self.eos_ids, hidden, token_logprobs(row_logits, [token], request.params)))
        return events

    def _accept_trees(self, verifies: list[Verify], offset: int, cu_logits: list[int], logits: torch.Tensor,
                      targets: list[int] | None, rows: list[int], features, ahead: frozenset[str],
                      keep_pages: bool = False) -> list[StepEvent]:
        """Every tree walked and its accepted tokens emitted; the accepted paths' KV compacted in one kernel
        (report.seconds["commit"]). A root alone verified by the target's own token (plain decoding) takes
        that token: no walk, no slice of the logits, no KV to move. ahead: the requests whose drafter caught up
        on their chains already (catch_up_ahead.py): their accepted tokens go to it now, without states. keep_pages: a
        device-fed step in flight writes past the lengths committed (KVCache.commit)."""
        commit_seconds, move_src, move_dst, lengths, accepted = 0.0, [], [], [], []
        page_size = self.runner.kv_cache.page_size
        penalized = penalized_targets(self.spec, logits, verifies, offset, cu_logits)  # one transfer for all of them
        for i, v in enumerate(verifies, start=offset):
            first, end = cu_logits[i], cu_logits[i] + v.tree.num_nodes  # a padded tree's own rows
            decided = targets is not None and by_target(self.spec, v.request.params)  # no logits slice then
            if end - first == 1 and decided:
                acceptance = Acceptance([0], [targets[first]])
                lengths.append((v.request.table, v.seq_len + 1))
            else:
                acceptance = (accept_tree(self.spec, v, targets=targets[first:end]) if decided
                              else accept_tree(self.spec, v, targets=penalized[i]) if i in penalized
                              else accept_tree(self.spec, v, logits[first:end]))
                commit_start = time.perf_counter()  # host work only: no device sync per request, even when timing
                kv_moves(page_size, v, acceptance, move_src, move_dst)
                lengths.append((v.request.table, v.seq_len + len(acceptance.path)))
                commit_seconds += time.perf_counter() - commit_start
                self._count(v, acceptance)
            accepted.append((v, acceptance, first, rows[i]))
        states = path_states([a for a in accepted if a[0].request.request_id not in ahead], features) \
            if self.needs_hidden else {}
        logprobs = accepted_logprobs(logits, accepted)
        events = [v.request.emit(acceptance.tokens, self.eos_ids, states.get(v.request.request_id), logprobs.get(k),
                                 told=v.request.request_id in ahead)
                  for k, (v, acceptance, _, _) in enumerate(accepted)]
        if ahead:
            self.report.caught_up_ahead = len(ahead)
            self.drafter.keep_ahead({e.request_id: e.new_token_ids for e in events
                                     if e.request_id in ahead and e.finish_reason is None})
        commit_start = self._clock()
        kv = self.runner.kv_cache
        if move_src:  # every request's compaction in one kernel, before any page is freed
            kv.copy_slots(move_src, move_dst)
        for table, length in lengths:
            (kv.commit if keep_pages else kv.set_length)(table, length)
        self.report.seconds["commit"] = commit_seconds + self._clock() - commit_start
        return events

    # commit --------------------------------------------------------------------------------------
    def _count(self, v: Verify, acceptance: Acceptance) -> None:
        drafts = v.tree.num_drafts
        if drafts == 0:
            return
        accepted = acceptance.num_accepted
        v.request.stats.add(drafts, accepted)
        self.report.add(drafts, accepted)
        self.report.accept_lengths.append(accepted + 1)
        if self.adaptive is not None:
            self.report.tree_depths.append(max(depths(v.tree.parents)))
        self.drafter.accepted(v.request.request_id, drafts, accepted)

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
