"""What the engine calls to get draft trees. The in-process client calls a drafter object directly
(splitspec generate, in-process benchmarks, tests); the ZeroMQ client of the drafter service
implements the same interface. A client never raises into the engine for a drafter's fault: it
returns None for that request and counts it."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from splitspec.runtime.tree import DraftTree

logger = logging.getLogger(__name__)


@dataclass
class DraftAsk:
    """One request's part of a draft call."""

    request_id: str
    new_tokens: list[int]  # what the sequence grew by since the last call
    max_nodes: int  # tree budget, root included


@dataclass
class DrafterStats:
    trees: int = 0  # trees returned
    empty: int = 0  # no draft for a request (nothing to propose)
    faults: int = 0  # draft calls that failed; the engine decoded plainly instead
    extra: dict = field(default_factory=dict)


class DrafterClient(ABC):
    def __init__(self):
        self.stats = DrafterStats()

    @abstractmethod
    def open(self, request_id: str, prompt_ids: list[int]) -> None: ...

    @abstractmethod
    def propose(self, asks: list[DraftAsk]) -> dict[str, DraftTree | None]: ...

    @abstractmethod
    def release(self, request_id: str) -> None: ...


class InProcessDrafterClient(DrafterClient):
    def __init__(self, drafter):
        super().__init__()
        self.drafter = drafter

    def open(self, request_id: str, prompt_ids: list[int]) -> None:
        self.drafter.open(request_id, prompt_ids)

    def propose(self, asks: list[DraftAsk]) -> dict[str, DraftTree | None]:
        try:
            for ask in asks:
                if ask.new_tokens:
                    self.drafter.extend(ask.request_id, ask.new_tokens)
            trees = self.drafter.draft([a.request_id for a in asks], [a.max_nodes for a in asks])
        except Exception:  # a drafter fault must not fail a request: decode plainly this step
            logger.exception("drafter %s failed; decoding without drafts this step", self.drafter.name)
            self.stats.faults += 1
            return {a.request_id: None for a in asks}
        for tree in trees:
            self.stats.trees += tree is not None
            self.stats.empty += tree is None
        return {a.request_id: tree for a, tree in zip(asks, trees)}

    def release(self, request_id: str) -> None:
        self.drafter.release(request_id)
