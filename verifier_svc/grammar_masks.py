"""Structured outputs in the step (runtime/grammar.py compiles the grammars): for every request with a grammar,
its tree is pruned to the nodes its grammar allows (a drafted token the grammar forbids can never be accepted,
so it and its subtree are dropped before they cost verification), and every logits row it verifies is masked
to the tokens the grammar allows after the path to that node (xgrammar's matcher walks the tree, advancing
and rolling back along each path). Acceptance then runs on the masked logits exactly as plain constrained
decoding samples from them, so speculation stays lossless; the request's matcher is advanced by the tokens
it emits (Request.emit).

    tree  n0 -{"}-> n1 -{a}-> n2        grammar after n0 allows {"}, after n1 {a, b}
             -{x}-> n3                  x is not allowed after n0: n3 pruned; rows n0, n1, n2 masked
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from splitspec.runtime.grammar import xgrammar_module
from splitspec.runtime.tree import DraftTree, child_links
from splitspec.verifier_svc.step_types import Chunk, Request


def _allowed(words: list[int], token: int) -> bool:
    """Whether a bitmask row (as Python ints: one read of the tensor, not one per node) allows the token."""
    return bool((words[token >> 5] >> (token & 31)) & 1)


class GrammarMasks:
    """One step's masks: (sequence index in the forward, first logits row offset, bitmask rows)."""

    def __init__(self, vocab_size: int):
        self.xgr = xgrammar_module()
        self.vocab_size = vocab_size
        self.entries: list[tuple[int, int, torch.Tensor]] = []
        self.pruned_nodes = 0

    @classmethod
    def build(cls, prefills: list[Chunk], verifies: list, vocab_size: int) -> "GrammarMasks | None":
        """None when no request of the step has a grammar. Prunes the constrained requests' trees in place."""
        constrained = [(i, c.request) for i, c in enumerate(prefills) if c.samples and _live(c.request)]
        constrained += [(len(prefills) + j, v) for j, v in enumerate(verifies) if _live(v.request)]
        if not constrained:
            return None
        masks = cls(vocab_size)
        for index, item in constrained:
            if isinstance(item, Request):  # a prompt's last row: its first output token
                rows = masks._rows(1)
                item.matcher.fill_next_token_bitmask(rows, 0)
                masks.entries.append((index, -1, rows))
            else:
                masks.entries.append((index, 0, masks._tree(item)))
        return masks

    def _rows(self, n: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(n, self.vocab_size)

    def _tree(self, verify) -> torch.Tensor:
        """The bitmask of every node of the request's tree, after pruning it to what the grammar allows."""
        rows, keep = grammar_rows(verify.tree, verify.request.matcher, self._rows(verify.tree.num_nodes))
        if len(keep) < verify.tree.num_nodes:
            self.pruned_nodes += verify.tree.num_nodes - len(keep)
            verify.tree = subtree(verify.tree, keep)
            rows = rows[keep]
        return rows

    def apply(self, logits: torch.Tensor, cu_logits: list[int]) -> None:
        """Mask the constrained rows of the forward's logits [rows, V] in place (-inf where not allowed)."""
        indices, parts = [], []
        for index, offset, rows in self.entries:
            first = cu_logits[index + 1] - 1 if offset < 0 else cu_logits[index]
            indices += range(first, first + rows.shape[0])
            parts.append(rows)
        full = self._rows(logits.shape[0])
        full[indices] = torch.cat(parts)
        self.xgr.apply_token_bitmask_inplace(logits, full.to(logits.device, non_blocking=True),
                                             vocab_size=min(self.vocab_size, logits.shape[-1]), indices=indices)


def grammar_rows(tree: DraftTree, matcher, rows: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """(rows filled with the bitmask after the path to each node, the nodes the grammar allows: each one's token
    allowed after its parent's path, its ancestors kept) for a tree rooted at the matcher's last accepted token.
    The matcher walks the tree (xgrammar's traverse_draft_tree: advancing and rolling back along each path) and
    ends where it began."""
    if tree.num_nodes == 1:
        matcher.fill_next_token_bitmask(rows, 0)
        return rows, [0]
    next_token, next_sibling = child_links(tree.parents)
    as_tensor = lambda values: torch.tensor(values, dtype=torch.int64)  # noqa: E731
    matcher.traverse_draft_tree(as_tensor(next_token), as_tensor(next_sibling), as_tensor(tree.tokens), rows)
    keep, kept, words = [0], {0}, rows.tolist()
    for node in range(1, tree.num_nodes):  # parents come before their children
        if tree.parents[node] in kept and _allowed(words[tree.parents[node]], tree.tokens[node]):
            kept.add(node)
            keep.append(node)
    return rows, keep


def subtree(tree: DraftTree, keep: list[int]) -> DraftTree:
    """The tree of the nodes `keep` (ascending, the root first, every node's parent among them), renumbered; the
    drafter's scores kept with their nodes."""
    index = {node: i for i, node in enumerate(keep)}
    return DraftTree(tuple(tree.tokens[n] for n in keep), tuple(-1 if n == 0 else index[tree.parents[n]] for n in keep),
                     None if tree.scores is None else tuple(tree.scores[n] for n in keep))


class GrammarGuide:
    """What a drafter in the verifier's process sees of a constrained request's grammar: its matcher, standing after
    the request's last token (every tree's root). node_masks guides a beam drafter's candidates at each step; cut
    cuts any drafter's tree to what the grammar allows and to its budget. The matcher ends where it began."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size
        self.xgr = xgrammar_module()

    def node_masks(self, tree: DraftTree) -> torch.Tensor:
        """[nodes, vocab] bool: the tokens the grammar allows after the path to each node (none after a node whose
        path it forbids)."""
        rows, keep = grammar_rows(tree, self.matcher, self.xgr.allocate_token_bitmask(tree.num_nodes, self.vocab_size))
        bits = (rows[:, :, None] >> torch.arange(32, dtype=rows.dtype)) & 1
        allowed = bits.bool().flatten(1)[:, : self.vocab_size]
        if len(keep) < tree.num_nodes:
            forbidden = torch.ones(tree.num_nodes, dtype=torch.bool)
            forbidden[keep] = False
            allowed[forbidden] = False
        return allowed

    def cut(self, tree: DraftTree, max_nodes: int) -> DraftTree:
        """The tree cut to what the grammar allows, then to its first max_nodes nodes (the drafter's own order:
        parents first, its likeliest candidates first): what a drafter proposes for a constrained request."""
        _, keep = grammar_rows(tree, self.matcher, self.xgr.allocate_token_bitmask(tree.num_nodes, self.vocab_size))
        return subtree(tree, keep[:max_nodes])


def draft_guide(request: Request, vocab_size: int) -> GrammarGuide | None:
    """The guide of a request whose output a grammar constrains (and is not yet complete); None otherwise."""
    return GrammarGuide(request.matcher, vocab_size) if _live(request) else None


def _live(request: Request) -> bool:
    return request.matcher is not None and not request.matcher.is_terminated()


def no_grammars() -> Future:
    """The compile of a request with a grammar on an engine without a grammar compiler: failed."""
    future = Future()
    future.set_exception(RuntimeError("this server has no grammar engine (xgrammar) for structured outputs"))
    return future
