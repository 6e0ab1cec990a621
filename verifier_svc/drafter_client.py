"""What the engine calls to get draft trees. The in-process client calls a drafter object directly
(splitspec generate, in-process benchmarks, tests); the ZeroMQ pool (drafter_pool) implements the same
interface. A client never raises into the engine for a drafter's fault: it returns DRAFT_FAULT for
that request (the engine decodes a plain token and counts a fallback) and counts it.

The engine asks for the next trees as soon as a step's acceptance is known (request), and picks them
up in the next step's draft phase (collect), so a remote drafter drafts while the verifier streams,
retires and schedules."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from splitspec.runtime.grammar_guide import draft_to_grammar
from splitspec.runtime.launched_draft import LaunchedDraft, PendingChain
from splitspec.runtime.tree import DraftTree

logger = logging.getLogger(__name__)


@dataclass
class DraftAsk:
    """One request's part of a draft call."""

    request_id: str
    new_tokens: list[int]  # what the sequence grew by since the last call
    max_nodes: int  # tree budget, root included
    hidden: object = None  # hidden-state drafters: [len(new_tokens), H], the target's state before each token
    # a request whose output a grammar constrains: its runtime.grammar_guide.GrammarGuide (masks a beam drafter's candidates,
    # cuts any tree to the grammar). In-process drafting only; a drafter process's trees are pruned by the verifier
    guide: object = None


class _Fault:
    def __repr__(self) -> str:
        return "DRAFT_FAULT"


DRAFT_FAULT = _Fault()  # collect(): the drafter failed this request this step (late, invalid, gone)


@dataclass
class DrafterStats:
    trees: int = 0  # trees returned
    empty: int = 0  # no draft for a request (nothing to propose)
    faults: int = 0  # draft calls that failed; the engine decoded plainly instead
    grammar_cut: int = 0  # drafted nodes a request's grammar forbade (or past its budget), cut before proposing
    extra: dict = field(default_factory=dict)


