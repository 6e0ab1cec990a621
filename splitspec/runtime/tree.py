"""Draft trees and the pure index math around them (SGLang's representation, REFERENCES §3.2).

A tree has N nodes. Node 0 is the root: the last token the verifier accepted, which is not yet in the
KV cache. Every other node is a draft token whose parent comes before it (parents[i] < i), so a
parent's KV is always written before its children's.

    tokens   [N]  node tokens, tokens[0] = the root
    parents  [N]  parents[0] = -1
    depth(i)      0 for the root; positions = seq_len + depth (the root sits at seq_len)
    mask     [N, N] bool, mask[i, j] = j is i or an ancestor of i
    next_token / next_sibling [N]: first child and next sibling, -1 for none; children are listed
                  lowest index first (SGLang builds them by scanning i = N-1 .. 1 and pushing i in
                  front of its parent's list), so the first child is the best-ranked draft

Worked example, tokens [t0 t1 t2 t3 t4], parents [-1, 0, 0, 1, 1]:

        t0            depth  [0, 1, 1, 2, 2]
       /  \\           next_token   [1, 3, -1, -1, -1]
      t1   t2         next_sibling [-1, 2, -1, 4, -1]
     /  \\
    t3   t4
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a mask is made: an NGRAM drafter process never imports it
    import torch

NO_NODE = -1


@dataclass(frozen=True)
class DraftTree:
    """One request's draft: node tokens, their parents and (optionally) the drafter's scores."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    scores: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if type(self.parents) is tuple:  # a step's trees repeat a few shapes: each shape checked once
            _checked_parents(self.parents)
        else:
            validate_parents(self.parents)
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"{len(self.tokens)} tokens for {len(self.parents)} parents")
        if self.scores is not None and len(self.scores) != len(self.tokens):
            raise ValueError(f"{len(self.scores)} scores for {len(self.tokens)} nodes")

    @classmethod
    def root(cls, token: int) -> "DraftTree":
        """The root alone (a plain decode step's tree): one per token, made once."""
        tree = _ROOTS.get(token)
        if tree is None:
            tree = _ROOTS[token] = cls((token,), (NO_NODE,))
        return tree

    @classmethod
    def chain(cls, root: int, drafts: list[int], scores: list[float] | None = None) -> "DraftTree":
        """A linear draft: root -> drafts[0] -> drafts[1] -> ... (scores: the drafts', the root's is 1.0)."""
        return cls(tuple([root, *drafts]), tuple(range(-1, len(drafts))), None if scores is None else (1.0, *scores))

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)

    def first(self, count: int) -> "DraftTree":
        """The tree of its first `count` nodes (a tree still: every node's parent comes before it); itself when
        it has no more. Drafters put their likeliest nodes first, so this is the tree a smaller budget keeps."""
        if count >= len(self.tokens):
            return self
        count = max(count, 1)
        return DraftTree(self.tokens[:count], self.parents[:count], None if self.scores is None else self.scores[:count])

    @property
    def num_drafts(self) -> int:
        return len(self.tokens) - 1


_ROOTS: dict[int, DraftTree] = {}


def validate_parents(parents: tuple[int, ...] | list[int]) -> None:
    if not parents or parents[0] != NO_NODE:
        raise ValueError("node 0 must be the root (parent -1)")
    bad = [i for i in range(1, len(parents)) if not 0 <= parents[i] < i]
    if bad:
        raise ValueError(f"nodes {bad} do not have a parent before them")


@functools.lru_cache(maxsize=4096)
def _checked_parents(parents: tuple[int, ...]) -> None:
    """validate_parents, remembered for shapes that passed (one that fails raises every time)."""
    validate_parents(parents)


def depths(parents: list[int] | tuple[int, ...]) -> list[int]:
    out: list[int] = []
    for parent in parents:
        out.append(0 if parent == NO_NODE else out[parent] + 1)
    return out


def positions(parents: list[int] | tuple[int, ...], seq_len: int) -> list[int]:
    """RoPE positions: the root at seq_len (its own position), each node at seq_len + depth."""
    return [seq_len + d for d in depths(parents)]


