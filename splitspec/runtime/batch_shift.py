"""A step's batch built before its lengths reach the host: each request moved back on the device.

A drafted step whose next verification is launched before the host has read this one's acceptance (the device-fed
step loop) knows each request's length after acceptance only on the device. The host builds that batch at each
request's upper length (every draft accepted: the pages reserved up to there, its arena and page table holding them)
and hands the forward a shift [num_requests] (<= 0, on the device): request i's new tokens sit shift[i] slots before
where they were built. The forward moves their positions, KV slots and key counts by it where it runs:

    a captured graph (its attention by kernels.paged_attention: paged_graphs)
        after the plan's copies, one kernel (kernels.shift_paged_inputs) on the graph's static inputs: the key counts
        its attention reads, the positions, and the slots each new token's K/V is written to (from the arena's page
        ids); no wait
    anything else (an eager forward, FlashInfer's planned graphs)
        the shift read to the host (a wait for the device) and the batch's host inputs moved by it

A tree's node j is written at slot (key count - q + j) and rotated at position (length + its depth): both move by the
same shift, so a tree's shape is the host's. Padding requests (a graph's dummies) are never moved.
"""

from __future__ import annotations

import dataclasses

import torch

from splitspec import kernels
from splitspec.runtime.batch import device_tensor
from splitspec.runtime.host_tensors import host_tensor
from splitspec.runtime.kv_cache import slot_list


def settle_on_host(batch, page_size: int) -> None:
    """The batch's own inputs moved by its shift, read to the host (for a forward that plans on the host: an eager one,
    FlashInfer's graphs); the shift is spent. Its device ids (written there: drafts, roots) are kept."""
    shift, batch.shift = batch.shift.tolist(), None
    attention = batch.attention
    if any(s > 0 for s in shift):
        raise ValueError(f"a batch moved forward ({shift}): it was built at each request's upper length")
    if not any(shift):
        return
    rows = [s for s, q in zip(shift, attention.q_lens) for _ in range(q)]
    positions = batch.host_positions + host_tensor(rows)
    kv_lens = [k + s for k, s in zip(attention.kv_lens, shift)]
    slots = [slot for q, k, pages in zip(attention.q_lens, kv_lens, attention.page_tables)
             for slot in slot_list(pages, page_size, k - q, k)]
    batch.attention = dataclasses.replace(attention, kv_lens=kv_lens, positions=positions, out_slots=host_tensor(slots))
    batch.host_positions, batch._positions = positions, None


def shift_graph_inputs(state, positions: torch.Tensor, num_requests: int, q: int, shift: torch.Tensor,
                       page_size: int) -> None:
    """A paged graph's static inputs, planned for the batch at its upper lengths, moved by shift [num_requests] on the
    device, in one kernel: its key counts, positions [rows] and K/V slots (state: a GraphState whose plan attends by
    kernels.paged_attention, its arena holding every page up to the upper lengths)."""
    arena, r = state.plan.paged.arena, num_requests
    kernels.shift_paged_inputs(shift, arena.view("kv_lens")[:r], positions, arena.view("kv_indptr"), arena.view("ids"),
                               state.out_slots, q, page_size)


def batch_at(runner, sequences: list, lengths: list[int], verified: torch.Tensor | None = None):
    """runner.batch(sequences) built as if each sequence's table held lengths[i] tokens (its pages reserved that far;
    its committed length left as it was), and moved back on the device to the lengths verified [B] when given."""
    tables = [s.table for s in sequences]
    committed = [t.num_tokens for t in tables]
    try:
        for table, length in zip(tables, lengths):
            table.num_tokens = length
        batch = runner.batch(sequences)
    finally:
        for table, length in zip(tables, committed):
            table.num_tokens = length
    if verified is not None:
        batch.shift_back(verified - device_tensor(lengths, verified.device))
    return batch


def shiftable(state) -> bool:
    """Whether a captured graph's inputs can be moved on the device: its attention reads the arena's key counts as it
    runs (kernels.paged_attention); FlashInfer's graphs plan their work split from the host's."""
    plan = getattr(state, "plan", None)
    return getattr(plan, "paged", None) is not None
