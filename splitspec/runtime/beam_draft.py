"""SGLang's EAGLE / STANDALONE draft tree built by beam search (REFERENCES §3.1): a request's beams expanded step by
step from its draft model's distributions, and the best-scored candidates kept as its DraftTree (runtime/tree.py)."""

from __future__ import annotations

import torch

from splitspec.runtime.tree import NO_NODE, DraftTree, depths, parents_from_selection, tree_mask


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
