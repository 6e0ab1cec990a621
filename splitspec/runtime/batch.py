"""From per-request inputs to one flat forward batch.

Each request contributes `input_ids` new tokens appended after its committed KV. Positions default
to consecutive ones; a draft tree passes its own (root position + depth) and its tree mask. Building
a batch reserves the KV pages the new tokens need; committing (`KVCache.set_length`) is the caller's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitspec.runtime.attention.base import AttentionBatch
from splitspec.runtime.host_tensors import host_tensor
from splitspec.runtime.kv_cache import BlockTable, KVCache, slot_list


@dataclass
class SequenceInput:
    """One request's share of a forward."""

    table: BlockTable
    input_ids: list[int]
    positions: list[int] | None = None  # default: table.num_tokens + arange(len(input_ids))
    mask: torch.Tensor | None = None  # [q_len, q_len] bool over the new tokens; None = causal
    logits: str = "last"  # which new tokens get logits: "last", "all" or "none"
    # the draft tree whose ancestor-or-self relation `mask` is, when it is one (tree.tree_mask(parents)): backends
    # build their masks from its bits (tree.ancestor_rows) instead of from the tensor
    parents: tuple[int, ...] | None = None
    # filler tokens at the end of input_ids that make a prompt chunk one captured graph's shape (runtime.prompt_graph):
    # written to the request's next KV slots, never committed; "last" is the last real token
    padding: int = 0


class ForwardBatch:
    """A forward's inputs: input_ids [T], positions [T], logits_indices [N] (the rows of the T new tokens that get
    logits) on the device, each copied there when first read; cu_logits: request i's logits rows are cu[i]:cu[i+1].
    A captured graph's replay copies ids and positions from the host straight into its static inputs (source()),
    and reads no logits rows when every row asks for them: a decode step's batch makes one copy of each, not two, and
    none of what it never reads (on an H100 the demo target's batch-1 step's `verify` phase 0.367 -> 0.344 ms with
    this and the overlap's adopted ids: benchmarks/results/ab_h100_0829df2_vs_6d47d44_demo_plain.json)."""

    __slots__ = ("host_ids", "host_positions", "host_logits", "attention", "cu_logits", "device", "_ids", "_positions",
                 "_logits", "max_position", "shift")

    def __init__(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionBatch,
                 logits_indices: torch.Tensor, cu_logits: list[int], device: torch.device | None,
                 max_position: int):
        """The three tensors on the host (copied to device when read) or already on it (device None: theirs).
        max_position: the largest of the positions, found as they were gathered (no tensor op to read it)."""
        self.host_ids, self.host_positions, self.host_logits = input_ids, positions, logits_indices
        self.max_position = max_position
        self.attention, self.cu_logits = attention, cu_logits
        self.device = input_ids.device if device is None else torch.device(device)
        self._ids = self._positions = self._logits = None
        self.shift: torch.Tensor | None = None  # shift_back's

    def shift_back(self, shift: torch.Tensor) -> None:
        """Built at each request's upper length, request i's new tokens sit shift[i] (<= 0; a device tensor, one a
        request) slots earlier: the forward moves their positions, KV slots and key counts by it (runtime.batch_shift)."""
        count = self.attention.num_requests
        if shift.dim() != 1 or shift.shape[0] != count or shift.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"a shift of shape {tuple(shift.shape)} and {shift.dtype} for a batch of {count} requests "
                             "(one integer each)")
        self.shift = shift

    @property
    def num_tokens(self) -> int:
        return self.host_ids.shape[0]

    @property
    def input_ids(self) -> torch.Tensor:
        if self._ids is None:
            self._ids = to_device(self.host_ids, self.device)
        return self._ids

    @property
    def positions(self) -> torch.Tensor:
        if self._positions is None:
            self._positions = to_device(self.host_positions, self.device)
        return self._positions

    @property
    def logits_indices(self) -> torch.Tensor:
        if self._logits is None:
            self._logits = to_device(self.host_logits, self.device)
        return self._logits

    def adopt_ids(self, ids: torch.Tensor) -> None:
        """The input ids are these, on the device already (the overlap schedule's roots: the last step's tokens,
        not landed): taken as they are, not copied, so nothing may write into this batch's input_ids afterwards."""
        if ids.shape != self.host_ids.shape:
            raise ValueError(f"{tuple(ids.shape)} input ids for a batch of {self.num_tokens} tokens")
        self._ids = ids

    def source(self, name: str) -> torch.Tensor:
        """"input_ids", "positions" or "logits_indices" as a copy into a static buffer reads them: the device tensor
        when one was made (it may have been written there since: the overlap schedule writes roots and drafts into
        the ids), else the host tensor."""
        made, host = _SOURCES[name]
        made = getattr(self, made)
        return getattr(self, host) if made is None else made


_SOURCES = {"input_ids": ("_ids", "host_ids"), "positions": ("_positions", "host_positions"),
            "logits_indices": ("_logits", "host_logits")}  # ForwardBatch.source: (device attribute, host attribute)


