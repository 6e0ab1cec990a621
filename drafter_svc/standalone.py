"""STANDALONE: a small causal LM sharing the target's tokenizer drafts trees (SGLang's algorithm name).

The draft model has its own paged KV cache. Per request it holds the sequence the verifier reported;
its KV holds a prefix of it. A draft call, for all asked requests in one batch:

    1. catch up   forward every reported token not yet in the draft KV, the root last (committed)
    2. steps      runtime.draft_loop: the root's distribution -> top-K beams, steps 1..S-1 on the device,
                  the best N-1 candidates by probability product (SGLang's organize step)
"""

from __future__ import annotations

import logging

import torch

from splitspec.drafter_svc.base import Drafter
from splitspec.drafter_svc.beam_steps import draft_loop_for, host_beam_draft
from splitspec.runtime.batch import SequenceInput
from splitspec.runtime.kv_cache import BlockTable
from splitspec.runtime.runner import ModelRunner
from splitspec.runtime.tree import DraftTree

logger = logging.getLogger(__name__)


class StandaloneDrafter(Drafter):
    name = "STANDALONE"

    def __init__(self, runner: ModelRunner, topk: int, num_steps: int, num_draft_tokens: int,
                 token_map: torch.Tensor | None = None):
        """token_map (FR-Spec, --speculative-token-map): draft over these target ids only (the runner's
        head must already be cut to them)."""
        self.runner, self.topk, self.num_steps, self.num_draft_tokens = runner, topk, num_steps, num_draft_tokens
        self.token_map = token_map
        self.sequences: dict[str, list[int]] = {}
        self.tables: dict[str, BlockTable] = {}
        self.loop = draft_loop_for(runner, topk, num_steps, num_draft_tokens, token_map)

    @property
    def vocab_size(self) -> int:
        return self.runner.config.vocab_size

    def open(self, request_id: str, prompt_ids: list[int]) -> None:
        self.release(request_id)
        self.sequences[request_id] = list(prompt_ids)
        self.tables[request_id] = BlockTable()

    def extend(self, request_id: str, tokens: list[int]) -> None:
        self.sequences[request_id].extend(tokens)

    def release(self, request_id: str) -> None:
        table = self.tables.pop(request_id, None)
        if table is not None:
            self.runner.kv_cache.release(table)
        self.sequences.pop(request_id, None)

    @torch.inference_mode()
    def draft(self, request_ids: list[str], max_nodes: list[int]) -> list[DraftTree | None]:
        asked = [(i, r, min(self.num_draft_tokens, budget)) for i, (r, budget) in enumerate(zip(request_ids, max_nodes))
                 if budget >= 2]
        out: list[DraftTree | None] = [None] * len(request_ids)
        if not asked:
            return out
        kv = self.runner.kv_cache
        catch_up = []
        for _, request_id, _ in asked:
            sequence, table = self.sequences[request_id], self.tables[request_id]
            if table.num_tokens >= len(sequence):  # asked again with nothing new: recompute the root
                kv.set_length(table, len(sequence) - 1)
            catch_up.append(SequenceInput(table, sequence[table.num_tokens :], logits="last"))
        logits = self.runner.forward(self.runner.batch(catch_up)).logits
        roots, tables = [], []
        for _, request_id, _ in asked:
            kv.set_length(self.tables[request_id], len(self.sequences[request_id]))
            roots.append(self.sequences[request_id][-1])
            tables.append(self.tables[request_id])
        budgets = [b for _, _, b in asked]
        if self.loop is not None:
            trees = self.loop.run(roots, logits[: len(asked)], None, tables, budgets)
        else:
            trees = host_beam_draft(self.runner, roots, logits[: len(asked)], tables, budgets, self)
        for (i, _, _), tree in zip(asked, trees):
            out[i] = tree
        return out
