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
def _rms_norm_pair_kernel(a_ptr, b_ptr, wa_ptr, wb_ptr, out_ptr, stride_a, stride_b, stride_out, n, eps,
                          BLOCK: tl.constexpr):
    """Row program_id(0) of a (program_id(1) 0) or of b (1), each normalised with its own weight, into its half of
    the row: rms_norm_pair's one launch for what two norms and a concatenation took three."""
    row = tl.program_id(0)
    side = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    keep = cols < n
    if side == 0:
        x = tl.load(a_ptr + row * stride_a + cols, mask=keep, other=0.0)
        w = tl.load(wa_ptr + cols, mask=keep, other=0.0).to(tl.float32)
    else:
        x = tl.load(b_ptr + row * stride_b + cols, mask=keep, other=0.0)
        w = tl.load(wb_ptr + cols, mask=keep, other=0.0).to(tl.float32)
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / n + eps)
    y = (h * rstd).to(x.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + side * n + cols, (y * w).to(x.dtype), mask=keep)


def rms_norm_pair(a: torch.Tensor, weight_a: torch.Tensor, b: torch.Tensor, weight_b: torch.Tensor,
                  eps: float) -> torch.Tensor:
    rows_a, rows_b = _rows(a), _rows(b)
    n = rows_a.shape[1]
    out = torch.empty(rows_a.shape[0], 2 * n, dtype=a.dtype, device=a.device)
    block = triton.next_power_of_2(n)
    _rms_norm_pair_kernel[(rows_a.shape[0], 2)](rows_a, rows_b, weight_a, weight_b, out, rows_a.stride(0),
                                                rows_b.stride(0), out.stride(0), n, eps, BLOCK=block,
                                                num_warps=min(max(block // 256, 1), 16))
    return out.view(*a.shape[:-1], 2 * n)


@triton.jit
def _quantize_fp8_kernel(x_ptr, q_ptr, scale_ptr, stride_x, stride_q, fp8_max, min_scale, N: tl.constexpr,
                         BLOCK: tl.constexpr):
    """One row: max |x| (first pass), then x / (max / fp8_max) saturated and rounded to float8 e4m3 (second pass).
    N (the row's width, a layer's in_features) is a compile-time constant: a model has a few."""
    row = tl.program_id(0)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in tl.static_range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < N, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), fp8_max), min_scale)
    tl.store(scale_ptr + row, scale)
    for start in tl.static_range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        keep = cols < N
        x = tl.load(x_ptr + row * stride_x + cols, mask=keep, other=0.0).to(tl.float32)
        y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -fp8_max), fp8_max)  # IEEE division, as the twin's
        tl.store(q_ptr + row * stride_q + cols, y.to(q_ptr.dtype.element_ty), mask=keep)


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows = _rows(x)
    n = rows.shape[1]
    q = torch.empty(rows.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(rows.shape[0], 1, dtype=torch.float32, device=x.device)
    block = min(triton.next_power_of_2(n), 4096)
    _quantize_fp8_kernel[(rows.shape[0],)](rows, q, scale, rows.stride(0), q.stride(0), 448.0, 1e-12, N=n, BLOCK=block,
                                           num_warps=min(max(block // 256, 1), 8))
    return q.view(x.shape), scale


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
    from splitspec.kernels.keyed_noise import UNIFORM_BITS

    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.long, device=logits.device)
    _gumbel_argmax_kernel[(rows,)](logits, logits.stride(0), keys.contiguous(), out, V=vocab,
                                   UNIFORM_SHIFT=32 - UNIFORM_BITS, UNIFORM_SCALE=1.0 / 2**UNIFORM_BITS, BLOCK=1024)
    return out


# chain acceptance -------------------------------------------------------------------------------------------
@triton.jit
def _chain_acceptance_kernel(targets_ptr, ids_ptr, lengths_ptr, out_ptr, count, q, n, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    inside = j < n - 1
    token = tl.load(targets_ptr + b * q + j, mask=inside, other=0)
    draft = tl.load(ids_ptr + b * q + 1 + j, mask=inside, other=0)
    # the first draft unlike the target's token; n - 1 (every draft accepted) is the first row past them
    accepted = tl.min(tl.where(inside & (draft == token), BLOCK, j), axis=0).to(tl.int64)
    tl.store(out_ptr + b, accepted)
    tl.store(out_ptr + count + b, b * n + accepted)
    tl.store(out_ptr + 2 * count + b, tl.load(lengths_ptr + b).to(tl.int64) + 1 + accepted)


def chain_acceptance(targets: torch.Tensor, input_ids: torch.Tensor, lengths: torch.Tensor, n: int) -> torch.Tensor:
    """One program per chain (torch_ops.chain_acceptance)."""
    count = lengths.shape[0]
    out = torch.empty((3, count), dtype=torch.long, device=targets.device)
    _chain_acceptance_kernel[(count,)](targets, input_ids, lengths, out, count, targets.shape[0] // count, n,
                                       BLOCK=triton.next_power_of_2(n))
    return out


# draft top-k ----------------------------------------------------------------------------------------------
@triton.jit
def _draft_topk_kernel(logits_ptr, stride, parent_ptr, score_ptr, index_ptr, V: tl.constexpr, K: tl.constexpr,
                       BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    m = float("-inf")
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        m = tl.maximum(m, tl.max(tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32), axis=0))
    z = 0.0
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z += tl.sum(tl.exp(tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32) - m), axis=0)
    parent = tl.load(parent_ptr + row)
    prev_value, prev_index = float("inf"), -1
    for j in tl.static_range(K):  # the j-th largest (value, then lower index first): K more passes
        best_value, best_index = float("-inf"), V
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            ok = (cols < V) & ((x < prev_value) | ((x == prev_value) & (cols > prev_index)))
            x = tl.where(ok, x, float("-inf"))
            top = tl.max(x, axis=0)
            at = tl.min(tl.where(ok & (x == top), cols, V), axis=0)
            take = (top > best_value) | ((top == best_value) & (at < best_index))
            best_value, best_index = tl.where(take, top, best_value), tl.where(take, at, best_index)
        tl.store(score_ptr + row * K + j, parent * (tl.exp(best_value - m) / z))
        tl.store(index_ptr + row * K + j, best_index.to(tl.int64))
        prev_value, prev_index = best_value, best_index


def draft_topk(logits: torch.Tensor, parent_scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One program per row: the softmax's max and normaliser, then k passes for the k largest (logits of any float
    dtype, read as float32: what the twin's logits.float() gives)."""
    rows, vocab = logits.shape
    scores = torch.empty((rows, k), dtype=torch.float32, device=logits.device)
    index = torch.empty((rows, k), dtype=torch.long, device=logits.device)
    _draft_topk_kernel[(rows,)](logits, logits.stride(0), parent_scores.float().contiguous(), scores, index, V=vocab, K=k,
                                BLOCK=min(4096, triton.next_power_of_2(vocab)), num_warps=8)
    return scores, index


# top-k / top-p --------------------------------------------------------------------------------------------
@triton.jit
def _order_key(x):
    """float32 -> int32 with the floats' order (negatives' magnitude bits flipped), widened to int64."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)


@triton.jit
def _top_k_top_p_kernel(logits_ptr, stride, out_ptr, temp_ptr, top_k_ptr, top_p_ptr, V: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    temperature = tl.load(temp_ptr + row)
    top_k = tl.load(top_k_ptr + row)
    top_k = tl.where(top_k > 0, top_k, V)
    top_p = tl.load(top_p_ptr + row)
    m = float("-inf")
    lo_key, hi_key = tl.full((), 2**31, tl.int64), tl.full((), -(2**31), tl.int64)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        keep = cols < V
        x = tl.math.div_rn(tl.load(base + cols, mask=keep, other=0.0), temperature)
        m = tl.maximum(m, tl.max(tl.where(keep, x, float("-inf")), axis=0))
        key = _order_key(x)
        lo_key = tl.minimum(lo_key, tl.min(tl.where(keep, key, 2**31), axis=0))
        hi_key = tl.maximum(hi_key, tl.max(tl.where(keep, key, -(2**31)), axis=0))
    z = 0.0
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.math.div_rn(tl.load(base + cols, mask=cols < V, other=float("-inf")), temperature)
        z += tl.sum(tl.exp(x - m), axis=0)
    # the threshold: the smallest key t with fewer than top_k values above it and at most top_p of the mass
    # above it (true at the row's maximum; lo stays a key below every value, where it is false or unasked)
    lo = lo_key - 1
    hi = hi_key
    for _ in range(33):
        mid = lo + (hi - lo) // 2
        count = 0
        mass = 0.0
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            keep = cols < V
            x = tl.math.div_rn(tl.load(base + cols, mask=keep, other=0.0), temperature)
            above = keep & (_order_key(x) > mid)
            count += tl.sum(above.to(tl.int32), axis=0)
            mass += tl.sum(tl.where(above, tl.exp(x - m), 0.0), axis=0)
        ok = (count < top_k) & (mass <= top_p * z)
        searching = hi - lo > 1
        hi = tl.where(searching & ok, mid, hi)
        lo = tl.where(searching & (ok == 0), mid, lo)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        keep = cols < V
        x = tl.math.div_rn(tl.load(base + cols, mask=keep, other=0.0), temperature)
        tl.store(out_ptr + row * V + cols, tl.where(_order_key(x) >= hi, x, float("-inf")), mask=keep)


def top_k_top_p(logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor,
                top_ps: torch.Tensor) -> torch.Tensor:
    """One program per row finds the kept values' threshold by bisection over the floats' order (33 passes,
    no sort), then writes the tempered row with the rest at -inf."""
    rows, vocab = logits.shape
    out = torch.empty((rows, vocab), dtype=torch.float32, device=logits.device)
    _top_k_top_p_kernel[(rows,)](logits, logits.stride(0), out, temperatures.float().contiguous(),
                                 top_ks.to(torch.int32).contiguous(), top_ps.float().contiguous(), V=vocab,
                                 BLOCK=min(4096, triton.next_power_of_2(vocab)), num_warps=8)
    return out


# SGLang's threshold acceptance, with the bonus token ------------------------------------------------------
@triton.jit
def _rejected(cols, cand_ptr, next_sibling_ptr, tree, first, n: tl.constexpr):
    """Which of cols hold the token of node first or of one of its later siblings (first < 0: none)."""
    removed = cols < 0
    child = first
    for _ in range(n):
        safe = tl.where(child >= 0, child, 0)
        removed = removed | ((child >= 0) & (cols == tl.load(cand_ptr + tree + safe)))
        child = tl.where(child >= 0, tl.load(next_sibling_ptr + tree + safe), -1)
    return removed


@triton.jit
def _accept_tree_coins_kernel(cand_ptr, next_token_ptr, next_sibling_ptr, probs_ptr, coins_ptr, final_coins_ptr,
                              index_ptr, len_ptr, bonus_ptr, threshold_single, threshold_acc, n: tl.constexpr,
                              V: tl.constexpr, MAX_DEPTH: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    tree = row * n
    probs = probs_ptr + row * n * V
    last = tl.full((), 0, tl.int64)
    coin = tl.load(coins_ptr + tree)
    active = tl.full((), 1, tl.int32)
    ended_by_rejection = tl.full((), 0, tl.int32)
    accepted = tl.full((), 0, tl.int64)
    tl.store(index_ptr + row * (MAX_DEPTH + 1), 0)
    for depth in tl.static_range(1, MAX_DEPTH + 1):
        child = tl.where(active != 0, tl.load(next_token_ptr + tree + last), -1)
        has_children = child >= 0
        chosen = tl.full((), -1, tl.int64)
        cumulative = 0.0
        for _ in range(n):  # the children in order, the first that passes is accepted
            trying = (child >= 0) & (chosen < 0)
            safe = tl.where(trying, child, 0)
            p = tl.load(probs + last * V + tl.load(cand_ptr + tree + safe))
            cumulative += tl.where(trying, p, 0.0)
            ratio = cumulative / tl.maximum(threshold_acc, 1e-30)
            passes = trying & ((p >= threshold_single) | (threshold_acc == 0) | (coin <= ratio))
            chosen = tl.where(passes, child, chosen)
            child = tl.where(trying & (passes == 0), tl.load(next_sibling_ptr + tree + safe), -1)
        stop = (active != 0) & (chosen < 0)
        ended_by_rejection = tl.where(stop, has_children.to(tl.int32), ended_by_rejection)
        active = active & (chosen >= 0)
        tl.store(index_ptr + row * (MAX_DEPTH + 1) + depth, tl.where(active != 0, chosen, -1))
        accepted += active.to(tl.int64)
        safe = tl.where(active != 0, chosen, 0)
        coin = tl.where(active != 0, tl.load(coins_ptr + tree + safe), coin)
        last = tl.where(active != 0, chosen, last)
    tl.store(len_ptr + row, accepted)
    # bonus: inverse-CDF draw from the target distribution at the last accepted node, the rejected children's
    # tokens removed (all of its children when the walk ended there by rejecting them)
    rejected_first = tl.where(ended_by_rejection != 0, tl.load(next_token_ptr + tree + last), -1)
    total = 0.0
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        w = tl.load(probs + last * V + cols, mask=cols < V, other=0.0)
        total += tl.sum(tl.where(_rejected(cols, cand_ptr, next_sibling_ptr, tree, rejected_first, n), 0.0, w), axis=0)
    goal = tl.load(final_coins_ptr + tree + last) * total
    running = 0.0
    found = tl.full((), V, tl.int64)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        w = tl.load(probs + last * V + cols, mask=cols < V, other=0.0)
        w = tl.where(_rejected(cols, cand_ptr, next_sibling_ptr, tree, rejected_first, n), 0.0, w)
        cdf = running + tl.cumsum(w, axis=0)
        at = tl.min(tl.where((cdf > goal) & (cols < V), cols, V), axis=0).to(tl.int64)
        found = tl.minimum(found, at)
        running += tl.sum(w, axis=0)
    tl.store(bonus_ptr + row, tl.minimum(found, V - 1))


def accept_tree_coins(candidates: torch.Tensor, next_token: torch.Tensor, next_sibling: torch.Tensor,
                      probs: torch.Tensor, coins: torch.Tensor, final_coins: torch.Tensor, threshold_single: float,
                      threshold_acc: float, max_depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One program per tree: the walk on scalars, then two passes over the vocabulary for the bonus token."""
    batch, n = candidates.shape
    vocab = probs.shape[-1]
    accept_index = torch.empty((batch, max_depth + 1), dtype=torch.long, device=candidates.device)
    accept_len = torch.empty(batch, dtype=torch.long, device=candidates.device)
    bonus = torch.empty(batch, dtype=torch.long, device=candidates.device)
    _accept_tree_coins_kernel[(batch,)](candidates.contiguous(), next_token.contiguous(), next_sibling.contiguous(),
                                        probs.float().contiguous(), coins.float().contiguous(),
                                        final_coins.float().contiguous(), accept_index, accept_len, bonus,
                                        float(threshold_single), float(threshold_acc), n=n, V=vocab, MAX_DEPTH=max_depth,
                                        BLOCK=min(2048, triton.next_power_of_2(vocab)))
    return accept_index, accept_len, bonus
