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
from splitspec.drafter_svc.beam_steps import ModelBets, beam_trees, draft_loop_for, launch_beam_draft
from splitspec.runtime.inference import inference
from splitspec.runtime.launched_draft import LaunchedDraft
from splitspec.runtime.batch import SequenceInput
from splitspec.runtime.kv_cache import BlockTable
from splitspec.runtime.runner import ModelRunner
from splitspec.runtime.tree import DraftTree

logger = logging.getLogger(__name__)


class StandaloneDrafter(ModelBets, Drafter):
    name = "STANDALONE"
    takes_guides = True  # a constrained request drafts on the host, its candidates masked to its grammar

    def __init__(self, runner: ModelRunner, topk: int, num_steps: int, num_draft_tokens: int,
                 token_map: torch.Tensor | None = None):
        """token_map (FR-Spec, --speculative-token-map): draft over these target ids only (the runner's
        head must already be cut to them)."""
        self.runner, self.topk, self.num_steps, self.num_draft_tokens = runner, topk, num_steps, num_draft_tokens
        self.token_map = token_map
        self.sequences: dict[str, list[int]] = {}
        self.tables: dict[str, BlockTable] = {}
        self.current, self.bets = {}, {}  # overlap (beam_steps.ModelBets)
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
        self._forget_bets(request_id)

    def _catch_up(self, request_ids: list[str]) -> torch.Tensor:
        """Forward every reported token not yet in the draft KV, the root last, for all requests in one batch:
        the roots' logits [n, V]."""
        kv = self.runner.kv_cache
        catch_up = []
        for request_id in request_ids:
            sequence, table = self.sequences[request_id], self.tables[request_id]
            if table.num_tokens >= len(sequence):  # asked again with nothing new: recompute the root
                kv.set_length(table, len(sequence) - 1)
            catch_up.append(SequenceInput(table, sequence[table.num_tokens :], logits="last"))
        logits = self.runner.forward_padded(catch_up).logits  # any count of rows: a ladder size on a GPU
        for request_id in request_ids:
            kv.set_length(self.tables[request_id], len(self.sequences[request_id]))
        return logits[: len(request_ids)]

    def _bet_roots(self, request_ids: list[str]):
        logits = self._catch_up(request_ids)
        return [(self.tables[r], logits[k], None) for k, r in enumerate(request_ids)]

    def _asked(self, request_ids: list[str], max_nodes: list[int]) -> list[tuple[int, str, int]]:
        """(index, request, budget) of the requests that draft a tree (a budget of 2 or more, at most the tree's)."""
        return [(i, r, min(self.num_draft_tokens, budget)) for i, (r, budget) in enumerate(zip(request_ids, max_nodes))
                if budget >= 2]

    @inference
    def draft(self, request_ids: list[str], max_nodes: list[int], guides: list | None = None) -> list[DraftTree | None]:
        """guides: as EagleDrafter.draft's."""
        asked = self._asked(request_ids, max_nodes)
        out: list[DraftTree | None] = [None] * len(request_ids)
        if not asked:
            return out
        ids = [r for _, r, _ in asked]
        logits = self._catch_up(ids)
        roots = [self.sequences[r][-1] for r in ids]
        tables = [self.tables[r] for r in ids]
        budgets = [b for _, _, b in asked]
        trees = beam_trees(self, ids, roots, logits, tables, budgets, None, [guides[i] for i, _, _ in asked] if guides else None)
        for (i, _, _), tree in zip(asked, trees):
            out[i] = tree
        return out

    @inference
    def launch(self, request_ids: list[str], max_nodes: list[int]) -> LaunchedDraft:
        """draft() queued on the device (as EagleDrafter.launch)."""
        asked = self._asked(request_ids, max_nodes)
        if self.loop is None or not asked:
            return LaunchedDraft.ready(self.draft(request_ids, max_nodes))
        ids = [r for _, r, _ in asked]
        logits = self._catch_up(ids)
        return launch_beam_draft(self, len(request_ids), [i for i, _, _ in asked], ids, [self.sequences[r][-1] for r in ids],
                                 logits, [self.tables[r] for r in ids], [b for _, _, b in asked], None)
