"""Re-planning a captured FlashInfer wrapper in one copy, without FlashInfer's Python `plan`.

A CUDA graph replays FlashInfer's kernels with the pointers and the work split they were captured with; what a step
changes is what the wrapper's index buffers hold (query and page offsets, page ids, last page lengths, key lengths,
a tree's packed mask and its offsets) and what FlashInfer's C++ planner writes into its int workspace. FlashInfer's
Python `plan` fills those with a host op and a copy per array (seven for a tree, each its own cudaMemcpy) and first
recomputes what the caller already has (key lengths from page counts, the mask's offsets, the maxima). Here a
graph's index buffers are views of one device arena, filled from one host array by one copy (a tree's packed mask
by a second), and the C++ planner runs on views of that same host array.

Only a wrapper FlashInfer has planned once itself (when its graph was captured) is re-planned here: that first plan
fixed its module, backend, dtypes and the scalars its kernels were captured with. FlashInfer 0.6's wrapper internals;
tests/test_gpu_kernels.py checks that this plan leaves the device buffers, the work split and the logits exactly as
FlashInfer's own plan does.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from splitspec.runtime.host_tensors import host_tensor


@dataclass
class Arena:
    """One int32 device buffer holding, in this order, a graph's query offsets [bs+1], page offsets [bs+1], last page
    lengths [bs], key lengths [bs], for trees the masks' byte offsets [bs+1] and, where the graph packs the masks on
    the device (kernels.tree_mask_bits), the nodes' ancestor bits [bs, q, words], then page ids [max_pages]."""

    buffer: torch.Tensor
    batch_size: int
    mask: bool
    ancestors: int = 0  # ints of ancestor bits (bs * q * words; 0: masks packed on the host)
    # recorded after the last plan's copies: FlashInfer's planner copies its work split from a pinned buffer that the
    # next plan rewrites, so that plan waits until the stream has taken this one's (at once, unless the host runs
    # more than a step ahead of the device)
    planned: torch.cuda.Event | None = None
    # replan(reuse=True): what FlashInfer's planner last read for this arena's wrapper, and the plan info it returned
    last_plan: tuple | None = None

    @classmethod
    def make(cls, batch_size: int, max_pages: int, device: torch.device, mask: bool, ancestors: int = 0) -> "Arena":
        size = 4 * batch_size + 2 + (batch_size + 1 if mask else 0) + ancestors + max_pages
        return cls(torch.zeros(size, dtype=torch.int32, device=device), batch_size, mask, ancestors)

    def _at(self, part: str) -> tuple[int, int]:
        bs = self.batch_size
        sizes = {"qo": bs + 1, "kv_indptr": bs + 1, "last": bs, "kv_lens": bs, "mask_indptr": bs + 1 if self.mask else 0,
                 "ancestors": self.ancestors}
        start = 0
        for name, size in sizes.items():
            if name == part:
                return start, start + size
            start += size
        return start, self.buffer.numel()  # the page ids: the rest

    def view(self, part: str) -> torch.Tensor:
        start, end = self._at(part)
        return self.buffer[start:end]


