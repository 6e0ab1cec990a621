"""Triton kernel (CUDA only): a paged graph's static inputs moved back by a shift on the device, in one launch
(kernels.torch_ops.shift_paged_inputs is its twin; runtime.batch_shift says why a batch is moved).

A device-fed step builds its batch at each request's upper length and moves it back by how many drafts the last
step did not accept, a number only the device knows. The twin takes ~14 small ops for it (each a launch of its own on
the host's serial path, twice a step: the target's verification and the head's catch-up); this takes one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shift_kernel(shift_ptr, kv_lens_ptr, positions_ptr, kv_indptr_ptr, page_ids_ptr, slots_ptr, q, page_size,
                  BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    shift = tl.load(shift_ptr + r).to(tl.int64)
    count = tl.load(kv_lens_ptr + r).to(tl.int64) + shift
    tl.store(kv_lens_ptr + r, count.to(tl.int32))
    j = tl.arange(0, BLOCK)
    live = j < q
    rows = r * q + j
    tl.store(positions_ptr + rows, tl.load(positions_ptr + rows, mask=live, other=0) + shift, mask=live)
    index = count - q + j  # row j's key index, in page (the request's first page's place + index // page_size)
    first = tl.load(kv_indptr_ptr + r).to(tl.int64)
    page = tl.load(page_ids_ptr + first + index // page_size, mask=live, other=0).to(tl.int64)
    tl.store(slots_ptr + rows, page * page_size + index % page_size, mask=live)


def shift_paged_inputs(shift: torch.Tensor, kv_lens: torch.Tensor, positions: torch.Tensor, kv_indptr: torch.Tensor,
                       page_ids: torch.Tensor, out_slots: torch.Tensor, q: int, page_size: int) -> None:
    """One program a request (torch_ops.shift_paged_inputs)."""
    requests = shift.shape[0]
    _shift_kernel[(requests,)](shift, kv_lens, positions, kv_indptr, page_ids, out_slots, q, page_size,
                               BLOCK=max(16, triton.next_power_of_2(q)))