def validate(seq: SequenceInput) -> None:
    q_len = len(seq.input_ids)
    if q_len == 0:
        raise ValueError("a sequence in a forward batch needs at least one new token")
    if not 0 <= seq.padding < q_len:
        raise ValueError(f"{seq.padding} filler tokens of {q_len} new tokens")
    if seq.positions is not None and len(seq.positions) != q_len:
        raise ValueError(f"{len(seq.positions)} positions for {q_len} new tokens")
    if seq.parents is not None:  # its mask is tree_mask(parents): every node sees itself
        if seq.mask is None or len(seq.parents) != q_len:
            raise ValueError(f"a tree of {len(seq.parents)} nodes for {q_len} new tokens, or without its mask")
    elif seq.mask is not None:
        if tuple(seq.mask.shape) != (q_len, q_len):
            raise ValueError(f"mask shape {tuple(seq.mask.shape)} does not match {q_len} new tokens")
        if not bool(seq.mask.diagonal().all()):
            raise ValueError("a tree mask must let every new token attend to itself")


SHORT_SLOTS = 128  # below this, slot ids are cheaper as Python ints than as index tensors (kv_cache.slot_ids)


def build_forward_batch(kv_cache: KVCache, sequences: list[SequenceInput], device: torch.device) -> ForwardBatch:
    if not sequences:
        raise ValueError("a forward batch needs at least one sequence")
    for seq in sequences:
        validate(seq)  # all of them before any page is reserved
    input_ids, positions, out_slots, logits_rows = [], [], [], []
    q_lens, kv_lens, page_tables, masks, trees, cu_logits = [], [], [], [], [], [0]
    page_size, short = kv_cache.page_size, []  # short: the slots of the sequences of at most SHORT_SLOTS tokens
    top = 0  # the largest position (the RoPE cache a forward reserves covers it): Python ints, not a tensor op after
    rows = logit_rows = 0  # new tokens so far, logits rows so far
    # a step's batch holds tens of sequences per forward, several forwards a step: the loop's body is its host cost
    for seq in sequences:
        table, ids = seq.table, seq.input_ids
        q_len, start = len(ids), table.num_tokens
        end = start + q_len
        pages = table.pages
        if len(pages) * page_size < end:
            kv_cache.reserve(table, end)
        input_ids += ids
        if seq.positions is not None:
            positions += seq.positions
            top = max(top, max(seq.positions))
        else:
            positions += range(start, end)
            top = max(top, end - 1)
        if q_len <= SHORT_SLOTS:  # a decode's or a tree's few slots: Python ints, one tensor for the whole batch
            first, offset = divmod(start, page_size)
            if offset + q_len <= page_size:  # within one page
                base = pages[first] * page_size
                short += range(base + offset, base + offset + q_len)
            else:
                short += slot_list(pages, page_size, start, end)
        else:
            if short:
                out_slots.append(short)
                short = []
            out_slots.append(kv_cache.slot_ids(table, start, end))
        logits = seq.logits
        if logits == "last":
            logits_rows.append(rows + q_len - seq.padding - 1)
            logit_rows += 1
        elif logits == "all":
            logits_rows += range(rows, rows + q_len)
            logit_rows += q_len
        cu_logits.append(logit_rows)
        rows += q_len
        q_lens.append(q_len)
        kv_lens.append(end)
        page_tables.append(pages[:])
        masks.append(seq.mask)
        trees.append(seq.parents)
    if short:
        out_slots.append(short)
    out_slots = [host_tensor(s) if isinstance(s, list) else s for s in out_slots]
    positions_t = host_tensor(positions)
    attention = AttentionBatch(
        q_lens=q_lens,
        kv_lens=kv_lens,
        page_tables=page_tables,
        out_slots=out_slots[0] if len(out_slots) == 1 else torch.cat(out_slots),
        positions=positions_t,
        masks=masks,
        trees=trees,
    )
    return ForwardBatch(host_tensor(input_ids), positions_t, attention, host_tensor(logits_rows), cu_logits, device, top)


def device_tensor(data, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """torch.tensor(data) on the device without waiting for the work queued there (torch.tensor(data, device=...)
    copies from pageable memory and waits for the stream to drain: SPLITSPEC_SYNC_DEBUG counts such waits)."""
    if dtype in (None, torch.long, torch.int32) and type(data) is list and data and type(data[0]) is int:
        try:  # a flat list of ints (index lists, the common case): host_tensor's faster path
            return to_device(host_tensor(data, dtype or torch.long), device)
        except (TypeError, OverflowError):  # not all ints after all, or past int64 (torch.tensor says how)
            pass
    return to_device(torch.tensor(data, dtype=dtype), device)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on the device without waiting for the work already queued there (a blocking copy waits for the
    stream to drain: the overlap schedule builds a step's batch while the step before it runs). The source is staged
    by the copy itself, so the caller may drop it at once."""
    return host if torch.device(device).type == "cpu" else host.to(device, non_blocking=True)
