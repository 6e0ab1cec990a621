"""The target's states a hidden-state drafter (EAGLE, EAGLE-3, MTP) gets with the tokens (REFERENCES §1.4: token
t[p+1] pairs with h[p]): a prompt chunk's pairs as the chunk is computed, and each step's accepted path's states.

A request keeps its unsent states as StateRows (rows of one step's gathered states, not sliced out per request), and
the states of every request asked in a step are cut out together when they are sent (`unsent_states`): a few tensor
ops per feed, not several per request per step. With drafting off, an overlapped run of steps keeps its states per step
(`RunStates`) and hands each request one StateRows of them when the run ends or feeds: no per-request work per step."""

from __future__ import annotations

from typing import NamedTuple

import torch

from splitspec.runtime.batch import device_tensor
from splitspec.verifier_svc.step_types import Chunk, Request


class StateRows(NamedTuple):
    """count rows of source from start: states a request has not sent yet."""

    source: torch.Tensor
    start: int
    count: int

    def first(self, count: int) -> "StateRows":
        return self if count >= self.count else StateRows(self.source, self.start, count)


class RunStates:
    """The states of an overlapped run of drafting-off steps (overlap.py): one [B, W] tensor per landed step, row i
    request i's (a run keeps one batch in one order: the schedule continues it only then). flush() hands every request
    still running its rows of the whole run as one StateRows of the steps stacked: one tensor op per run (or feed),
    where a StateRows per request per step, and a gather of them at each feed, cost ~8 us a request a step (the demo
    pair at batch 64 on a 2-core CPU; 8.25 against 7.17 ms per step for the 8B-shaped target at batch 128 on an H200,
    e93a9ff). Flushed before anything else adds states to those requests (the run's end) or sends them (a feed)."""

    __slots__ = ("steps", "requests")

    def __init__(self):
        self.steps: list[torch.Tensor] = []
        self.requests: list[Request] = []

    def add(self, features: torch.Tensor, requests: list[Request]) -> None:
        if not self.steps:
            self.requests = requests
        self.steps.append(features)

    def flush(self) -> None:
        if not self.steps:
            return
        steps, requests = self.steps, self.requests
        self.steps, self.requests = [], []
        count = len(steps)
        joined = steps[0] if count == 1 else torch.stack(steps, 1).reshape(-1, steps[0].shape[-1])
        for i, request in enumerate(requests):  # one that ended during the run is never fed
            if request.speculate and request.finish_reason is None:
                request.unsent_hidden.append(StateRows(joined, i * count, count))


def _contiguous(blocks: list[list[StateRows]]) -> torch.Tensor | None:
    """The rows of one source that every request's blocks read in order, each right after the one before (a flushed
    run fed whole, or one step's accepted paths): a view, no gather; else None."""
    source, first, at = None, 0, 0
    for request_blocks in blocks:
        for block in request_blocks:
            if source is None:
                source, first, at = block.source, block.start, block.start
            if block.source is not source or block.start != at:
                return None
            at += block.count
    return None if source is None else source[first:at]


def unsent_states(blocks: list[list[StateRows]]) -> list[torch.Tensor | None]:
    """Each request's unsent states as one tensor [rows, W] (None for none), for all the requests at once: the
    rows of one source read in order are a view of it; else the distinct sources joined, every request's rows picked
    in one gather; then split (views)."""
    counts = [sum(block.count for block in request_blocks) for request_blocks in blocks]
    picked = _contiguous(blocks)
    if picked is None:
        sources, offsets, index, total = [], {}, [], 0
        for request_blocks in blocks:
            for block in request_blocks:
                key = id(block.source)
                if key not in offsets:
                    offsets[key], total = total, total + block.source.shape[0]
                    sources.append(block.source)
                first = offsets[key] + block.start
                index.extend(range(first, first + block.count))
        if not index:
            return [None] * len(blocks)
        joined = sources[0] if len(sources) == 1 else torch.cat(sources)
        if len(index) == joined.shape[0] and index == list(range(len(index))):
            picked = joined  # every row of the sources, in order: no gather
        else:
            picked = joined.index_select(0, device_tensor(index, joined.device))
    parts = iter(torch.split(picked, [c for c in counts if c]))
    return [next(parts) if c else None for c in counts]


def pair_prompt_states(request: Request, chunk: Chunk, hidden: torch.Tensor) -> torch.Tensor | None:
    """Record (prompt token p+1, hidden state p) for the chunk's positions not recorded before; the
    state of the prompt's last position is returned, to pair with the first output token."""
    start = max(chunk.start, request.hidden_upto)
    last = request.fill_len - 1
    inner_end = min(chunk.end, last)
    if start < inner_end:
        request.unsent.extend(request.prompt_ids[start + 1 : inner_end + 1])
        # copies: a view would keep the whole forward's states alive until the request's next feed
        request.unsent_hidden.append(StateRows(hidden[start - chunk.start : inner_end - chunk.start].clone(), 0,
                                               inner_end - start))
    request.hidden_upto = max(request.hidden_upto, chunk.end)
    return StateRows(hidden[last - chunk.start :][:1].clone(), 0, 1) if chunk.end == request.fill_len else None


def path_states(accepted: list, features) -> dict:
    """The accepted paths' states of the requests that speculate, to pair with the emitted tokens: every request's
    rows in one gather (a step-sized copy, not the whole forward's; the forward's own when those are all its rows),
    each request keeping its StateRows of it. features is the forward's own tensor (never a graph's static buffer)."""
    picks = [(v.request.request_id, [row + node for node in acceptance.path]) for v, acceptance, _, row in accepted
             if v.request.speculate]
    if not picks:
        return {}
    flat = [r for _, request_rows in picks for r in request_rows]
    if len(flat) == features.shape[0] and flat == list(range(len(flat))):
        gathered = features  # every row, in order (decoding alone, each request a root or its accepted chain)
    else:
        gathered = features.index_select(0, device_tensor(flat, features.device))
    states, start = {}, 0
    for request_id, request_rows in picks:
        states[request_id] = StateRows(gathered, start, len(request_rows))
        start += len(request_rows)
    return states
