"""A constrained request's grammar seen from a draft tree, shared by the verifier (grammar_masks.py: pruning and
masking what it verifies) and the drafters (a drafter in the verifier's process, or a drafter process following
the request's grammar over the step channel: drafter_svc/grammars.py): which nodes a grammar allows, the tree cut
to them, and the masks a beam drafter's candidates take at each step."""

from __future__ import annotations

from typing import TYPE_CHECKING

from splitspec.runtime.grammar import xgrammar_module
from splitspec.runtime.tree import DraftTree, child_links

if TYPE_CHECKING:  # masks are made where a grammar is: an NGRAM drafter process never imports torch
    import torch


def _allowed(words: list[int], token: int) -> bool:
    """Whether a bitmask row (as Python ints: one read of the tensor, not one per node) allows the token."""
    return bool((words[token >> 5] >> (token & 31)) & 1)


def grammar_rows(tree: DraftTree, matcher, rows: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """(rows filled with the bitmask after the path to each node, the nodes the grammar allows: each one's token
    allowed after its parent's path, its ancestors kept) for a tree rooted at the matcher's last accepted token.
    The matcher walks the tree (xgrammar's traverse_draft_tree: advancing and rolling back along each path) and
    ends where it began."""
    import torch

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
        import torch

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


GUIDED_OVERDRAFT = 4  # how many times its budget a drafter that fills any budget (NGRAM) is asked for a constrained request


def draft_to_grammar(drafter, request_ids: list[str], budgets: list[int], guides: list) -> tuple[list, int]:
    """(trees, nodes cut): the drafter's trees for these requests, those with a guide (GrammarGuide; None: no grammar)
    holding only tokens their grammar allows, within their budgets. A drafter that masks its own candidates
    (`takes_guides`: the beam drafters) gets the guides; one that fills any budget from a larger pool
    (`fills_budget`: NGRAM) is asked GUIDED_OVERDRAFT times the budget, so that what the grammar allows still fills
    it; every guided tree is then cut to the grammar and to its budget."""
    guided = any(guide is not None for guide in guides)
    overdraft = GUIDED_OVERDRAFT if guided and getattr(drafter, "fills_budget", False) else 1
    asked = [budget * (overdraft if guide is not None else 1) for budget, guide in zip(budgets, guides)]
    if guided and getattr(drafter, "takes_guides", False):
        trees = drafter.draft(request_ids, asked, guides)
    else:
        trees = drafter.draft(request_ids, asked)
    cut_nodes, out = 0, []
    for tree, guide, budget in zip(trees, guides, budgets):
        if guide is not None and isinstance(tree, DraftTree):
            cut = guide.cut(tree, budget)
            cut_nodes += tree.num_nodes - cut.num_nodes
            tree = cut
        out.append(tree)
    return out, cut_nodes
