"""CUDA graphs that attend with kernels.paged_attention (Triton) instead of FlashInfer: a few query rows a request.

A speculative step at small batch replays three graphs whose attention is a handful of query rows a request over a few
hundred keys: the verification's tree (or chain), the head's catch-up chain and the draft loop's beams over the
committed prefix; a decode step's graph has one row a request. FlashInfer serves each with a persistent kernel, for
prefill a merge of its split-KV partial results, and a plan its C++ planner makes on the host every step (or, reused,
every page). kernels.paged_attention reads the same arena of indices (flashinfer_replan.Arena: query and page
offsets, key lengths, the nodes' ancestor bits, page ids), filled by one copy, and needs no plan: one launch a layer.

GRAPH_ATTENTION_ENV picks it. `triton`: graphs of at most MAX_ROWS query rows a request, decode steps included, without
sliding windows, over a bfloat16 or float16 cache, when Triton runs (FlashInfer's otherwise). `auto` (the default):
the same, where the kernel was measured: on Hopper GPUs, heads of at most MAX_HEAD_DIM and at most MAX_GROUP query heads
a key-value head (a 16-row tree at group 8 would be a 128-row tile). `flashinfer`: every graph FlashInfer's. On an H100
the kernel took less device time than FlashInfer's at 34 of 36 graph kinds, batch sizes and key lengths measured at
the demo and 8B shapes (within 2% at two decode steps): docs/performance.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from splitspec import kernels
from splitspec.kernels import ops
from splitspec.runtime.attention.base import env_choice
from splitspec.runtime.attention.flashinfer_replan import Arena, fill

GRAPH_ATTENTION_ENV = "SPLITSPEC_GRAPH_ATTENTION"
MAX_HEAD_DIM, MAX_GROUP = 128, 4  # the widest heads and the largest groups the kernel was measured and tested at
MIN_CHUNK_ENV = "SPLITSPEC_GRAPH_ATTENTION_MIN_CHUNK"  # keys a split at least (a multiple of 64; the kernel's default)
MAX_ROWS = 16
PREFIX, CAUSAL, TREE = 0, 1, 2  # kernels.paged_attention's modes


def graph_attention_choice() -> str:
    return env_choice(GRAPH_ATTENTION_ENV, "auto", ("auto", "triton", "flashinfer"))


def measured_shape(config) -> bool:
    """Whether the kernel was measured and tested at this model's attention shape (heads and groups)."""
    return config.head_dim <= MAX_HEAD_DIM and config.num_attention_heads // config.num_key_value_heads <= MAX_GROUP


def measured_device(device: torch.device) -> bool:
    """Whether the kernel was measured on this kind of device: Hopper GPUs (H100, H200). Elsewhere its tiles were
    never compiled (GPUs with 100 KB of shared memory a block, say), so `auto` keeps FlashInfer's graphs there."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] == 9


def min_chunk_choice(environ=os.environ) -> int | None:
    """MIN_CHUNK_ENV's keys a split (None: the kernel's MIN_CHUNK); anything but a positive multiple of 64 refused."""
    value = environ.get(MIN_CHUNK_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) <= 0 or int(value) % 64:
        raise ValueError(f"{MIN_CHUNK_ENV}={value!r}: expected a positive multiple of 64 (keys a split at least)")
    return int(value)


@dataclass
class PagedGraph:
    """One graph's attention by kernels.paged_attention: its arena, what its rows see, and the kernel's scratch."""

    arena: Arena
    mode: int
    max_rows: int  # query rows a request at most (a tree's node count)
    words: int  # a tree's 16-bit words of ancestor bits a node (0: not a tree)
    work: tuple  # kernels.paged_attention's: the shared scratch and this graph's splits
    min_chunk: int | None = None  # keys a split at least (None: the kernel's default)

    @classmethod
    def make(cls, batch_size: int, max_rows: int, max_pages: int, mode: int, config, shared: tuple,
             device: torch.device, min_chunk: int | None = None) -> "PagedGraph":
        """shared: triton_paged_attention.shared_scratch's buffers, which every graph of a backend shares (their
        launches run on one stream, one after another)."""
        from splitspec.kernels import triton_paged_attention

        words = -(-max_rows // 16) if mode == TREE else 0
        arena = Arena.make(batch_size, max_pages, device, mask=False, ancestors=batch_size * max_rows * words)
        splits = triton_paged_attention.splits_for(batch_size, config.num_key_value_heads)
        return cls(arena, mode, max_rows, words, (*shared, splits), min_chunk)

    def fill(self, q_lens: list[int], kv_lens: list[int], page_tables: list[list[int]], page_size: int,
             ancestors: list[int] | None = None) -> None:
        """The arena for a batch of exactly arena.batch_size requests of at most max_rows rows each."""
        if len(q_lens) != self.arena.batch_size or max(q_lens) > self.max_rows:
            raise ValueError(f"{len(q_lens)} requests of up to {max(q_lens)} rows in a graph of {self.arena.batch_size} "
                             f"requests of {self.max_rows}")
        fill(self.arena, q_lens, kv_lens, page_tables, page_size, ancestors=ancestors if self.words else None)

    def attend(self, q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, page_size: int,
               scale: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(output, natural-log sum of exp for PREFIX graphs) of q [rows, Hq, D] over the cache's flat K/V views."""
        arena = self.arena
        ancestors = None
        if self.words:
            ancestors = arena.view("ancestors").view(arena.batch_size, self.max_rows, self.words)
        return kernels.paged_attention(q.contiguous(), k_flat, v_flat, page_size, arena.view("qo"),
                                       arena.view("kv_indptr"), arena.view("kv_lens"), arena.view("ids"), ancestors,
                                       self.mode, scale, self.max_rows, self.work, min_chunk=self.min_chunk)


class PagedGraphs:
    """A backend's paged graphs: whether a graph attends by kernels.paged_attention (GRAPH_ATTENTION_ENV, its shape,
    the cache), and the split keys' scratch that all of them share (launches on one stream, one after another)."""

    def __init__(self, config, cache_dtype: torch.dtype, windows: list, device: torch.device):
        self.config, self.device = config, device
        choice = graph_attention_choice()
        wanted = choice == "triton" or (choice == "auto" and measured_shape(config) and measured_device(device))
        self.on = (wanted and windows == [None] and cache_dtype in (torch.bfloat16, torch.float16)
                   and ops.triton_ready())
        self.min_chunk = min_chunk_choice()
        self._shared = None

    def usable(self, rows: int) -> bool:
        """Whether a graph of `rows` query rows a request attends by kernels.paged_attention."""
        return self.on and rows <= MAX_ROWS

    def make(self, batch_size: int, max_rows: int, max_pages: int, mode: int) -> PagedGraph:
        if self._shared is None:
            from splitspec.kernels import triton_paged_attention

            c = self.config
            self._shared = triton_paged_attention.shared_scratch(MAX_ROWS, c.num_attention_heads // c.num_key_value_heads,
                                                                 c.head_dim, self.device)
        return PagedGraph.make(batch_size, max_rows, max_pages, mode, self.config, self._shared, self.device,
                               self.min_chunk)
