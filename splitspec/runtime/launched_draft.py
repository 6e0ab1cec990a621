"""Drafts launched on the device and not yet on the host.

A drafter in the verifier's process queues its draft (the head's catch-up, then the draft loop) on the device
and returns a LaunchedDraft at once. Where every tree is a chain of known size (a top-1 draft) the verifier need
not wait for the tokens: it builds the verification batch around PendingChains (the shape is all a batch's
positions, slots, masks and attention plan need), writes the drafts into the batch's input ids on the device
(write_chains) and queues the verification behind the draft; the tokens reach the host while the device
verifies, before acceptance reads them (PendingChain.resolve). So the host's batch building runs under the
draft's device time instead of after it.

    host    catch-up, loop launched | verify batch built, drafts written, verify launched | trees | accept
    device                          | catch-up, draft loop ......... | verify .........................|
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from splitspec.runtime.tree import DraftTree

if TYPE_CHECKING:  # the verifier writes chains; a drafter process of no model (NGRAM) never imports torch
    import torch

logger = logging.getLogger(__name__)


class LaunchedDraft:
    """A drafter's trees for a batch of requests (one per request, None for no tree), launched: trees() gives them,
    finishing the draft once. chain_tokens [R, >= n - 1] (None unless every tree is a chain): row rows[i] holds
    request i's drafts in chain order on the device, sizes[i] its tree's node count; readable by work queued
    before the drafter's next launch. id_bound: every id in chain_tokens is below it (None: not known)."""

    def __init__(self, finish: Callable[[], list], rows: list[int | None] | None = None,
                 sizes: list[int | None] | None = None, chain_tokens: torch.Tensor | None = None,
                 id_bound: int | None = None):
        self._finish, self._trees = finish, None
        self.rows, self.sizes, self.chain_tokens, self.id_bound = rows, sizes, chain_tokens, id_bound

    @classmethod
    def ready(cls, trees: list) -> "LaunchedDraft":
        """Trees already on the host."""
        launched = cls(lambda: trees)
        launched._trees = trees
        return launched

    @property
    def finished(self) -> bool:
        return self._trees is not None

    def trees(self) -> list:
        if self._trees is None:
            self._trees = self._finish()
        return self._trees

    def pending(self) -> list["PendingChain | None"]:
        """Per request a PendingChain (or None: no tree); only where chain_tokens is not None."""
        return [None if row is None or size is None or size < 2 else PendingChain(self, i, row, size)
                for i, (row, size) in enumerate(zip(self.rows, self.sizes))]


class PendingChain:
    """A request's chain draft whose tokens are still on the device (row `row` of its launch's chain_tokens).
    Verification reads num_nodes and parents (a chain); the tokens come with resolve()."""

    __slots__ = ("launched", "index", "row", "num_nodes")

    def __init__(self, launched: LaunchedDraft, index: int, row: int, num_nodes: int):
        self.launched, self.index, self.row, self.num_nodes = launched, index, row, num_nodes

    @property
    def parents(self) -> tuple[int, ...]:
        return tuple(range(-1, self.num_nodes - 1))

    @property
    def num_drafts(self) -> int:
        return self.num_nodes - 1

    def resolve(self, root: int, vocab: int) -> DraftTree:
        """The chain as verified: root, then the drafter's tokens (waiting for them once), any past the vocabulary
        as write_chains wrote them (vocab - 1). A drafter whose tree is not this chain is a bug: it raises."""
        try:
            tree = self.launched.trees()[self.index]
        except Exception:  # the drafter's bookkeeping failed; what was verified is still on the device
            logger.exception("finishing a launched draft failed; its chain is read from the device")
            drafts = self.launched.chain_tokens[self.row, : self.num_nodes - 1].tolist()
            return DraftTree.chain(root, _clamped(drafts, vocab))
        if not isinstance(tree, DraftTree) or tree.num_nodes != self.num_nodes or tree.parents != self.parents:
            raise RuntimeError(f"a launched chain of {self.num_nodes} nodes came back as {tree!r}")
        scores = None if tree.scores is None else list(tree.scores[1:])
        return DraftTree.chain(root, _clamped(tree.tokens[1:], vocab), scores)


def _clamped(tokens, vocab: int) -> list[int]:
    """Draft tokens as write_chains wrote them: any past the target's vocabulary as its last id."""
    return [t if t < vocab else vocab - 1 for t in tokens]


def write_chains(input_ids: torch.Tensor, starts: list[int], chains: list[PendingChain], vocab: int) -> None:
    """Each chain's drafts into rows starts[k] + 1 .. starts[k] + n - 1 of a batch's input ids (starts[k]: the first
    row of chains[k]'s sequence, its root's), on the device, clamped to the vocabulary (a draft head's padded
    vocabulary must not index past the target's embeddings; resolve() reads them the same way). One strided copy
    when the chains are one launch's rows 0.. in order, evenly spaced and equally long (a decode step's usual case)."""
    from splitspec.runtime.batch import device_tensor

    if not chains:
        return
    tokens = chains[0].launched.chain_tokens
    n = chains[0].num_nodes
    stride = starts[1] - starts[0] if len(starts) > 1 else n
    if (stride >= n and starts[0] + stride * len(chains) <= input_ids.shape[0]
            and all(c.launched is chains[0].launched and c.row == k and c.num_nodes == n for k, c in enumerate(chains))
            and all(s == starts[0] + k * stride for k, s in enumerate(starts))):
        rows = input_ids[starts[0] : starts[0] + stride * len(chains)].view(len(chains), stride)
        drafts = tokens[: len(chains), : n - 1]
        bound = chains[0].launched.id_bound  # a drafter whose ids all fit the vocabulary needs no clamp (a kernel)
        rows[:, 1:n].copy_(drafts if bound is not None and bound <= vocab else drafts.clamp(max=vocab - 1))
        return
    groups: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}  # per launch: its tokens, rows read, rows written
    for start, chain in zip(starts, chains):
        groups.setdefault(id(chain.launched), (chain.launched.chain_tokens, [], []))
        _, src, dst = groups[id(chain.launched)]
        width = chain.launched.chain_tokens.shape[1]
        src.extend(chain.row * width + j for j in range(chain.num_nodes - 1))
        dst.extend(start + 1 + j for j in range(chain.num_nodes - 1))
    device = input_ids.device
    for tokens, src, dst in groups.values():
        values = tokens.reshape(-1).index_select(0, device_tensor(src, device))
        input_ids.index_copy_(0, device_tensor(dst, device), values.clamp(max=vocab - 1).to(input_ids.dtype))
