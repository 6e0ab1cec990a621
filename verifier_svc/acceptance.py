"""Tree acceptance: which draft nodes a verify step keeps, and the token it adds after them.

Terms (as in the papers and vLLM's rejection sampler):
- *accepted*: a draft token the step keeps;
- *bonus*: the token the target emits after the last accepted node (a *recovered* token when a draft
  was rejected there, a free extra token when the whole path was accepted). A step emits
  accepted + 1 tokens.

Two rules, both walks from the root down the tree (links as in runtime.tree: first child, next
sibling):

- `accept_target_tokens` (lossless; greedy and splitspec's default sampling). `target_tokens[i]` is
  the target's own token after node i: its argmax, or its position-keyed Gumbel-max sample
  (ARCHITECTURE §3.2). A child is accepted when it equals the target's token at its parent. The
  output is then token for token what the target alone would produce: for greedy trivially, for
  sampling because the noise is keyed by output position, not by step.
- `accept_with_coins` (SGLang's `tree_speculative_sampling_target_only`, REFERENCES §3.4): one coin
  per level against the cumulative target mass of the siblings tried so far; thresholds below 1.0
  make it an explicit lossy option, exactly as SGLang users tuned it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitspec.runtime.tree import NO_NODE


@dataclass(frozen=True)
class Acceptance:
    path: list[int]  # node indices from the root to the last accepted node (root included)
    tokens: list[int]  # emitted: the accepted drafts' tokens, then the bonus token

    @property
    def num_accepted(self) -> int:
        return len(self.path) - 1


def accept_target_tokens(
    candidates: list[int], next_token: list[int], next_sibling: list[int], target_tokens: list[int],
    max_accepted: int | None = None,
) -> Acceptance:
    """Accept the child equal to the target's token at its parent, level by level."""
    last, path, emitted = 0, [0], []
    while max_accepted is None or len(emitted) < max_accepted:
        child = next_token[last]
        while child != NO_NODE and candidates[child] != target_tokens[last]:
            child = next_sibling[child]
        if child == NO_NODE:
            break
        emitted.append(candidates[child])
        path.append(child)
        last = child
    emitted.append(target_tokens[last])  # bonus: the target's own token after the last accepted node
    return Acceptance(path, emitted)


def accept_with_coins(
    candidates: list[int], next_token: list[int], next_sibling: list[int],
    target_probs: torch.Tensor,  # [N, V] processed target distribution after each node
    coins: list[float],  # [N] one uniform per node: the coin used at the level below it
    final_coins: list[float],  # [N] the bonus token's coin when the walk ends at that node
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    max_accepted: int | None = None,
) -> Acceptance:
    """SGLang's rule: at each level, try the children in order, accepting child c when the level's coin
    is below the cumulative target mass tried so far (divided by threshold_acc) or when c alone has
    mass >= threshold_single. The bonus token is drawn with the last accepted node's final coin from
    the target distribution there, with the rejected siblings' mass removed."""
    last, path, emitted = 0, [0], []
    rejected = torch.zeros(target_probs.shape[-1], dtype=target_probs.dtype, device=target_probs.device)
    coin = coins[0]
    while max_accepted is None or len(emitted) < max_accepted:
        child, cumulative = next_token[last], 0.0
        rejected.zero_()
        while child != NO_NODE:
            p = float(target_probs[last, candidates[child]])
            cumulative += p
            if p >= threshold_single or threshold_acc == 0 or coin <= cumulative / threshold_acc:
                break
            rejected[candidates[child]] = p
            child = next_sibling[child]
        if child == NO_NODE:
            break
        emitted.append(candidates[child])
        path.append(child)
        last, coin = child, coins[child]
        rejected.zero_()
    residual = torch.clamp(target_probs[last] - rejected, min=0)
    emitted.append(inverse_cdf_sample(residual, final_coins[last]))
    return Acceptance(path, emitted)


def inverse_cdf_sample(weights: torch.Tensor, coin: float) -> int:
    """The first index whose cumulative weight exceeds coin * total (weights need not sum to 1)."""
    cumulative = weights.cumsum(0)
    index = int(torch.searchsorted(cumulative, coin * cumulative[-1], right=True))
    return min(index, weights.numel() - 1)
