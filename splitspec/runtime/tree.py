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

from dataclasses import dataclass

import torch

NO_NODE = -1


@dataclass(frozen=True)
class DraftTree:
    """One request's draft: node tokens, their parents and (optionally) the drafter's scores."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    scores: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        validate_parents(self.parents)
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"{len(self.tokens)} tokens for {len(self.parents)} parents")
        if self.scores is not None and len(self.scores) != len(self.tokens):
            raise ValueError(f"{len(self.scores)} scores for {len(self.tokens)} nodes")

    @classmethod
    def chain(cls, root: int, drafts: list[int]) -> "DraftTree":
        """A linear draft: root -> drafts[0] -> drafts[1] -> ..."""
        return cls(tuple([root, *drafts]), tuple(range(-1, len(drafts))))

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)

    @property
    def num_drafts(self) -> int:
        return len(self.tokens) - 1


def validate_parents(parents: tuple[int, ...] | list[int]) -> None:
    if not parents or parents[0] != NO_NODE:
        raise ValueError("node 0 must be the root (parent -1)")
    bad = [i for i in range(1, len(parents)) if not 0 <= parents[i] < i]
    if bad:
        raise ValueError(f"nodes {bad} do not have a parent before them")


def depths(parents: list[int] | tuple[int, ...]) -> list[int]:
    out: list[int] = []
    for parent in parents:
        out.append(0 if parent == NO_NODE else out[parent] + 1)
    return out


def positions(parents: list[int] | tuple[int, ...], seq_len: int) -> list[int]:
    """RoPE positions: the root at seq_len (its own position), each node at seq_len + depth."""
    return [seq_len + d for d in depths(parents)]


def tree_mask(parents: list[int] | tuple[int, ...]) -> torch.Tensor:
    """[N, N] bool: mask[i, j] iff j is i or an ancestor of i."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        mask[i] |= mask[parents[i]]
    return mask


def child_links(parents: list[int] | tuple[int, ...]) -> tuple[list[int], list[int]]:
    """(next_token, next_sibling) [N]: first child and next sibling, children lowest index first."""
    n = len(parents)
    next_token, next_sibling = [NO_NODE] * n, [NO_NODE] * n
    for i in range(n - 1, 0, -1):
        parent = parents[i]
        next_sibling[i] = next_token[parent]
        next_token[parent] = i
    return next_token, next_sibling


def path_to(parents: list[int] | tuple[int, ...], node: int) -> list[int]:
    """Node indices root .. node."""
    path = [node]
    while parents[path[-1]] != NO_NODE:
        path.append(parents[path[-1]])
    return path[::-1]


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
