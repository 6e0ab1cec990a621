"""The paged KV cache: a page pool, a ref-counted page allocator and per-request block tables.

Layout, per layer (FlashInfer's "NHD" paged layout, K and V each contiguous so both the (K, V)
tuple form of FlashInfer and flat slot views work):

    kv[layer]: [2, num_pages, page_size, num_kv_heads, head_dim]
                ^ 0 = K, 1 = V
    k_flat(layer): [num_pages * page_size, num_kv_heads, head_dim]   (a view: slot id -> row)

A request's logical slot p (its p-th token) lives in page `block_table.pages[p // page_size]` at
offset `p % page_size`; its flat slot id is `page * page_size + offset`. Pages are counted, freed when
their reference count drops to zero, and reused. A page is shared only through the prefix cache, which
holds its own reference (ARCHITECTURE.md §3.3).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from splitspec.runtime.config import ModelConfig
from splitspec.runtime.host_tensors import host_tensor


def slot_list(pages: list[int], page_size: int, start: int, end: int) -> list[int]:
    """slot_ids as Python ints (a batch of decodes and trees joins them into one tensor): a range per page spanned,
    not a division per slot (a 12-node tree crosses a 16-slot page two times in three).

    >>> slot_list([7, 2], page_size=4, start=2, end=6)
    [30, 31, 8, 9]
    """
    out: list[int] = []
    while start < end:
        page, offset = divmod(start, page_size)
        n = min(page_size - offset, end - start)
        base = pages[page] * page_size + offset
        out += range(base, base + n)
        start += n
    return out


def slot_ids(pages: list[int], page_size: int, start: int, end: int) -> torch.Tensor:
    """Flat slot ids [end - start] of logical slots start..end-1 of a request with these pages.

    >>> slot_ids([7, 2], page_size=4, start=2, end=6).tolist()
    [30, 31, 8, 9]
    """
    if end - start <= 128:  # a step's few slots: Python is ~8x faster than building index tensors
        return torch.tensor(slot_list(pages, page_size, start, end), dtype=torch.long)
    logical = torch.arange(start, end)
    return torch.tensor(pages, dtype=torch.long)[logical // page_size] * page_size + logical % page_size


class OutOfPagesError(RuntimeError):
    """The page pool cannot satisfy an allocation; the caller queues or preempts."""


class PageAllocator:
    """Ref-counted pages 0..num_pages-1. alloc() hands out pages with reference count 1."""

    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"the KV cache needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._refcount = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def alloc(self, num: int) -> list[int]:
        if num > len(self._free):
            raise OutOfPagesError(f"need {num} KV pages, {len(self._free)} of {self.num_pages} free")
        pages = [self._free.pop() for _ in range(num)]
        for page in pages:
            self._refcount[page] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        for page in pages:
            assert self._refcount[page] > 0, f"incref of free page {page}"
            self._refcount[page] += 1

    def decref(self, pages: list[int]) -> None:
        for page in pages:
            assert self._refcount[page] > 0, f"decref of free page {page}"
            self._refcount[page] -= 1
            if self._refcount[page] == 0:
                self._free.append(page)

    def refcount(self, page: int) -> int:
        return self._refcount[page]


@dataclass
class BlockTable:
    """One request's KV: its pages in order and how many slots hold valid (committed) tokens."""

    pages: list[int] = field(default_factory=list)
    num_tokens: int = 0


