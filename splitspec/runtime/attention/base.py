"""The attention-backend interface: plan once per batch, run once per layer.

A batch is a list of requests, each adding `q_len` new tokens after `kv_len - q_len` cached ones:

    request i keys:  [ cached prefix (all visible) | new tokens (mask[i] or causal) ]
    request i query: the new tokens only

`mask[i]` is a [q_len, q_len] bool over the new tokens (True = may attend); a draft tree's mask
makes each node see its ancestors and itself. `None` means causal. Splitting plan from run is what
FlashInfer's plan/run and CUDA-graph replay need: nothing per-batch happens inside `run`.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from splitspec.runtime.config import ModelConfig
from splitspec.runtime.kv_cache import KVCache


@dataclass
class AttentionBatch:
    q_lens: list[int]  # new tokens per request
    kv_lens: list[int]  # keys per request after the new tokens are written (prefix + q_len)
    page_tables: list[list[int]]  # each request's KV pages, in logical order
    out_slots: torch.Tensor  # [num_tokens] flat slot id where each new token's K/V is written
    positions: torch.Tensor  # [num_tokens] RoPE position of each new token
    masks: list[torch.Tensor | None]  # per request: [q_len, q_len] bool over new tokens, None = causal
    # per request, where its mask is a draft tree's: the tree's parents (tree.ancestor_rows gives the mask as bits)
    trees: list[tuple[int, ...] | None] | None = None

    @property
    def num_requests(self) -> int:
        return len(self.q_lens)

    @property
    def step_tokens(self) -> int | None:
        """q when the batch is a step's shape: every request adds q tokens, one without a mask (decode) or
        a tree of q nodes under its mask (verification); None for prompt chunks and mixed batches."""
        if not self.q_lens or any(q != self.q_lens[0] for q in self.q_lens):
            return None
        q = self.q_lens[0]
        return q if all((m is None) == (q == 1) for m in self.masks) else None


class AttentionBackend(ABC):
    """Writes each layer's new K/V into the paged cache and attends over it."""

    name: str = ""

    def __init__(self, config: ModelConfig, kv_cache: KVCache):
        self.config = config
        self.kv_cache = kv_cache
        self.scaling = config.head_dim**-0.5

    @abstractmethod
    def plan(self, batch: AttentionBatch) -> object:
        """Per-batch work (index tensors, masks, kernel plans). The result is opaque to callers."""

    @abstractmethod
    def run(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: object) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] of the new tokens -> attention output [T, Hq, D]."""

    def run_rope(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: object, rope,
                 positions: torch.Tensor) -> torch.Tensor:
        """RoPE on q and k at positions, then run(); a backend may fuse the rotation with its K/V write."""
        q, k = rope.rotate(q, k, positions)
        return self.run(layer_id, q, k, v, plan)

    # cascade attention (the device draft loop, runtime.draft_loop): rows of q attend to a cached prefix
    # only, nothing written; the caller merges the result with attention over keys it keeps itself
    @abstractmethod
    def plan_prefix(self, kv_lens: list[int], page_tables: list[list[int]], q_lens: list[int],
                    state: object = None) -> object:
        """Request i has q_lens[i] rows of q (consecutive), each attending to all of its first kv_lens[i]
        cached keys in page_tables[i]. state: from prefix_graph_state, to plan into a CUDA graph's buffers."""

    @abstractmethod
    def attend_prefix(self, layer_id: int, q: torch.Tensor, plan: object) -> tuple[torch.Tensor, torch.Tensor]:
        """q [R, Hq, D] -> (output [R, Hq, D], natural-log sum of exp of the scaled scores [R, Hq] fp32)."""

    def prefix_graph_state(self, num_requests: int, num_rows: int, max_pages: int) -> object:
        """Fixed buffers for plan_prefix of this many requests and rows over at most `max_pages` page entries
        (CUDA graphs); None where the backend's plans cannot be replayed."""
        return None

    def prefix_key_lengths(self, state: object) -> torch.Tensor | None:
        """The device buffer of each request's key count a planned graph state's kernel reads as it runs, where one does
        (its plan does not depend on them otherwise: a caller may write lengths known on the device only, up to those
        planned); None where the plan depends on them."""
        return None

    def graph_prologue(self, state: object) -> None:
        """Device work a captured step graph (graph_state's) runs before its layers; none by default."""


def env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    """An environment variable that picks one of `choices` (default when unset); any other value is refused by name."""
    value = os.environ.get(name, default)
    if value not in choices:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(choices)}")
    return value


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Attention over keys A + B from attention over A and over B: outputs [..., D] weighted by their
    softmax denominators (natural-log sums of exp [...], fp32)."""
    top = torch.maximum(lse_a, lse_b)
    wa, wb = torch.exp(lse_a - top), torch.exp(lse_b - top)
    out = (out_a.float() * wa[..., None] + out_b.float() * wb[..., None]) / (wa + wb)[..., None]
    return out.to(out_a.dtype)
