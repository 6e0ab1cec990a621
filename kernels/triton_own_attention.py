"""Triton kernel (CUDA only): a draft step's attention over its own nodes merged with its attention over the
request's committed keys (kernels.torch_ops.merge_own_attention is its twin).

A beam node of runtime.draft_loop attends to the committed prefix in the paged cache (FlashInfer, which returns
its log-sum-exp too) and to its ancestors and itself, whose keys sit in a small dense buffer. In torch the second
part and the merge are ~30 small kernels per layer and step (einsums, a log-sum-exp, the merge's exps, casts), and
in a CUDA graph of a small draft model each costs its launch: ~60 us of a ~110 us step of the demo's EAGLE-3 head
on an H200. Here one program per (row, key-value head) runs an online softmax that starts from the prefix as one
key, scored by its log-sum-exp and valued at its output, then takes the node's own keys.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _merge_own_kernel(q_ptr, k_ptr, v_ptr, prefix_ptr, lse_ptr, out_ptr, sq_r, sq_h, sk_r, sk_j, sk_h, sv_r, sv_j,
                      sv_h, sp_r, sp_h, sl_r, so_r, so_h, depth, scale, G: tl.constexpr, D: tl.constexpr,
                      BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)  # the key-value head; its G query heads together
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    live_g, live_d = g < G, d < D
    live = live_g[:, None] & live_d[None, :]
    heads = h * G + g
    q = tl.load(q_ptr + r * sq_r + heads[:, None] * sq_h + d[None, :], mask=live, other=0.0).to(tl.float32)
    m = tl.load(lse_ptr + r * sl_r + heads, mask=live_g, other=0.0)  # the prefix's score: its log-sum-exp
    acc = tl.load(prefix_ptr + r * sp_r + heads[:, None] * sp_h + d[None, :], mask=live, other=0.0).to(tl.float32)
    total = tl.full([BLOCK_G], 1.0, tl.float32)
    for j in range(depth):
        k = tl.load(k_ptr + r * sk_r + j * sk_j + h * sk_h + d, mask=live_d, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + r * sv_r + j * sv_j + h * sv_h + d, mask=live_d, other=0.0).to(tl.float32)
        s = tl.sum(q * k[None, :], axis=1) * scale
        top = tl.maximum(m, s)
        alpha, p = tl.exp(m - top), tl.exp(s - top)
        acc = acc * alpha[:, None] + p[:, None] * v[None, :]
        total = total * alpha + p
        m = top
    out = acc / total[:, None]
    tl.store(out_ptr + r * so_r + heads[:, None] * so_h + d[None, :], out.to(out_ptr.dtype.element_ty), mask=live)


def merge_own_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, out_prefix: torch.Tensor,
                        lse_prefix: torch.Tensor, scale: float) -> torch.Tensor:
    rows, heads, dim = q.shape
    depth, kv = keys.shape[1], keys.shape[2]
    out = torch.empty(rows, heads, dim, dtype=q.dtype, device=q.device)
    if rows == 0:
        return out
    group = heads // kv  # (every last dimension contiguous: kernels.ops checks)
    _merge_own_kernel[(rows, kv)](q, keys, values, out_prefix, lse_prefix, out, q.stride(0), q.stride(1), keys.stride(0),
                                  keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
                                  out_prefix.stride(0), out_prefix.stride(1), lse_prefix.stride(0), out.stride(0),
                                  out.stride(1), depth, scale, G=group, D=dim, BLOCK_G=triton.next_power_of_2(group),
                                  BLOCK_D=triton.next_power_of_2(dim), num_warps=1 if dim * group <= 512 else 4)
    return out