@functools.lru_cache(maxsize=4096)
def ancestor_rows(parents: tuple[int, ...]) -> tuple[int, ...]:
    """The tree mask's rows as bits: node i's int has bit j set iff j is i or an ancestor of i."""
    rows: list[int] = []
    for i, parent in enumerate(parents):
        rows.append((rows[parent] if parent != NO_NODE else 0) | 1 << i)
    return tuple(rows)


@functools.lru_cache(maxsize=4096)
def _tree_mask(parents: tuple[int, ...]) -> torch.Tensor:
    import torch

    n = len(parents)
    return torch.tensor([[row >> j & 1 for j in range(n)] for row in ancestor_rows(parents)], dtype=torch.bool)


def tree_mask(parents: list[int] | tuple[int, ...]) -> torch.Tensor:
    """[N, N] bool: mask[i, j] iff j is i or an ancestor of i. One tensor per tree shape, shared (a step's trees
    mostly repeat a few shapes: built once, not per request per step): read it, never write into it."""
    return _tree_mask(tuple(parents))


def child_links(parents: list[int] | tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(next_token, next_sibling) [N]: first child and next sibling, children lowest index first. One pair per tree
    shape, shared (a step's trees repeat a few shapes: every request's walk would build them again)."""
    return _child_links(tuple(parents))


@functools.lru_cache(maxsize=4096)
def _child_links(parents: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    n = len(parents)
    next_token, next_sibling = [NO_NODE] * n, [NO_NODE] * n
    for i in range(n - 1, 0, -1):
        parent = parents[i]
        next_sibling[i] = next_token[parent]
        next_token[parent] = i
    return tuple(next_token), tuple(next_sibling)


def path_to(parents: list[int] | tuple[int, ...], node: int) -> list[int]:
    """Node indices root .. node."""
    path = [node]
    while parents[path[-1]] != NO_NODE:
        path.append(parents[path[-1]])
    return path[::-1]


def leaf_outcomes(tree: "DraftTree | None") -> list[list[int]]:
    """The accepted-draft token lists that end at a leaf of the tree, deepest first (then by node
    order): the outcomes a drafter bets on when it has no probabilities. No tree: one empty list
    (the verifier decodes one plain token)."""
    if tree is None or tree.num_nodes == 1:
        return [[]]
    parents = tree.parents
    has_child = set(parents[1:])
    leaves = [i for i in range(1, tree.num_nodes) if i not in has_child]
    node_depths = depths(parents)
    leaves.sort(key=lambda i: (-node_depths[i], i))
    return [[tree.tokens[j] for j in path_to(parents, leaf)[1:]] for leaf in leaves]


def parents_from_selection(selected_index: list[int], parent_list: list[int], topk: int) -> list[int]:
    """Parents of an EAGLE tree from SGLang's draft bookkeeping (build_tree_efficient).

    Node k >= 1 is the draft at flat score index selected_index[k-1]; its beam is selected // topk,
    whose flat index is parent_list[beam] (-1: the root). The parent node is the one selected at that
    flat index. SGLang drops (with a warning) a node whose parent was not selected; so do we.
    """
    position = {flat: k + 1 for k, flat in enumerate(selected_index)}
    parents = [NO_NODE]
    for flat in selected_index:
        beam = flat // topk
        parent_flat = parent_list[beam] if beam > 0 else NO_NODE
        parents.append(0 if parent_flat == NO_NODE else position.get(parent_flat, NO_NODE))
    if NO_NODE in parents[1:]:
        raise ValueError("invalid tree: a selected draft's parent was not selected")
    return parents


def parents_from_mask(mask: torch.Tensor) -> list[int]:
    """Parents from an [N, N] ancestor-or-self mask (SGLang's reconstruct_indices_from_tree_mask):
    a node's parent is its nearest ancestor, the highest-indexed other node its row sees."""
    parents = [NO_NODE]
    for i in range(1, mask.shape[0]):
        ancestors = [j for j in range(i) if mask[i, j]]
        parents.append(ancestors[-1] if ancestors else NO_NODE)
    return parents
