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


def batched_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax and top-k of every row of logits [R, V] in one device call, moved to the host in one
    transfer: (probabilities [R, k] float32, indices [R, k] int64)."""
    top_p, top_idx = torch.softmax(logits.float(), -1).topk(min(k, logits.shape[-1]), dim=-1)
    both = torch.cat([top_p, top_idx.float()], dim=-1).cpu() if top_idx.numel() and logits.shape[-1] < 2**24 else None
    if both is None:  # indices beyond float32's exact integers: two transfers
        return top_p.cpu(), top_idx.cpu()
    return both[:, : top_p.shape[-1]], both[:, top_p.shape[-1] :].long()


class BeamDraft:
    """SGLang's EAGLE / STANDALONE draft tree for one request (REFERENCES §3.1): K beams expanded for S
    steps, scored by probability products, the best N-1 of every scored candidate kept in flat order.

        step 0   probs at the root -> top-K: beams (scores = their probabilities), tokens, parents -1
        step i   probs at each beam [K, V] -> top-K each -> K*K candidates scored beam * prob;
                 the best K become the beams
        finish   flat candidates (K + (S-1)*K*K): the best N-1 by score, sorted by flat index, are the
                 drafts; a draft's parent is the flat candidate its beam came from

    The drafter calls first() with the root's distribution, then, while beams() is not None, runs its
    model on the beams (each sees the root and its own ancestors) and calls expand(); tree() gives the
    DraftTree. `frontier` lists the beams as (token, parent beam node or -1 for the root) in the order
    the beam nodes were made, so a drafter can lay them out as one growing tree.
    """

    def __init__(self, root: int, topk: int, num_steps: int, num_draft_tokens: int, token_map: torch.Tensor | None = None):
        """token_map (FR-Spec): the distributions are over these target ids; indices map back through it."""
        if topk < 1 or num_steps < 1 or num_draft_tokens < 2:
            raise ValueError(f"topk {topk}, steps {num_steps}, draft tokens {num_draft_tokens}: need >= 1, >= 1, >= 2")
        self.root, self.topk, self.num_steps = root, topk, num_steps
        self.token_map = token_map
        self.num_draft_tokens = num_draft_tokens
        self.step = 0
        self.scores: torch.Tensor | None = None  # [K] current beam scores
        self.flat_scores: list[torch.Tensor] = []
        self.flat_tokens: list[torch.Tensor] = []
        self.parent_list: list[int] = []
        # beam nodes made so far, as a tree rooted at the root: node tokens and parents (-1 = root)
        self.beam_tokens: list[int] = []
        self.beam_parents: list[int] = []
        self._frontier: list[int] = []  # indices into beam_tokens of the current beams

    def first(self, probs: torch.Tensor) -> None:
        """probs [V]: the draft model's distribution after the root."""
        top_p, top_idx = probs.float().topk(min(self.topk, probs.shape[-1]))
        self.first_topk(top_p.cpu(), top_idx.cpu())  # the bookkeeping is small: on the host

    def first_topk(self, top_p: torch.Tensor, top_idx: torch.Tensor) -> None:
        """first() from the root distribution's top-k (on the host): a drafter batching its requests takes
        every request's top-k in one device call and one transfer (batched_topk)."""
        k = top_p.shape[-1]
        top_idx = self._ids(top_idx)
        self.scores = top_p
        self.flat_scores.append(top_p)
        self.flat_tokens.append(top_idx)
        self.parent_list = [NO_NODE, *range(k)]
        self._frontier = self._add_beams(top_idx.tolist(), [NO_NODE] * k)
        self.step = 1

    def beams(self) -> list[int] | None:
        """Indices (into beam_tokens) whose next distributions expand() needs, or None when done."""
        return None if self.step >= self.num_steps else list(self._frontier)

    def expand(self, probs: torch.Tensor) -> None:
        """probs [K, V]: the distribution after each current beam, in beams() order."""
        top_p, top_idx = probs.float().topk(self.topk, dim=-1)  # [K, K]
        self.expand_topk(top_p.cpu(), top_idx.cpu())

    def expand_topk(self, top_p: torch.Tensor, top_idx: torch.Tensor) -> None:
        """expand() from each beam's top-k [K, K] (on the host)."""
        k = self.topk
        top_idx = self._ids(top_idx)
        candidates = (self.scores[:, None] * top_p).flatten()  # [K*K]
        chosen = candidates.topk(k).indices
        self.scores = candidates[chosen]
        self.flat_scores.append(candidates)
        self.flat_tokens.append(top_idx.flatten())
        if self.step < self.num_steps - 1:  # parents of the next step's candidates (parents_i in §3.1)
            self.parent_list += (chosen + k * k * (self.step - 1) + k).tolist()
        parents = [self._frontier[i] for i in (chosen // k).tolist()]
        self._frontier = self._add_beams(top_idx.flatten()[chosen].tolist(), parents)
        self.step += 1

    def tree(self) -> DraftTree:
        scores = torch.cat(self.flat_scores)
        tokens = torch.cat(self.flat_tokens)
        keep = min(self.num_draft_tokens - 1, scores.numel())
        # best scores first, ties to the lower flat index: a child never scores above its parent and
        # comes later, so a kept child always has its parent kept (SGLang's topk may split such a tie
        # and then drops the orphan)
        values = scores.tolist()
        selected = sorted(sorted(range(len(values)), key=lambda f: (-values[f], f))[:keep])
        parents = parents_from_selection(selected, self.parent_list, self.topk)
        return DraftTree(tuple([self.root, *tokens[selected].tolist()]), tuple(parents),
                         tuple([1.0, *scores[selected].tolist()]))

    def layout(self) -> tuple[list[int], list[int], torch.Tensor]:
        """The beam nodes made so far as new tokens after the (committed) root: tokens, depths (1 for
        the root's children) and their [n, n] ancestor-or-self mask, from the tree they form with it."""
        parents = [NO_NODE, *(p + 1 for p in self.beam_parents)]  # the root as node 0
        return list(self.beam_tokens), depths(parents)[1:], tree_mask(parents)[1:, 1:]

    def _ids(self, indices: torch.Tensor) -> torch.Tensor:
        indices = indices.cpu()
        return indices if self.token_map is None else self.token_map[indices]

    def _add_beams(self, tokens: list[int], parents: list[int]) -> list[int]:
        start = len(self.beam_tokens)
        self.beam_tokens += tokens
        self.beam_parents += parents
        return list(range(start, start + len(tokens)))
