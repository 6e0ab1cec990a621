"""STANDALONE: a small causal LM sharing the target's tokenizer drafts trees (SGLang's algorithm name).

The draft model has its own paged KV cache. Per request it holds the sequence the verifier reported;
its KV holds a prefix of it. A draft call, for all asked requests in one batch:

    1. catch up   forward every reported token not yet in the draft KV, the root last (committed)
    2. step 0     the root's distribution -> top-K beams (runtime.tree.BeamDraft)
    3. step 1..S-1 forward all beam nodes made so far after the committed sequence, each under the mask
                  of its own ancestors (positions root + depth); expand from the newest beams' rows;
                  the beam nodes' KV is dropped after the step (the sequence is not committed past the root)
    4. the tree   the best N-1 candidates by probability product (SGLang's organize step)

Re-running the earlier beam nodes each step costs S*(S-1)/2*K extra token rows, cheap next to a draft
model's per-forward overhead at these sizes, and needs no KV bookkeeping for discarded beams.
"""

from __future__ import annotations

import logging

import torch

from splitspec.drafter_svc.base import Drafter
from splitspec.runtime.batch import SequenceInput
from splitspec.runtime.kv_cache import BlockTable
from splitspec.runtime.runner import ModelRunner
from splitspec.runtime.tree import NO_NODE, BeamDraft, DraftTree

logger = logging.getLogger(__name__)


def forest_mask(parents: list[int]) -> torch.Tensor:
    """[n, n] bool: node i sees itself and its ancestors; parents[i] = -1 means a child of the root
    (which sits in the committed KV before these nodes)."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j != NO_NODE:
            mask[i, j] = True
            j = parents[j]
    return mask


def forest_depths(parents: list[int]) -> list[int]:
    depths: list[int] = []
    for p in parents:  # parents come before children
        depths.append(1 if p == NO_NODE else depths[p] + 1)
    return depths


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
        beams = []
        for row, (_, request_id, budget) in enumerate(asked):
            kv.set_length(self.tables[request_id], len(self.sequences[request_id]))
            beam = BeamDraft(self.sequences[request_id][-1], self.topk, self.num_steps, budget, self.token_map)
            beam.first(torch.softmax(logits[row].float(), -1))
            beams.append(beam)
        while beams[0].beams() is not None:  # every request has the same number of steps
            sequences, frontiers = [], []
            for (_, request_id, _), beam in zip(asked, beams):
                root_position = len(self.sequences[request_id]) - 1
                depths = forest_depths(beam.beam_parents)
                sequences.append(SequenceInput(self.tables[request_id], list(beam.beam_tokens),
                                               [root_position + d for d in depths], forest_mask(beam.beam_parents), "all"))
                frontiers.append(beam.beams())
            batch = self.runner.batch(sequences)
            logits = self.runner.forward(batch).logits
            for i, ((_, request_id, _), beam) in enumerate(zip(asked, beams)):
                kv.set_length(self.tables[request_id], len(self.sequences[request_id]))  # drop the beam nodes' KV
                rows = logits[batch.cu_logits[i] : batch.cu_logits[i + 1]][frontiers[i]]
                beam.expand(torch.softmax(rows.float(), -1))
        for (i, _, _), beam in zip(asked, beams):
            out[i] = beam.tree()
        return out