class KVCache:
    """The page pool tensors plus the allocator; all block-table bookkeeping goes through here."""

    def __init__(self, config: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device):
        if page_size <= 0:
            raise ValueError(f"page size must be positive, got {page_size}")
        self.page_size = page_size
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.allocator = PageAllocator(num_pages)
        self.evictor = None  # callable(num_pages) -> pages freed; the prefix cache sets it
        # one tensor for every layer, so that one kernel can move slots in all of them; layers[i] is a view
        self.pool = torch.zeros((self.num_layers, 2, num_pages, page_size, self.num_kv_heads, self.head_dim),
                                dtype=dtype, device=self.device)
        self.layers = list(self.pool.unbind(0))

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @staticmethod
    def bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
        element_size = torch.empty((), dtype=dtype).element_size()
        return config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * element_size

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def reserve(self, table: BlockTable, num_tokens: int) -> None:
        """Make room for `num_tokens` slots in total (allocates pages; never frees)."""
        missing = self.pages_for(num_tokens) - len(table.pages)
        if missing > self.allocator.num_free and self.evictor is not None:
            self.evictor(missing - self.allocator.num_free)
        if missing > 0:
            table.pages.extend(self.allocator.alloc(missing))

    def set_length(self, table: BlockTable, num_tokens: int) -> None:
        """Commit: the first `num_tokens` slots are valid; pages wholly past them return to the pool."""
        assert num_tokens <= len(table.pages) * self.page_size, "set_length past the reserved pages"
        keep = self.pages_for(num_tokens)
        if keep < len(table.pages):
            self.allocator.decref(table.pages[keep:])
            del table.pages[keep:]
        table.num_tokens = num_tokens

    def commit(self, table: BlockTable, num_tokens: int) -> None:
        """set_length that frees nothing: the pages past the new length stay the table's (work queued on the device
        writes there: a device-fed step's next verification), returned by a later set_length or release."""
        assert num_tokens <= len(table.pages) * self.page_size, "commit past the reserved pages"
        table.num_tokens = num_tokens

    def release(self, table: BlockTable) -> None:
        self.set_length(table, 0)

    def fork(self, table: BlockTable, num_tokens: int) -> BlockTable:
        """A new table whose first num_tokens slots hold what table's do: whole pages are shared (their
        reference counts grow, and neither table writes below its length), a partly filled last page is
        copied to a page of the fork's own, where the fork goes on writing. Release it like any table."""
        return self.fork_many(table, [num_tokens])[0]

    def fork_many(self, table: BlockTable, lengths: list[int]) -> list[BlockTable]:
        """fork() for each length, the partial pages' copies in one kernel."""
        forks, src, dst = [], [], []
        try:
            for num_tokens in lengths:
                assert num_tokens <= table.num_tokens, "fork past the committed slots"
                full, partial = divmod(num_tokens, self.page_size)
                fork = BlockTable(list(table.pages[:full]), num_tokens)
                self.allocator.incref(fork.pages)
                forks.append(fork)
                if partial:
                    self.reserve(fork, num_tokens)
                    start = full * self.page_size
                    src.append(self.slot_ids(table, start, num_tokens))
                    dst.append(self.slot_ids(fork, start, num_tokens))
        except OutOfPagesError:
            for fork in forks:
                self.release(fork)
            raise
        if src:
            self.copy_slots(torch.cat(src), torch.cat(dst))
        return forks

    def slot_ids(self, table: BlockTable, start: int, end: int) -> torch.Tensor:
        """Flat slot ids [end - start] of logical slots start..end-1 (pages must be reserved)."""
        return slot_ids(table.pages, self.page_size, start, end)

    def flat_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of one layer as [num_slots, num_kv_heads, head_dim] views indexed by flat slot id."""
        kv = self.layers[layer_id]
        return kv[0].view(-1, self.num_kv_heads, self.head_dim), kv[1].view(-1, self.num_kv_heads, self.head_dim)

    def copy_slots(self, src_slots: torch.Tensor | list[int], dst_slots: torch.Tensor | list[int]) -> None:
        """KV of flat slots src -> dst in every layer, as if moved in order (tree commit compacts the accepted
        nodes of every request of a step with one call: no move may read a slot an earlier one wrote)."""
        from splitspec.kernels import ops

        if isinstance(src_slots, list) and isinstance(dst_slots, list):  # the engine's lists: one copy for both
            both = host_tensor(src_slots + dst_slots).to(self.device, non_blocking=True)
            src, dst = both[: len(src_slots)], both[len(src_slots) :]
        else:
            src = torch.as_tensor(src_slots, dtype=torch.long).to(self.device, non_blocking=True)
            dst = torch.as_tensor(dst_slots, dtype=torch.long).to(self.device, non_blocking=True)
        planes = self.pool.view(self.num_layers * 2, self.num_pages * self.page_size, self.num_kv_heads * self.head_dim)
        ops.move_kv_slots(planes, src, dst)
