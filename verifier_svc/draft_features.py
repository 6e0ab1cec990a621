"""The target's states a hidden-state drafter (EAGLE, EAGLE-3, MTP) gets with the tokens (REFERENCES §1.4: token
t[p+1] pairs with h[p]): a prompt chunk's pairs as the chunk is computed, and each step's accepted path's states."""

from __future__ import annotations

import torch

from splitspec.verifier_svc.step_types import Chunk, Request


def pair_prompt_states(request: Request, chunk: Chunk, hidden: torch.Tensor) -> torch.Tensor | None:
    """Record (prompt token p+1, hidden state p) for the chunk's positions not recorded before; the
    state of the prompt's last position is returned, to pair with the first output token."""
    start = max(chunk.start, request.hidden_upto)
    last = request.fill_len - 1
    inner_end = min(chunk.end, last)
    if start < inner_end:
        request.unsent.extend(request.prompt_ids[start + 1 : inner_end + 1])
        request.unsent_hidden.append(hidden[start - chunk.start : inner_end - chunk.start].clone())
    request.hidden_upto = max(request.hidden_upto, chunk.end)
    return hidden[last - chunk.start :][:1].clone() if chunk.end == request.fill_len else None  # not a view of the step


def path_states(accepted: list, features) -> dict:
    """The accepted paths' states of the requests that speculate, to pair with the emitted tokens: every request's
    rows in one gather, each request keeping a slice of that step-sized copy (not of the whole forward's)."""
    picks = [(v.request.request_id, [row + node for node in acceptance.path]) for v, acceptance, _, row in accepted
             if v.request.speculate]
    if not picks:
        return {}
    flat = [r for _, request_rows in picks for r in request_rows]
    gathered = features.index_select(0, torch.tensor(flat, device=features.device))
    states, start = {}, 0
    for request_id, request_rows in picks:
        states[request_id] = gathered[start : start + len(request_rows)]
        start += len(request_rows)
    return states
