"""Frequency, presence and repetition penalties on the target's logits, as vLLM applies them, for
every node of a draft tree at once.

A node's logits predict the token after the node, so its context is the request's output so far plus
the draft tokens on its path from the root (the root itself is the last output token, already in the
output). Penalising each node with its own path keeps verification lossless: a path is accepted only
where each draft equals the token the penalised target picks given everything before it, which is what
plain decoding with the same penalties would produce (vLLM's golden vectors, REFERENCES §4, check that
tokens accepted earlier in a row count).

Order (vLLM `apply_penalties`): the repetition penalty first, on tokens seen in the prompt or the output
(positive logits divided by it, others multiplied), then `logits -= frequency * count + presence * (count > 0)`
with counts over the output only; then OpenAI's logit_bias is added (a bias is the same at every node).
"""

from __future__ import annotations

import torch

from splitspec.runtime.batch import device_tensor
from splitspec.runtime.sampling_params import SamplingParams


def path_tokens(parents: list[int], tokens: list[int]) -> list[list[int]]:
    """For each node, the draft tokens from the root's child down to the node itself (empty for the root)."""
    paths: list[list[int]] = []
    for i, parent in enumerate(parents):
        paths.append([] if parent < 0 else paths[parent] + [tokens[i]])
    return paths


def _bincount(ids: list[int], vocab: int, device) -> torch.Tensor:
    return torch.bincount(device_tensor(ids, device), minlength=vocab)[:vocab]


class PenaltyCounts:
    """One request's output-token counts and prompt-token presence on the device, brought up to date with the
    tokens appended since the last step: a step then costs its new tokens, not the whole output (and prompt) again,
    which grew with every step of a long request. Outputs only ever grow (a preempted request keeps its own)."""

    def __init__(self):
        self.output: torch.Tensor | None = None  # [V] float: how often each token is in the output so far
        self.counted = 0  # output tokens in it
        self.prompt: torch.Tensor | None = None  # [V] bool: the tokens in the prompt

    def output_counts(self, output_ids: list[int], vocab: int, device) -> torch.Tensor:
        if self.output is None:
            self.output = torch.zeros(vocab, device=device)
        if len(output_ids) > self.counted:
            self.output += _bincount(output_ids[self.counted :], vocab, device).float()
            self.counted = len(output_ids)
        return self.output

    def prompt_seen(self, prompt_ids: list[int], vocab: int, device) -> torch.Tensor:
        if self.prompt is None:
            self.prompt = _bincount(prompt_ids, vocab, device) > 0
        return self.prompt


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int],
                    paths: list[list[int]] | None = None, running: PenaltyCounts | None = None) -> torch.Tensor:
    """logits [N, V] for N positions of one request -> penalised copy (float32). paths[i]: tokens
    after output_ids in row i's context (None: none for every row). running: the request's counts kept across its
    steps (else counted here from the ids)."""
    if not params.has_penalties:
        return logits
    rows, vocab = logits.shape
    device = logits.device
    logits = logits.float().clone()
    if running is not None:
        counts = running.output_counts(output_ids, vocab, device)[None, :].repeat(rows, 1)
    else:
        counts = torch.zeros(rows, vocab, device=device)
        if output_ids:
            counts += _bincount(output_ids, vocab, device).float()
    if paths and any(paths):
        index = [(r, t) for r, path in enumerate(paths) for t in path]
        r, t = device_tensor(index, device).T
        counts.index_put_((r, t), torch.ones(len(index), device=device), accumulate=True)
    if params.repetition_penalty != 1.0:
        seen = counts > 0
        if prompt_ids:
            seen |= (running.prompt_seen(prompt_ids, vocab, device) if running is not None
                     else _bincount(prompt_ids, vocab, device) > 0)[None, :]
        factor = torch.where(seen, params.repetition_penalty, 1.0)
        logits = torch.where(logits > 0, logits / factor, logits * factor)
    if params.frequency_penalty:
        logits -= params.frequency_penalty * counts
    if params.presence_penalty:
        logits -= params.presence_penalty * (counts > 0).float()
    if params.logit_bias:  # OpenAI's logit_bias, after the penalties (ids past this vocabulary are the verifier's to refuse)
        ids = device_tensor([t for t, _ in params.logit_bias], device)
        logits[:, ids] += device_tensor([b for _, b in params.logit_bias], device, logits.dtype)
    if params.min_tokens and params.min_tokens_ban:  # rows at output positions before min_tokens: no stop token
        positions = [len(output_ids) + (len(paths[r]) if paths else 0) for r in range(rows)]
        early = [r for r, position in enumerate(positions) if position < params.min_tokens]
        if early:
            ban = device_tensor([t for t in params.min_tokens_ban if t < vocab], device, torch.long)
            logits[device_tensor(early, device)[:, None], ban[None, :]] = float("-inf")
    return logits
