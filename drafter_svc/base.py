"""The drafter interface every algorithm implements, and the registry of algorithms.

A drafter keeps per-request state keyed by request id. The verifier tells it the tokens each
request's sequence grew by (the prompt when it opens, then each step's accepted drafts and bonus
token) and asks for trees rooted at the sequence's last token, which the target has not yet seen.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from splitspec.registry import load_entry
from splitspec.runtime.tree import DraftTree


class Drafter(ABC):
    name: str = ""
    needs_hidden_states = False  # EAGLE-style: extend() also gets the target's hidden state before each token

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


# --speculative-algorithm -> "module:Class"; model drafters join in later issues
DRAFTERS: dict[str, str] = {
    "NGRAM": "splitspec.drafter_svc.ngram:NgramDrafter",
    "STANDALONE": "splitspec.drafter_svc.standalone:StandaloneDrafter",
    "EAGLE": "splitspec.drafter_svc.eagle:EagleDrafter",
}


def drafter_class(algorithm: str) -> type[Drafter]:
    return load_entry(DRAFTERS, algorithm, "--speculative-algorithm")
