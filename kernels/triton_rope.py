"""Triton kernel (CUDA only): RoPE on q and k in one launch, optionally with k and v written into the paged cache at
their slots (kernels.torch_ops.apply_rope and rope_and_store are its twins). Each product and sum rounds to the
input dtype where the twin's bf16 arithmetic does. Positions and slots are read by their stride: a top-k draft
step's positions are each request's one position expanded over its beams, at batch 1 a stride-0 view."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(q_ptr, k_ptr, v_ptr, q_out_ptr, k_out_ptr, v_out_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_pos, stride_slot,
                 num_q_heads, num_kv_heads, head_dim, half, STORE_KV: tl.constexpr, HALF_BLOCK: tl.constexpr,
                 REST_BLOCK: tl.constexpr, HEAD_BLOCK: tl.constexpr):
    """Programs (token, head): heads < num_q_heads rotate q into q_out [T, Hq, D]; the others rotate k into
    k_out, at row `token` of [T, Hkv, D], or with STORE_KV at the token's slot of the flat paged cache,
    where v is copied too."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    pos = tl.load(pos_ptr + token * stride_pos)
    cols = tl.arange(0, HALF_BLOCK)
    keep = cols < half
    if head < num_q_heads:
        src = q_ptr + token * stride_qt + head * stride_qh
        dst = q_out_ptr + (token * num_q_heads + head) * head_dim
    else:
        h = head - num_q_heads
        src = k_ptr + token * stride_kt + h * stride_kh
        if STORE_KV:
            row = tl.load(slot_ptr + token * stride_slot)
            full = tl.arange(0, HEAD_BLOCK)
            inside = full < head_dim
            value = tl.load(v_ptr + token * stride_vt + h * stride_vh + full, mask=inside, other=0.0)
            tl.store(v_out_ptr + (row * num_kv_heads + h) * head_dim + full, value, mask=inside)
        else:
            row = token
        dst = k_out_ptr + (row * num_kv_heads + h) * head_dim
    x1 = tl.load(src + cols, mask=keep, other=0.0)
    x2 = tl.load(src + half + cols, mask=keep, other=0.0)
    dtype = x1.dtype
    c = tl.load(cos_ptr + pos * half + cols, mask=keep, other=0.0).to(dtype).to(tl.float32)
    s = tl.load(sin_ptr + pos * half + cols, mask=keep, other=0.0).to(dtype).to(tl.float32)
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    # each product and the sum rounded to the input dtype, as the twin's bf16 arithmetic does
    o1 = ((a1 * c).to(dtype).to(tl.float32) - (a2 * s).to(dtype).to(tl.float32)).to(dtype)
    o2 = ((a2 * c).to(dtype).to(tl.float32) + (a1 * s).to(dtype).to(tl.float32)).to(dtype)
    tl.store(dst + cols, o1, mask=keep)
    tl.store(dst + half + cols, o2, mask=keep)
    if REST_BLOCK > 0:  # partial rotary: the rest passes through
        rest = tl.arange(0, REST_BLOCK)
        more = 2 * half + rest < head_dim
        tl.store(dst + 2 * half + rest, tl.load(src + 2 * half + rest, mask=more, other=0.0), mask=more)


def _rope(q, k, v, cos_cache, sin_cache, positions, rot_dim, k_out, v_out, slots) -> torch.Tensor:
    """One launch for q and k (and v when v_out is given); returns the rotated q."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q, k = (x if x.stride(2) == 1 else x.contiguous() for x in (q, k))
    store = v_out is not None
    if store and v.stride(2) != 1:
        v = v.contiguous()
    q_out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    if not store:  # placeholders the kernel never touches
        v, v_out, slots = k, k_out, positions
    rest = head_dim - rot_dim
    _rope_kernel[(num_tokens, num_q_heads + num_kv_heads)](
        q, k, v, q_out, k_out, v_out, cos_cache, sin_cache, positions, slots, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), v.stride(0), v.stride(1), positions.stride(0), slots.stride(0), num_q_heads, num_kv_heads,
        head_dim, rot_dim // 2, STORE_KV=store,
        HALF_BLOCK=triton.next_power_of_2(rot_dim // 2), REST_BLOCK=triton.next_power_of_2(rest) if rest else 0,
        HEAD_BLOCK=triton.next_power_of_2(head_dim), num_warps=1)
    return q_out


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
               positions: torch.Tensor, rot_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    return _rope(q, k, None, cos_cache, sin_cache, positions, rot_dim, k_out, None, None), k_out


def rope_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                   positions: torch.Tensor, rot_dim: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slots: torch.Tensor) -> torch.Tensor:
    return _rope(q, k, v, cos_cache, sin_cache, positions, rot_dim, k_cache, v_cache, slots)
