"""Steps 1..S-1 of the beam draft shared by STANDALONE and EAGLE-style heads.

A drafter's steps run in runtime.draft_loop (on the device, one CUDA graph per batch size). A draft model
with sliding-window layers, which the loop's cascade attention does not cover, drafts on the host with
runtime.tree.BeamDraft, the reference: each step forwards, for every request in one batch, all beam nodes
made so far after the request's committed KV under their forest mask (S*(S-1)/2*K extra rows), and the
beam nodes' KV is dropped after the step.
"""

from __future__ import annotations

import logging
import os

import torch

from splitspec.runtime.batch import SequenceInput
from splitspec.runtime.draft_loop import DraftLoop
from splitspec.runtime.kv_cache import BlockTable
from splitspec.runtime.runner import ModelRunner
from splitspec.runtime.tree import NO_NODE, BeamDraft, DraftTree, batched_topk

logger = logging.getLogger(__name__)


def draft_loop_for(runner: ModelRunner, topk: int, num_steps: int, num_draft_tokens: int,
                   token_map: torch.Tensor | None, feature_size: int = 0) -> DraftLoop | None:
    """The device loop for this draft model, or None (sliding windows: the host reference drafts;
    SPLITSPEC_DRAFT_LOOP=host forces the reference, to compare the two)."""
    if os.environ.get("SPLITSPEC_DRAFT_LOOP") == "host":
        return None
    if any(w is not None for w in runner.config.sliding_windows):
        logger.info("the draft model has sliding-window layers: its beam steps run on the host")
        return None
    return DraftLoop(runner, topk, num_steps, num_draft_tokens, token_map, feature_size)


def host_beam_draft(runner: ModelRunner, roots: list[int], root_logits: torch.Tensor, tables: list[BlockTable],
                    budgets: list[int], shape, root_features: list[torch.Tensor] | None = None) -> list[DraftTree]:
    """BeamDraft for each request (shape: its topk, num_steps, num_draft_tokens, token_map)."""
    top_p, top_idx = batched_topk(root_logits, shape.topk)
    beams = []
    for row, (root, budget) in enumerate(zip(roots, budgets)):
        beam = BeamDraft(root, shape.topk, shape.num_steps, budget, shape.token_map)
        beam.first_topk(top_p[row], top_idx[row])
        beams.append(beam)
    expand_beams(runner, beams, tables, root_features)
    return [beam.tree() for beam in beams]


def expand_beams(runner: ModelRunner, beams: list[BeamDraft], tables: list[BlockTable],
                 root_features: list[torch.Tensor] | None = None) -> None:
    """Run every beam search to its last step. root_features (EAGLE heads): each request's feature for
    the root's children; a deeper node gets its parent's output, so the head's outputs are kept."""
    kv = runner.kv_cache
    outputs: list[list[torch.Tensor]] = [[] for _ in beams]
    while beams[0].beams() is not None:  # every request has the same number of steps
        sequences, features, frontiers = [], [], []
        for k, (beam, table) in enumerate(zip(beams, tables)):
            tokens, depths, mask = beam.layout()
            mask = mask if len(tokens) > 1 else None
            sequences.append(SequenceInput(table, tokens, [table.num_tokens - 1 + d for d in depths], mask, "all"))
            if root_features is not None:
                features += [root_features[k] if p == NO_NODE else outputs[k][p] for p in beam.beam_parents]
            frontiers.append(beam.beams())
        batch = runner.batch(sequences)
        output = runner.forward(batch, return_hidden=root_features is not None,
                                features=torch.stack(features) if root_features is not None else None)
        # every request's frontier rows: one softmax + top-k and one transfer for the whole batch
        picked = [batch.cu_logits[k] + f for k, frontier in enumerate(frontiers) for f in frontier]
        top_p, top_idx = batched_topk(output.logits[torch.tensor(picked, device=output.logits.device)],
                                      beams[0].topk)
        start, row = 0, 0
        for k, (beam, table) in enumerate(zip(beams, tables)):
            n = len(beam.beam_tokens)
            kv.set_length(table, table.num_tokens)  # drop the beam nodes' KV
            if root_features is not None:
                outputs[k] = list(output.hidden_states[start : start + n])
            width = len(frontiers[k])
            beam.expand_topk(top_p[row : row + width], top_idx[row : row + width])
            start, row = start + n, row + width
