"""The draft-model side of runtime.tree.BeamDraft, shared by STANDALONE and EAGLE: steps 1..S-1.

Each step forwards, for every request in one batch, all beam nodes made so far after the request's
committed KV (its last row is the root: the nodes sit at root + depth, under their forest mask), takes
the rows of the newest beams and expands them; the beam nodes' KV is dropped after the step.
Re-running the earlier nodes costs S*(S-1)/2*K extra rows, cheap next to a draft model's per-forward
overhead at these sizes, and needs no KV bookkeeping for discarded beams.
"""

from __future__ import annotations

import torch

from splitspec.runtime.batch import SequenceInput
from splitspec.runtime.kv_cache import BlockTable
from splitspec.runtime.runner import ModelRunner
from splitspec.runtime.tree import NO_NODE, BeamDraft, batched_topk


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
            mask = mask if len(tokens) > 1 else None  # one node: a plain decode row (the graphs' q = 1 shape)
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
