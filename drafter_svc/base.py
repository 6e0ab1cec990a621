"""The drafter interface every algorithm implements, and the registry of algorithms.

A drafter keeps per-request state keyed by request id. The verifier tells it the tokens each
request's sequence grew by (the prompt when it opens, then each step's accepted drafts and bonus
token) and asks for trees rooted at the sequence's last token, which the target has not yet seen.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from splitspec.registry import load_entry
from splitspec.runtime.launched_draft import LaunchedDraft
from splitspec.runtime.tree import DraftTree


# drafting off (the load-adaptive policy's budget below 2), the verifier still sends each speculating request's new
# tokens (and a head's states) once one request has this many unsent, every request's in the same feed, so that
# drafting resumes without a backlog to send: a drafter process's head catches the feed up as it comes, in one forward
# (rounds of this many rows a request replay a captured graph); a head in the verifier's process keeps the rows on the
# device until its next draft (or a bound on their bytes)
FEED_EVERY = 16


@dataclass(frozen=True)
class Bet:
    """Overlap: the tree a drafter would propose if the request's sequence grows by exactly `outcome`
    (the accepted drafts of the tree now being verified, then the bonus token); tree.tokens[0] is
    outcome[-1]. Drafted while the verifier verifies; a wrong bet is never used, so it costs no
    correctness, only the drafter's time."""

    outcome: tuple[int, ...]
    tree: DraftTree


def bet_order(depth: int, count: int) -> list[tuple[int, int]]:
    """The outcomes bets cover, most likely first: (accept length a, guess rank) for a = depth .. 0 with
    the best guess, then the same with the second guess; the first `count`."""
    return [(a, rank) for rank in range(2) for a in range(depth, -1, -1)][:count]


class Drafter(ABC):
    name: str = ""
    needs_hidden_states = False  # EAGLE-style: extend() also gets the target's hidden state before each token
    supports_bets = False  # draft_bets() returns bets (overlapped drafting)
    fills_budget = False  # draft() fills a larger budget from more candidates (NGRAM's trie), not a fixed tree shape
    takes_guides = False  # draft() takes a third argument: per request a grammar guide (or None) to mask candidates with
    # launch() queues device work and returns before it is done (a model drafter's draft loop): a client in the verifier's
    # process launches as soon as a step asks, so that the host's work until the next verification runs under the draft
    launches_on_device = False

    @abstractmethod
    def open(self, request_id: str, prompt_ids: list[int]) -> None:
        """Start tracking a request whose sequence so far is prompt_ids."""

    @abstractmethod
    def extend(self, request_id: str, tokens: list[int]) -> None:
        """The request's sequence grew by these tokens (accepted drafts, then the bonus token). A drafter
        with needs_hidden_states gets a third argument: [len(tokens), H] target states, row j the state
        of the position before tokens[j]."""

    @abstractmethod
    def draft(self, request_ids: list[str], max_nodes: list[int]) -> list[DraftTree | None]:
        """Trees of at most max_nodes[i] nodes rooted at each request's last token; None = no draft."""

    @abstractmethod
    def release(self, request_id: str) -> None:
        """Forget a finished request."""

    def launch(self, request_ids: list[str], max_nodes: list[int]) -> LaunchedDraft:
        """draft(), where the drafter runs in the verifier's process, as a LaunchedDraft (runtime.launched_draft):
        a drafter on the device queues its work and returns without waiting for it. Default: drafted now."""
        return LaunchedDraft.ready(self.draft(request_ids, max_nodes))

    def draft_bets(self, request_ids: list[str], num_bets: int) -> list[list[Bet]]:
        """Overlap: up to num_bets bets per request on the outcome of its current tree (the one draft()
        returned last, or the bet take_bet() named), most likely first. The drafter's state must not
        change: the real outcome still arrives through extend(). Default: no bets."""
        return [[] for _ in request_ids]

    def take_bet(self, request_id: str, index: int) -> None:
        """The verifier verifies bet `index` of the request's last draft_bets() as its next tree (its
        outcome came true and is about to arrive through extend()); the next draft_bets() bets on it."""

    def idle(self) -> None:
        """Deferred bookkeeping, called when nobody waits for this drafter (in the verifier's process: while
        the target's forward runs on the device; in a drafter process: after a reply is sent). Default: none."""


class HiddenStateDrafter(Drafter):
    """A drafter fed the target's states (EAGLE heads, MTP layers): a request opens with its first token;
    every later token comes with the state before it. Per-request state is `state_class(first_token)`,
    which takes `add(tokens, hidden)` and owns a `table` in the runner's KV cache."""

    needs_hidden_states = True
    state_class: type

    @property
    def vocab_size(self) -> int:
        return self.runner.config.vocab_size

    def open(self, request_id: str, prompt_ids: list[int]) -> None:
        self.release(request_id)
        if len(prompt_ids) != 1:
            raise ValueError(f"a {self.name} drafter opens with one token and gets the rest with hidden states, "
                             f"got {len(prompt_ids)}")
        self.states[request_id] = self.state_class(prompt_ids[0])

    def extend(self, request_id: str, tokens: list[int], hidden=None) -> None:
        if hidden is None or hidden.shape[0] != len(tokens):
            raise ValueError(f"{len(tokens)} tokens need as many hidden states, got {None if hidden is None else hidden.shape[0]}")
        self.states[request_id].add(tokens, hidden)

    def release(self, request_id: str) -> None:
        state = self.states.pop(request_id, None)
        if state is not None:
            self.runner.kv_cache.release(state.table)


# --speculative-algorithm -> "module:Class"; model drafters join in later issues
DRAFTERS: dict[str, str] = {
    "NGRAM": "splitspec.drafter_svc.ngram:NgramDrafter",
    "STANDALONE": "splitspec.drafter_svc.standalone:StandaloneDrafter",
    "EAGLE": "splitspec.drafter_svc.eagle:EagleDrafter",
}


def drafter_class(algorithm: str) -> type[Drafter]:
    return load_entry(DRAFTERS, algorithm, "--speculative-algorithm")
