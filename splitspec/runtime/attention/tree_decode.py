"""--speculative-attention-mode decode: tree verification attends with decode kernels (SGLang's mode).

In prefill mode (the default) a batch of trees is one prefill-kind pass with a custom mask over each
request's keys. In decode mode every tree node is a row of a decode kernel over its request's cached
prefix (the attention backend's prefix attention: FlashInfer's paged decode on a GPU), merged with dense
attention over the tree's own nodes under its mask (the cascade that runtime.draft_loop's beam steps use):

    node i of request b:  softmax over [ prefix of b (decode kernel) | tree nodes j with mask[i, j] ]

The tree's K/V are still written to the paged cache, so commit and the next step are unchanged. Batches
that are not all trees (prompt chunks, plain decode, mixed) go to the wrapped backend as they are, and so
do models with sliding-window layers (logged at start). Graph-shaped tree batches replay CUDA graphs of
this mode, with the prefix plan, the slots and the masks in fixed buffers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from splitspec.runtime.attention.base import AttentionBackend, AttentionBatch, merge_attention
from splitspec.runtime.attention.torch_backend import dense_attention

logger = logging.getLogger(__name__)


@dataclass
class TreePlan:
    out_slots: torch.Tensor  # [B*q] where the nodes' K/V go
    prefix: object  # the wrapped backend's prefix plan: one row per node
    own_rows: torch.Tensor  # [T, n] each node row's tree nodes (their rows among the batch's), padded
    own_valid: torch.Tensor  # [T, n] bool: which of them it sees (its ancestors and itself)


@dataclass
class TreeGraphState:
    plan: TreePlan  # its prefix is the wrapped backend's graph state


class DecodeModeBackend(AttentionBackend):
    name = "decode-mode"

    def __init__(self, base: AttentionBackend):
        super().__init__(base.config, base.kv_cache)
        self.base = base
        self.enabled = all(w is None for w in base.config.sliding_windows)
        if not self.enabled:
            logger.info("--speculative-attention-mode decode: the model has sliding-window layers, trees are "
                        "verified in prefill mode")

    def _tree_batch(self, batch: AttentionBatch) -> bool:
        """Trees (a lone root counts as a one-node tree), at least one with drafts, every one after a prefix."""
        return (self.enabled and any(q > 1 for q in batch.q_lens)
                and all(m is not None or q == 1 for q, m in zip(batch.q_lens, batch.masks))
                and all(k > q for k, q in zip(batch.kv_lens, batch.q_lens)))

    @staticmethod
    def _node_rows(batch: AttentionBatch) -> tuple[list[int], list[list[int]], list[int]]:
        """plan_prefix's arguments: every node its own one-row entry over its request's prefix (decode rows)."""
        lens, tables = [], []
        for q, kv, pages in zip(batch.q_lens, batch.kv_lens, batch.page_tables):
            lens += [kv - q] * q
            tables += [pages] * q
        return lens, tables, [1] * len(lens)

    @staticmethod
    def _own_keys(batch: AttentionBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """For each node row: the rows of its tree's nodes, padded to the largest tree ([T, n] long), and
        which of them it sees ([T, n] bool)."""
        width = max(batch.q_lens)
        index, valid, start = [], [], 0
        for q, mask in zip(batch.q_lens, batch.masks):
            rows = torch.zeros(q, width, dtype=torch.long)
            rows[:, :q] = torch.arange(start, start + q)
            seen = torch.zeros(q, width, dtype=torch.bool)
            seen[:, :q] = torch.ones(1, 1, dtype=torch.bool) if mask is None else mask.to("cpu", torch.bool)
            index.append(rows)
            valid.append(seen)
            start += q
        return torch.cat(index), torch.cat(valid)

    def plan(self, batch: AttentionBatch) -> object:
        if not self._tree_batch(batch):
            return self.base.plan(batch)
        device = self.kv_cache.device
        index, valid = self._own_keys(batch)
        return TreePlan(batch.out_slots.to(device, non_blocking=True), self.base.plan_prefix(*self._node_rows(batch)),
                        index.to(device, non_blocking=True), valid.to(device, non_blocking=True))

    def run(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: object) -> torch.Tensor:
        if not isinstance(plan, TreePlan):
            return self.base.run(layer_id, q, k, v, plan)
        k_flat, v_flat = self.kv_cache.flat_kv(layer_id)
        k_flat[plan.out_slots] = k.to(k_flat.dtype)
        v_flat[plan.out_slots] = v.to(v_flat.dtype)
        out_prefix, lse_prefix = self.base.attend_prefix(layer_id, q, plan.prefix)
        out_tree, lse_tree = dense_attention(q, k[plan.own_rows], v[plan.own_rows], plan.own_valid, self.scaling)
        return merge_attention(out_prefix, lse_prefix, out_tree, lse_tree)

    def run_rope(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: object, rope,
                 positions: torch.Tensor) -> torch.Tensor:
        if not isinstance(plan, TreePlan):
            return self.base.run_rope(layer_id, q, k, v, plan, rope, positions)
        q, k = rope.rotate(q, k, positions)
        return self.run(layer_id, q, k, v, plan)

    def plan_prefix(self, kv_lens, page_tables, q_lens, state=None):
        return self.base.plan_prefix(kv_lens, page_tables, q_lens, state)

    def attend_prefix(self, layer_id, q, plan):
        return self.base.attend_prefix(layer_id, q, plan)

    def prefix_graph_state(self, num_requests: int, num_rows: int, max_pages: int) -> object:
        return self.base.prefix_graph_state(num_requests, num_rows, max_pages)

    # CUDA graphs (when the wrapped backend has them) ----------------------------------------------------
    @property
    def graphs_supported(self) -> bool:
        return hasattr(self.base, "graph_state")

    def graph_state(self, batch_size: int, max_pages: int, q_len: int = 1, max_kv_len: int = 0,
                    causal: bool = False) -> object:
        if q_len == 1 or not self.enabled or causal:  # chains are the wrapped backend's
            return self.base.graph_state(batch_size, max_pages, q_len, max_kv_len, causal=causal)
        device = self.kv_cache.device
        rows = batch_size * q_len
        prefix_state = self.base.prefix_graph_state(rows, rows, max_pages * q_len)
        plan = TreePlan(torch.zeros(rows, dtype=torch.long, device=device), prefix_state,
                        torch.zeros(rows, q_len, dtype=torch.long, device=device),
                        torch.zeros(rows, q_len, dtype=torch.bool, device=device))
        return TreeGraphState(plan)

    def graph_prologue(self, state: object) -> None:
        if not isinstance(state, TreeGraphState):
            self.base.graph_prologue(state)

    def graph_plan(self, state: object, batch: AttentionBatch) -> object:
        """Graph-shaped batches only: every request a tree of the state's node count."""
        if not isinstance(state, TreeGraphState):
            return self.base.graph_plan(state, batch)
        if any(k <= q for k, q in zip(batch.kv_lens, batch.q_lens)):  # a padding chain with no prefix: give it one
            raise ValueError("decode-mode tree graphs need a cached prefix for every request")
        self.base.plan_prefix(*self._node_rows(batch), state=state.plan.prefix)
        index, valid = self._own_keys(batch)
        state.plan.out_slots.copy_(batch.out_slots, non_blocking=True)
        state.plan.own_rows.copy_(index, non_blocking=True)
        state.plan.own_valid.copy_(valid, non_blocking=True)
        return state.plan