def fill(arena: Arena, q_lens: list[int], kv_lens: list[int], page_tables: list[list[int]], page_size: int,
         mask_offsets: list[int] | None = None, ancestors: list[int] | None = None) -> tuple[list[int], torch.Tensor]:
    """The arena's buffers for a batch of arena.batch_size requests, by one copy: (its head, what precedes the page
    ids, as ints; the host array copied)."""
    counts = [-(-k // page_size) for k in kv_lens]
    kv_indptr = list(itertools.accumulate(counts, initial=0))
    last = [k - (n - 1) * page_size for k, n in zip(kv_lens, counts)]
    ids = [p for table, n in zip(page_tables, counts) for p in table[:n]]
    head = [*itertools.accumulate(q_lens, initial=0), *kv_indptr, *last, *kv_lens, *(mask_offsets or ()),
            *(ancestors or ())]
    host = host_tensor(head + ids, torch.int32)
    arena.buffer[: host.numel()].copy_(host, non_blocking=True)
    return head, host


def replannable(wrapper) -> bool:
    """Whether FlashInfer planned this wrapper once (its module and work split exist) and it replays in a graph."""
    return wrapper.is_cuda_graph_enabled and getattr(wrapper, "_plan_info", None) is not None \
        and getattr(wrapper, "_cached_module", None) is not None


def replan(wrapper, arena: Arena, *, q_lens: list[int], kv_lens: list[int], page_tables: list[list[int]], page_size: int,
           num_qo_heads: int, num_kv_heads: int, head_dim: int, causal: bool, window_left: int, decode: bool,
           packed_mask: torch.Tensor | None = None, mask_offsets: list[int] | None = None,
           ancestors: list[int] | None = None, reuse: bool = False) -> bool:
    """What wrapper.plan does for a batch of arena.batch_size requests of q_lens new tokens (kv_lens keys after
    them, in page_tables' pages): the arena filled by one copy, the mask by another, FlashInfer's C++ planner run
    on the host arrays. decode: a BatchDecodeWithPagedKVCacheWrapper (q_lens all 1), else a prefill wrapper. A tree's
    mask: packed_mask (bytes, copied) or ancestors (the arena's ancestor bits, packed on the device by the graph), and
    its byte offsets.

    reuse: where the planner reads only the query and page offsets (FA2's prefill planner and the CUDA-core decode
    one; their key lengths in tokens come from the arena's buffers), the same offsets as this wrapper's last plan,
    which nothing has replaced since (FlashInfer's own plan makes a new plan info), leave its work split in place:
    the planner's output is a function of what it reads. At batch 1 the page offsets change every page (16 tokens),
    not every step. True when the planner ran."""
    bs = arena.batch_size
    head, host = fill(arena, q_lens, kv_lens, page_tables, page_size, mask_offsets, ancestors)
    if packed_mask is not None:
        wrapper._custom_mask_buf[: packed_mask.numel()].copy_(packed_mask, non_blocking=True)
    prefill = not decode
    if prefill:
        wrapper._max_q_len, wrapper._max_kv_len = max(q_lens), max(kv_lens)
    else:
        wrapper._max_kv_len = max(kv_lens)
    prefill_planner = prefill or wrapper.use_tensor_cores  # the prefill module's planner (a tensor-core decode's too)
    key = None
    if reuse and (not prefill_planner or getattr(wrapper, "_backend", None) == "fa2"):
        key = (tuple(head[: 2 * bs + 2]), causal, window_left)
        if arena.last_plan is not None and arena.last_plan[0] == key and arena.last_plan[1] is wrapper._plan_info:
            return False
    qo_host, kv_indptr_host, kv_lens_host = host[: bs + 1], host[bs + 1 : 2 * bs + 2], host[3 * bs + 2 : 4 * bs + 2]
    if arena.planned is None:
        arena.planned = torch.cuda.Event()
    else:
        arena.planned.synchronize()
    if prefill and head[bs] > wrapper._max_total_num_rows:  # as FlashInfer's plan checks: the graph's q holds no more
        raise ValueError(f"{head[bs]} rows of q in a graph captured for {wrapper._max_total_num_rows}")
    if prefill_planner:
        rows = wrapper._max_total_num_rows if prefill else bs
        args = [wrapper._float_workspace_buffer, wrapper._int_workspace_buffer, wrapper._pin_memory_int_workspace_buffer,
                qo_host, kv_indptr_host, kv_lens_host, rows, bs, num_qo_heads, num_kv_heads, page_size, True, head_dim,
                head_dim, causal, window_left]
        if wrapper._backend == "fa2":
            args += [-1, False, 0]  # fixed_split_size, disable_split_kv, num_colocated_ctas: the plan's defaults
        wrapper._plan_info = wrapper._cached_module.plan(*args)
    else:  # the decode module's planner (CUDA cores)
        wrapper._plan_info = wrapper._cached_module.plan(
            wrapper._float_workspace_buffer, wrapper._int_workspace_buffer, wrapper._pin_memory_int_workspace_buffer,
            kv_indptr_host, bs, num_qo_heads, num_kv_heads, page_size, True, window_left, wrapper._logits_soft_cap or 0.0,
            head_dim, head_dim, torch.empty(0, dtype=wrapper._cached_q_data_type),
            torch.empty(0, dtype=wrapper._cached_kv_data_type))
    arena.planned.record()
    arena.last_plan = None if key is None else (key, wrapper._plan_info)
    return True