class DrafterClient(ABC):
    needs_hidden_states = False  # the engine then opens with the first prompt token and pairs every later one
    uses_guides = False  # reads DraftAsk.guide (drafting in this process); the engine makes none for other clients

    def __init__(self):
        self.stats = DrafterStats()

    @abstractmethod
    def open(self, request_id: str, prompt_ids: list[int], grammar: tuple[str, str] | None = None,
             prompt_tokens: int = 0) -> None:
        """Start tracking a request: its first tokens (the prompt, or its first token for a drafter of hidden
        states), and a constrained request's grammar and prompt length (for a drafter that follows the grammar
        itself: a drafter process; in this process the engine's own matcher guides the drafts instead)."""

    @abstractmethod
    def request(self, asks: list[DraftAsk]) -> None:
        """Start drafting these requests' next trees (returns at once)."""

    @abstractmethod
    def collect(self, request_ids: list[str]) -> dict[str, DraftTree | PendingChain | None | _Fault]:
        """The requested trees: a tree, None (nothing to propose, or not requested) or DRAFT_FAULT; in this process
        also a PendingChain (a chain still on the device: runtime.launched_draft), which the engine resolves."""

    @abstractmethod
    def release(self, request_id: str) -> None: ...

    def accepted(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """How a request's last tree fared (per-drafter accounting); optional."""

    def propose(self, asks: list[DraftAsk]) -> dict[str, DraftTree | PendingChain | None | _Fault]:
        self.request(asks)
        return self.collect([a.request_id for a in asks])

    def close(self) -> None:
        """Stop background work (the pool's I/O thread)."""

    catches_up_ahead = False  # catch_up_ahead() may queue a catch-up before acceptance (verifier_svc.catch_up_ahead)

    def launched_ahead(self, request_ids: list[str]) -> bool:
        """Whether these requests' next drafts were launched on the device with a catch-up ahead (none here)."""
        return False

    def idle(self) -> None:
        """Nobody waits for the drafter now (the target's forward runs): its deferred bookkeeping, where it
        runs in this process (Drafter.idle). Default: nothing here."""


class InProcessDrafterClient(DrafterClient):
    """Calls a drafter object in this process: request() hands it the new tokens, collect() drafts."""

    uses_guides = True

    def __init__(self, drafter):
        super().__init__()
        self.drafter = drafter
        self.needs_hidden_states = getattr(drafter, "needs_hidden_states", False)
        loop = getattr(drafter, "loop", None)
        if loop is not None:  # no bets are drafted in this process: a launch keeps no copy of its best path's outputs
            loop.keep_path_hidden = False
        self._asked: dict[str, int] = {}  # request id -> tree budget
        self._guides: dict[str, object] = {}  # request id -> its grammar's guide (DraftAsk.guide)
        self._broken: set[str] = set()
        # the draft launched at request() (Drafter.launches_on_device), not yet collected: its requests' places in it
        self._launch: LaunchedDraft | None = None
        self._launched: dict[str, int] = {}

    def open(self, request_id: str, prompt_ids: list[int], grammar: tuple[str, str] | None = None,
             prompt_tokens: int = 0) -> None:
        try:
            self.drafter.open(request_id, prompt_ids)
        except Exception:  # a drafter fault must not fail a request: it decodes unspeculated
            logger.exception("drafter %s failed to open %s; it decodes without drafts", self.drafter.name, request_id)
            self._broken.add(request_id)

    def request(self, asks: list[DraftAsk]) -> None:
        for ask in asks:
            if ask.max_nodes:  # 0: a hidden-state drafter's feed during prefill, no tree wanted
                self._asked[ask.request_id] = ask.max_nodes
                if ask.guide is not None:
                    self._guides[ask.request_id] = ask.guide
            if ask.request_id in self._broken:
                continue
            try:
                if ask.new_tokens:
                    if self.needs_hidden_states:
                        self.drafter.extend(ask.request_id, ask.new_tokens, ask.hidden)
                    else:
                        self.drafter.extend(ask.request_id, ask.new_tokens)
            except Exception:  # its history has a hole now: no more drafts for it
                logger.exception("drafter %s failed on %s; it decodes without drafts", self.drafter.name, ask.request_id)
                self._broken.add(ask.request_id)
        if getattr(self.drafter, "launches_on_device", False) and not self._launched:
            self._launch_early([a.request_id for a in asks if a.max_nodes >= 2])

    def _launch_early(self, request_ids: list[str]) -> None:
        """A drafter that queues its draft on the device launches it now, as the step that asked ends: the engine's
        hand-over of the step's tokens, its next schedule and the next verification's batch then run on the host
        while the device drafts (launched at collect(), all of that came first and the device waited). Not for
        guided requests (their drafts are masked on the host at collect) nor while an earlier launch is uncollected
        (the loop's next launch overwrites the chains that one left on the device)."""
        ids = [r for r in request_ids if r not in self._broken and r not in self._guides]
        if not ids:
            return
        try:
            self._launch = self.drafter.launch(ids, [self._asked[r] for r in ids])
        except Exception:  # collect() drafts them again, one by one where the batch fails
            logger.exception("drafter %s failed to launch a batch of %d; drafting it when collected", self.drafter.name,
                             len(ids))
            return
        self._launched = {r: i for i, r in enumerate(ids)}

    def collect(self, request_ids: list[str]) -> dict[str, DraftTree | PendingChain | None | _Fault]:
        trees: dict[str, DraftTree | PendingChain | None | _Fault] = {r: None for r in request_ids if r not in self._asked}
        faulted = [r for r in request_ids if r in self._asked and r in self._broken]
        asked = [r for r in request_ids if r in self._asked and r not in self._broken]
        trees.update({r: DRAFT_FAULT for r in faulted})
        launch, places = self._launch, self._launched
        self._launch, self._launched = None, {}
        if places:
            taken = [r for r in asked if r in places]
            asked = [r for r in asked if r not in places]
            trees.update(self._take(launch, places, taken, finish=bool(asked)))
        try:
            drafted = self._draft(asked) if asked else []
        except Exception:  # find the request(s) it fails on: the others still get their trees
            logger.exception("drafter %s failed on a batch of %d; drafting them one by one", self.drafter.name, len(asked))
            drafted = [self._draft_alone(r) for r in asked]
        trees.update(zip(asked, drafted))
        for r in request_ids:
            self._asked.pop(r, None)
            self._guides.pop(r, None)
        for tree in trees.values():
            self.stats.trees += isinstance(tree, (DraftTree, PendingChain))
            self.stats.empty += tree is None
            self.stats.faults += tree is DRAFT_FAULT
        return trees

    def _draft(self, request_ids: list[str]) -> list:
        """Their trees, a constrained request's holding only what its grammar allows (grammar_guide.draft_to_grammar:
        the drafter never proposes a token the grammar forbids). Without grammars the drafter launches its draft
        (Drafter.launch): chains still on the device come back as PendingChains (runtime.launched_draft)."""
        budgets = [self._asked[r] for r in request_ids]
        guides = [self._guides.get(r) for r in request_ids]
        launch = getattr(self.drafter, "launch", None)
        if launch is not None and not any(g is not None for g in guides):
            launched = launch(request_ids, budgets)
            return launched.pending() if launched.chain_tokens is not None else launched.trees()
        trees, cut = draft_to_grammar(self.drafter, request_ids, budgets, guides)
        self.stats.grammar_cut += cut
        return trees

    def _take(self, launch: LaunchedDraft, places: dict[str, int], request_ids: list[str], finish: bool) -> dict:
        """These requests' trees from the draft launched at request() (finish: on the host, because another launch
        follows in this collect and would overwrite chains still on the device); DRAFT_FAULT if it fails to finish."""
        try:
            got = launch.pending() if launch.chain_tokens is not None and not finish else launch.trees()
        except Exception:
            logger.exception("drafter %s failed to finish a launch of %d", self.drafter.name, len(request_ids))
            return dict.fromkeys(request_ids, DRAFT_FAULT)
        return {r: got[places[r]] for r in request_ids}

    def _draft_alone(self, request_id: str):
        try:
            return self._draft([request_id])[0]
        except Exception:
            logger.exception("drafter %s failed on %s; it decodes a plain token this step", self.drafter.name, request_id)
            return DRAFT_FAULT

    @property
    def catches_up_ahead(self) -> bool:
        return hasattr(self.drafter, "catch_up_ahead")

    def catch_up_ahead(self, request_ids: list[str], lengths: list[int], tokens, features, acceptance,
                       verified=None) -> bool:
        """The drafter's catch-up on a step's verified chains, queued before acceptance (a drafter's catch_up_ahead;
        verified: the lengths on the device, lengths their upper bounds); False where it did not (a request broken or
        guided, a drafter that declined or failed): nothing queued, and the step's tokens reach it with their states
        as always."""
        if any(r in self._broken or r in self._guides for r in request_ids):
            return False
        try:
            return self.drafter.catch_up_ahead(request_ids, lengths, tokens, features, acceptance, verified=verified)
        except Exception:
            logger.exception("drafter %s failed to catch up ahead on a batch of %d; its tokens go with their states",
                             self.drafter.name, len(request_ids))
            return False

    def launched_ahead(self, request_ids: list[str]) -> bool:
        """Whether these requests' next drafts were launched with the last catch-up ahead, none broken or guided (the
        next ask takes them as they are: a device-fed step's next verification reads them on the device)."""
        if self._launched or any(r in self._broken or r in self._guides for r in request_ids):
            return False
        check = getattr(self.drafter, "launched_ahead", None)
        return check is not None and check(request_ids)

    def keep_ahead(self, kept: dict[str, list[int]]) -> None:
        """What acceptance kept of the catch-up ahead (each request's accepted tokens). Where that fails the
        requests' histories have a hole: they decode without drafts."""
        try:
            self.drafter.keep_ahead(kept)
        except Exception:
            logger.exception("drafter %s failed to keep a catch-up ahead; %d requests decode without drafts",
                             self.drafter.name, len(kept))
            self._broken.update(kept)

    def idle(self) -> None:
        try:
            self.drafter.idle()
        except Exception:  # its trie or cache may lag; drafts stay verified, so outputs cannot change
            logger.exception("drafter %s failed in its idle work", self.drafter.name)

    def release(self, request_id: str) -> None:
        if self._launched.pop(request_id, None) is not None:  # its launch finished first: the drafter's bookkeeping
            try:  # must not outlive it
                self._launch.trees()
            except Exception:
                logger.exception("drafter %s failed to finish a launch", self.drafter.name)
        self._asked.pop(request_id, None)
        self._guides.pop(request_id, None)
        self._broken.discard(request_id)
        try:
            self.drafter.release(request_id)
        except Exception:
            logger.exception("drafter %s failed to release %s", self.drafter.name, request_id)
