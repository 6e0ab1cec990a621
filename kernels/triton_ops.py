"""Triton kernels (CUDA only). Each rounds to the input dtype where its torch twin (kernels/torch_ops.py)
rounds, so the two agree to within a rounding (the norms sum a row's squares in another order)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_res, stride_out, n, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    keep = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=keep, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=keep, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the sum, rounded as torch's add rounds it
        tl.store(res_out_ptr + row * n + cols, x, mask=keep)
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / n + eps)
    y = (h * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=keep, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (y * w).to(x.dtype), mask=keep)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    n = rows.shape[1]
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(rows.shape[0],)](rows, rows, weight, out, out, rows.stride(0), rows.stride(0), out.stride(0), n, eps,
                                       HAS_RESIDUAL=False, BLOCK=block, num_warps=min(max(block // 256, 1), 16))
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    rows, res = _rows(x), _rows(residual)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    n = rows.shape[1]
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(rows.shape[0],)](rows, res, weight, out, res_out, rows.stride(0), res.stride(0), out.stride(0), n,
                                       eps, HAS_RESIDUAL=True, BLOCK=block, num_warps=min(max(block // 256, 1), 16))
    return out.view(x.shape), res_out.view(x.shape)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, n, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = cols < n
    gate = tl.load(x_ptr + row * stride_x + cols, mask=keep, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n + cols, mask=keep, other=0.0)
    g = gate.to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)  # silu, rounded as F.silu rounds it
    tl.store(out_ptr + row * n + cols, (s * up.to(tl.float32)).to(gate.dtype), mask=keep)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    rows = _rows(gate_up)
    n = rows.shape[1] // 2
    out = torch.empty((rows.shape[0], n), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(n, block))](rows, out, rows.stride(0), n, BLOCK=block, num_warps=4)
    return out.view(*gate_up.shape[:-1], n)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, v_ptr, q_out_ptr, k_out_ptr, v_out_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, num_q_heads, num_kv_heads, head_dim,
                 half, STORE_KV: tl.constexpr, HALF_BLOCK: tl.constexpr, REST_BLOCK: tl.constexpr,
                 HEAD_BLOCK: tl.constexpr):
    """Programs (token, head): heads < num_q_heads rotate q into q_out [T, Hq, D]; the others rotate k into
    k_out, at row `token` of [T, Hkv, D], or with STORE_KV at the token's slot of the flat paged cache,
    where v is copied too."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    pos = tl.load(pos_ptr + token)
    cols = tl.arange(0, HALF_BLOCK)
    keep = cols < half
    if head < num_q_heads:
        src = q_ptr + token * stride_qt + head * stride_qh
        dst = q_out_ptr + (token * num_q_heads + head) * head_dim
    else:
        h = head - num_q_heads
        src = k_ptr + token * stride_kt + h * stride_kh
        if STORE_KV:
            row = tl.load(slot_ptr + token)
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
        k.stride(1), v.stride(0), v.stride(1), num_q_heads, num_kv_heads, head_dim, rot_dim // 2, STORE_KV=store,
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


@triton.jit
def _copy_rows_kernel(src_ptr, src_index_ptr, src_plane_stride, src_row_stride, dst_ptr, dst_index_ptr,
                      dst_plane_stride, dst_row_stride, width, SRC_INDEXED: tl.constexpr, DST_INDEXED: tl.constexpr,
                      BLOCK: tl.constexpr):
    """Row m of every plane: src[src_index[m]] (or src[m]) -> dst[dst_index[m]] (or dst[m])."""
    m = tl.program_id(0).to(tl.int64)
    plane = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    keep = cols < width
    src_row = tl.load(src_index_ptr + m).to(tl.int64) if SRC_INDEXED else m
    dst_row = tl.load(dst_index_ptr + m).to(tl.int64) if DST_INDEXED else m
    row = tl.load(src_ptr + plane * src_plane_stride + src_row * src_row_stride + cols, mask=keep)
    tl.store(dst_ptr + plane * dst_plane_stride + dst_row * dst_row_stride + cols, row, mask=keep)


