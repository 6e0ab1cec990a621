"""Multi-layer MTP (--enable-multi-layer-eagle): draft step i runs MTP layer i of a target that ships
several (SGLang's multi_layer_eagle_worker). The draft is a chain (top-1 per step), as in SGLang.

Every layer reads the *target's* hidden states; layer i at position p takes the token i steps further
on, t[p+1+i], with h[p]. For a request whose sequence is t[0..n] (t[n] the root, h[0..n-1] known):

    layer 0  rows p < n: (t[p+1], h[p])      its last row predicts d1 = t[n+1]
    layer 1  rows p < n: (t[p+2], h[p])      with t[n+1] = d1, so its last row predicts d2
    ...
    layer i  rows p < n: (t[p+1+i], h[p])    the last i rows hold drafts

All layers share one page table. Rows p < n-S (S layers used) hold only verified tokens in every layer
and stay in the KV cache; the last S rows are recomputed at the next call, once the verifier has said
which drafts were right.
"""

from __future__ import annotations

import torch

from splitspec.drafter_svc.base import HiddenStateDrafter
from splitspec.runtime.batch import SequenceInput
from splitspec.runtime.inference import inference
from splitspec.runtime.kv_cache import BlockTable
from splitspec.runtime.runner import ModelRunner
from splitspec.runtime.tree import DraftTree


class _State:
    __slots__ = ("tokens", "hidden", "hidden_start", "table")

    def __init__(self, first_token: int):
        self.tokens = [first_token]  # the whole sequence t[0..n]
        self.hidden: list[torch.Tensor] = []  # h[hidden_start..n-1] in blocks
        self.hidden_start = 0
        self.table = BlockTable()

    def add(self, tokens: list[int], hidden: torch.Tensor) -> None:
        self.tokens.extend(tokens)
        self.hidden.append(hidden)

    def states(self, start: int, end: int) -> torch.Tensor:
        if len(self.hidden) > 1:
            self.hidden = [torch.cat(self.hidden)]
        return self.hidden[0][start - self.hidden_start : end - self.hidden_start]

    def forget_states_before(self, position: int) -> None:
        if position > self.hidden_start and self.hidden:
            self.hidden = [self.states(position, len(self.tokens) - 1).clone()]
            self.hidden_start = position


class MultiLayerMtpDrafter(HiddenStateDrafter):
    name = "EAGLE"
    state_class = _State

    def __init__(self, runner: ModelRunner, num_steps: int, token_map: torch.Tensor | None = None):
        num_layers = runner.config.num_hidden_layers
        if not 1 <= num_steps <= num_layers:
            raise ValueError(f"--enable-multi-layer-eagle runs MTP layer i at step i: --speculative-num-steps "
                             f"{num_steps} needs as many MTP layers, the target ships {num_layers}")
        self.runner, self.num_steps, self.token_map = runner, num_steps, token_map
        self.max_catch_up = 2048  # verified rows per forward when catching up (all requests together)
        self.states: dict[str, _State] = {}

    def _forward_layers(self, work: list[tuple[_State, int, list[int]]], num_layers: int) -> list[list[int]]:
        """work: (state, end row, drafts so far) per request: rows [table.num_tokens, end) through layers
        0..num_layers-1; returns each request's drafts extended by every layer's last-row top-1."""
        drafts = [list(d) for _, _, d in work]
        for layer in range(num_layers):
            sequences, features = [], []
            for (s, end, _), d in zip(work, drafts):
                start = s.table.num_tokens
                tokens = (s.tokens + d)[start + 1 + layer : end + 1 + layer]
                sequences.append(SequenceInput(s.table, tokens, logits="last"))
                features.append(s.states(start, end))
            output = self.runner.forward_padded(sequences, torch.cat(features), graphs=False, draft_layer=layer)
            for row, ((s, end, _), d) in enumerate(zip(work, drafts)):
                if end == len(s.tokens) - 1 and len(d) == layer:  # the last row is the root's: a draft
                    index = int(output.logits[row].argmax())
                    d.append(index if self.token_map is None else int(self.token_map[index]))
        return drafts

    def _keep(self, s: _State) -> int:
        """Rows kept in the KV cache after a call: p < n - S hold verified tokens in every layer (p = n - S
        does too, but keeping one row fewer means a repeated ask still has the root row to compute)."""
        return max(0, len(s.tokens) - 1 - self.num_steps)

    @inference
    def draft(self, request_ids: list[str], max_nodes: list[int]) -> list[DraftTree | None]:
        """Asks with a budget below 2 (the verifier feeding a prompt chunk by chunk) only catch up on their
        verified rows, so that a long prompt is not all computed at its first real ask."""
        out: list[DraftTree | None] = [None] * len(request_ids)
        kv = self.runner.kv_cache
        given = [(i, self.states[r], b) for i, (r, b) in enumerate(zip(request_ids, max_nodes))
                 if len(self.states[r].tokens) >= 2]  # a first token alone has no state to draft from yet
        asked = [(i, s, min(self.num_steps, b - 1)) for i, s, b in given if b >= 2]
        steps = self.num_steps
        # verified rows in rounds of at most max_catch_up rows in all, oldest asks first, through every layer,
        # committed: all of them for a feed; for the asks, until what is left of their backlogs together fits one
        # round (it goes with the draft pass below): a wave of prompts asked at once never makes one forward of all
        while True:
            rounds, room = [], self.max_catch_up
            backlogs = [(s, self._keep(s) - s.table.num_tokens, b) for _, s, b in given]
            asks_left = sum(n for _, n, b in backlogs if b >= 2 and n > 0)
            for s, backlog, b in backlogs:
                if backlog <= 0 or (b >= 2 and asks_left <= self.max_catch_up):
                    continue
                take = min(backlog, room)
                rounds.append((s, s.table.num_tokens + take, []))
                room -= take
                asks_left -= take if b >= 2 else 0
                if room == 0:
                    break
            if not rounds:
                break
            self._forward_layers(rounds, steps)
            for s, end, _ in rounds:
                kv.set_length(s.table, end)
                s.forget_states_before(end)
        if not asked:
            return out
        for _, s, _ in asked:  # rows past the verified ones hold last call's drafts: recompute them
            kv.set_length(s.table, min(s.table.num_tokens, self._keep(s)))
        work = [(s, len(s.tokens) - 1, []) for _, s, _ in asked]
        drafts = self._forward_layers(work, steps)
        for (i, s, depth), d in zip(asked, drafts):
            keep = self._keep(s)
            kv.set_length(s.table, keep)
            s.forget_states_before(keep)
            out[i] = DraftTree.chain(s.tokens[-1], d[:depth])
        return out