def move_kv_slots(pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Two launches for every layer's K and V and every move: gather the source rows, then scatter them (the
    twin's semantics; no program waits on another's move)."""
    planes, _, width = pool.shape
    moves = src.numel()
    block = min(triton.next_power_of_2(width), 1024)
    grid = (moves, planes, triton.cdiv(width, block))
    rows = torch.empty((planes, moves, width), dtype=pool.dtype, device=pool.device)
    _copy_rows_kernel[grid](pool, src, pool.stride(0), pool.stride(1), rows, src, rows.stride(0), rows.stride(1), width,
                            SRC_INDEXED=True, DST_INDEXED=False, BLOCK=block)
    _copy_rows_kernel[grid](rows, dst, rows.stride(0), rows.stride(1), pool, dst, pool.stride(0), pool.stride(1), width,
                            SRC_INDEXED=False, DST_INDEXED=True, BLOCK=block)


@triton.jit
def _verify_tree_greedy_kernel(cand_ptr, parent_ptr, target_ptr, index_ptr, len_ptr, bonus_ptr, n,
                               MAX_DEPTH: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    nodes = tl.arange(0, BLOCK)
    keep = nodes < n
    candidates = tl.load(cand_ptr + row * n + nodes, mask=keep, other=-1)
    parents = tl.load(parent_ptr + row * n + nodes, mask=keep, other=-2)
    last = 0
    accepted = 0
    active = 1
    tl.store(index_ptr + row * (MAX_DEPTH + 1), 0)
    for depth in tl.static_range(1, MAX_DEPTH + 1):
        want = tl.load(target_ptr + row * n + last)
        match = (parents == last) & (candidates == want) & (active != 0)
        found = tl.min(tl.where(match, nodes, n), axis=0)
        active = active & (found < n)
        last = tl.where(active != 0, found, last)
        tl.store(index_ptr + row * (MAX_DEPTH + 1) + depth, tl.where(active != 0, found, -1).to(tl.int64))
        accepted += active
    tl.store(len_ptr + row, accepted.to(tl.int64))
    tl.store(bonus_ptr + row, tl.load(target_ptr + row * n + last))


def verify_tree_greedy(candidates: torch.Tensor, parents: torch.Tensor, targets: torch.Tensor,
                       max_depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One program per tree; the twin's level-by-level rule with the tree held in registers."""
    batch, n = candidates.shape
    accept_index = torch.empty((batch, max_depth + 1), dtype=torch.long, device=candidates.device)
    accept_len = torch.empty(batch, dtype=torch.long, device=candidates.device)
    bonus = torch.empty(batch, dtype=torch.long, device=candidates.device)
    _verify_tree_greedy_kernel[(batch,)](candidates, parents, targets, accept_index, accept_len, bonus, n,
                                         MAX_DEPTH=max_depth, BLOCK=triton.next_power_of_2(n))
    return accept_index, accept_len, bonus


@triton.jit
def _mul32(h, c: tl.constexpr):
    """(h * c) mod 2^32 for uint32 values held in int64 (16-bit halves), as splitspec.runtime.sampling."""
    low = (h & 0xFFFF) * c
    high = (((h >> 16) * c) & 0xFFFF) << 16
    return (low + high) & 0xFFFFFFFF


@triton.jit
def _fmix32(h):
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


@triton.jit
def _gumbel_argmax_kernel(logits_ptr, stride, keys_ptr, out_ptr, V: tl.constexpr, UNIFORM_SHIFT: tl.constexpr,
                          UNIFORM_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    key = tl.load(keys_ptr + row)
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_index = tl.zeros((BLOCK,), tl.int64)
    for start in range(0, V, BLOCK):
        vocab = start + tl.arange(0, BLOCK).to(tl.int64)
        keep = vocab < V
        x = tl.load(logits_ptr + row * stride + vocab, mask=keep, other=float("-inf"))
        bits = _fmix32((_fmix32(_mul32(vocab, 0x9E3779B9) ^ key) + key) & 0xFFFFFFFF)
        uniform = ((bits >> UNIFORM_SHIFT).to(tl.float32) + 0.5) * UNIFORM_SCALE
        y = x + -tl.log(-tl.log(uniform))
        take = y > best  # a later index wins only when strictly larger: each lane keeps its first maximum
        best = tl.where(take, y, best)
        best_index = tl.where(take, vocab, best_index)
    top = tl.max(best, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(best == top, best_index, V), axis=0))


def gumbel_argmax(logits: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """One program per row streams the vocabulary once: no [B, V] noise tensor is made."""
    from splitspec.runtime.sampling import UNIFORM_BITS

    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.long, device=logits.device)
    _gumbel_argmax_kernel[(rows,)](logits, logits.stride(0), keys.contiguous(), out, V=vocab,
                                   UNIFORM_SHIFT=32 - UNIFORM_BITS, UNIFORM_SCALE=1.0 / 2**UNIFORM_BITS, BLOCK=1024)
    return out
