"""Triton kernel (CUDA only): attention of a few query rows a request over its keys in the paged KV cache, in one
launch with no host planning (kernels.torch_ops.paged_attention is its twin).

What a speculative step's CUDA graphs attend with at small batch: a tree verification (each node sees the cached
prefix and its ancestors), a head's catch-up chain (causal), a draft loop's beams over the committed prefix (no mask,
their log-sum-exp wanted for the merge with their own keys). FlashInfer serves these with a planned, persistent
prefill kernel and a separate merge of its split-KV partial results: ~12 + 3 us a layer for a 6-node chain over 256
keys on an H100, and a C++ planner run on the host every step. Here every index the kernel reads (query offsets,
page offsets, key lengths, page ids, the nodes' ancestor bits) is a device buffer that one copy fills, so a graph
replays without a plan.

One program per (request, key-value head, split): its rows are the request's query rows times the head's grouped
query heads, one online softmax (base 2) over its share of the keys. A request whose keys need more than one split
(MIN_CHUNK keys at least a split) has each split write its partial output and log-sum-exp to a scratch buffer; the
last split to finish (an atomic count per request and head) merges them and resets the count for the next launch.

The splits, the least keys a split and a tree's rows and words are runtime arguments, not constexprs: a verifier
compiles one kernel a graph kind (mode, rows rounded to a power of 2), not one for every captured batch size's splits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PREFIX, CAUSAL, TREE = 0, 1, 2  # what a row sees: every key / keys up to its own position / the prefix and ancestors
BLOCK_N = 64  # keys a loop step
MIN_CHUNK = 64  # keys a split at least: one loop step (256 was slower at 21 of 24 demo-shape points, H100)
TARGET_PROGRAMS = 264  # splits are added until (requests x key-value heads x splits) reaches ~2 programs an H100 SM
MAX_SPLITS = 16


@triton.jit
def _paged_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, part_ptr, part_lse_ptr, lock_ptr, qo_ptr,
                            kv_indptr_ptr, kv_len_ptr, ids_ptr, anc_ptr, sq_t, sq_h, sk_s, sk_h, sv_s, sv_h, so_t, so_h,
                            scale_log2, num_kv_heads, splits, min_chunk, max_rows, words, MODE: tl.constexpr,
                            PAGE: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_G:
                            tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, WRITE_LSE: tl.constexpr,
                            IEEE: tl.constexpr, ONE_WORD: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    q_start = tl.load(qo_ptr + b)
    n_q = tl.load(qo_ptr + b + 1) - q_start
    kv_len = tl.load(kv_len_ptr + b)
    chunk = tl.maximum(tl.cdiv(tl.cdiv(kv_len, splits), BLOCK_N) * BLOCK_N, min_chunk)
    active = tl.cdiv(kv_len, chunk)
    if s >= active:
        return
    M: tl.constexpr = BLOCK_Q * BLOCK_G
    r = tl.arange(0, M)
    i = r // BLOCK_G  # the row's query token among the request's
    g = r % BLOCK_G  # its query head among the key-value head's group
    live_r = (i < n_q) & (g < G)
    d = tl.arange(0, BLOCK_D)
    live_d = d < D
    heads = h * G + g
    q = tl.load(q_ptr + (q_start + i)[:, None] * sq_t + heads[:, None] * sq_h + d[None, :],
                mask=live_r[:, None] & live_d[None, :], other=0.0)
    prefix = kv_len - n_q  # keys before the request's new tokens
    kv_base = tl.load(kv_indptr_ptr + b)
    anc = anc_ptr + b * max_rows * words  # the request's ancestor words [rows, words] (a tree's)
    row_word = _row_words(anc, i, live_r, MODE, ONE_WORD)
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, BLOCK_D], tl.float32)
    end = tl.minimum(s * chunk + chunk, kv_len)  # this split's keys: s * chunk up to end
    for n0 in range(s * chunk, end, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        live_j = j < end
        page = tl.load(ids_ptr + kv_base + j // PAGE, mask=live_j, other=0)
        slot = page.to(tl.int64) * PAGE + j % PAGE
        kv_mask = live_j[:, None] & live_d[None, :]
        k = tl.load(k_ptr + slot[:, None] * sk_s + h * sk_h + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + slot[:, None] * sv_s + h * sv_h + d[None, :], mask=kv_mask, other=0.0)
        if IEEE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = scores * scale_log2
        seen = _seen(live_r[:, None] & live_j[None, :], i, j, prefix, anc, words, row_word, MODE, ONE_WORD)
        scores = tl.where(seen, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out_rows = (q_start + i)[:, None] * so_t + heads[:, None] * so_h + d[None, :]
    out_mask = live_r[:, None] & live_d[None, :]
    lse2 = m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0))  # -inf for a row that saw no key
    if active == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + out_rows, out.to(out_ptr.dtype.element_ty), mask=out_mask)
        if WRITE_LSE:
            tl.store(lse_ptr + (q_start + i) * (num_kv_heads * G) + heads, lse2 * 0.6931471805599453, mask=live_r)
    else:
        part = ((b * num_kv_heads + h) * splits + s) * M
        tl.store(part_ptr + (part + r)[:, None] * BLOCK_D + d[None, :], acc / tl.where(l_i > 0, l_i, 1.0)[:, None])
        tl.store(part_lse_ptr + part + r, lse2)
        tl.debug_barrier()  # every thread's partial stored before the count says so
        done = tl.atomic_add(lock_ptr + b * num_kv_heads + h, 1, sem="acq_rel", scope="gpu")
        if done == active - 1:  # the last split of this request and head: merge every split's partial result
            tl.debug_barrier()
            out, lse_all = _merge(part_ptr, part_lse_ptr, (b * num_kv_heads + h) * splits * M, r, d, active, M, BLOCK_D)
            tl.store(out_ptr + out_rows, out.to(out_ptr.dtype.element_ty), mask=out_mask)
            if WRITE_LSE:
                tl.store(lse_ptr + (q_start + i) * (num_kv_heads * G) + heads, lse_all * 0.6931471805599453, mask=live_r)
            tl.atomic_xchg(lock_ptr + b * num_kv_heads + h, 0, sem="relaxed", scope="gpu")


@triton.jit
def _row_words(anc_ptr, i, live_r, MODE: tl.constexpr, ONE_WORD: tl.constexpr):
    """Each row's one ancestor word in a tree of up to 16 nodes, read once before the key loop (not a gather per key);
    zeros otherwise."""
    word = i * 0
    if MODE == 2:
        if ONE_WORD:
            word = tl.load(anc_ptr + i, mask=live_r, other=0)
    return word


@triton.jit
def _seen(seen, i, j, prefix, anc_ptr, words, row_word, MODE: tl.constexpr, ONE_WORD: tl.constexpr):
    """Which keys j (columns) each row sees, of those `seen` allows: MODE 0 all, 1 up to its own key (row i is key
    prefix + i), 2 the prefix and the nodes its ancestor bits name (anc_ptr: the request's [rows, words] words; with
    ONE_WORD, row_word: each row's only word, loaded before the key loop, so no gather lies on a loop step's path)."""
    if MODE == 1:
        seen = seen & (j[None, :] <= prefix + i[:, None])
    if MODE == 2:
        node = j[None, :] - prefix
        in_tree = node >= 0
        nn = tl.where(in_tree, node, 0)
        if ONE_WORD:  # nn < 16 where in_tree: the tree has at most 16 nodes
            bit = (row_word[:, None] >> (nn & 15)) & 1
        else:
            word = tl.load(anc_ptr + (i[:, None] * words + nn // 16), mask=seen & in_tree, other=0)
            bit = (word >> (nn % 16)) & 1
        seen = seen & ((~in_tree) | (bit != 0))
    return seen


@triton.jit
def _merge(part_ptr, part_lse_ptr, first, r, d, active, M: tl.constexpr, BLOCK_D: tl.constexpr):
    """(output, base-2 log-sum-exp) of `active` splits' partial results (each normalised, with its log-sum-exp) from
    row `first` of the scratch on; read past L1 (other programs wrote them)."""
    top = tl.full([M], float("-inf"), tl.float32)
    for sp in range(0, active):
        top = tl.maximum(top, tl.load(part_lse_ptr + first + sp * M + r, cache_modifier=".cg"))
    safe = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros([M], tl.float32)
    merged = tl.zeros([M, BLOCK_D], tl.float32)
    for sp in range(0, active):
        w = tl.exp2(tl.load(part_lse_ptr + first + sp * M + r, cache_modifier=".cg") - safe)
        o = tl.load(part_ptr + (first + sp * M + r)[:, None] * BLOCK_D + d[None, :], cache_modifier=".cg")
        merged += w[:, None] * o
        total += w
    lse = tl.where(top == float("-inf"), float("-inf"), safe + tl.log2(tl.where(total > 0, total, 1.0)))
    return merged / tl.where(total > 0, total, 1.0)[:, None], lse


def splits_for(requests: int, kv_heads: int) -> int:
    """Splits of each request's keys for a launch over this many requests: enough programs to fill the device."""
    return max(1, min(MAX_SPLITS, -(-TARGET_PROGRAMS // (requests * kv_heads))))


def shared_scratch(max_rows: int, group: int, head_dim: int, device: torch.device) -> tuple:
    """Partial outputs, log-sum-exps and counts that every launch of at most max_rows rows a request with
    splits_for's splits can share (launches on one stream, one after another; the last split resets its count):
    splits > 1 only below TARGET_PROGRAMS requests x heads, so fewer than 2 x TARGET_PROGRAMS partial results.
    paged_attention's `work` is these and the launch's splits."""
    parts = 2 * TARGET_PROGRAMS * _rows(max_rows, group)
    return (torch.empty(parts * triton.next_power_of_2(head_dim), dtype=torch.float32, device=device),
            torch.empty(parts, dtype=torch.float32, device=device),
            torch.zeros(TARGET_PROGRAMS, dtype=torch.int32, device=device))


def _rows(max_rows: int, group: int) -> int:
    block_g = triton.next_power_of_2(group)
    return max(triton.next_power_of_2(max_rows), 16 // block_g if block_g < 16 else 1) * block_g


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_size: int, qo: torch.Tensor,
                    kv_indptr: torch.Tensor, kv_lens: torch.Tensor, page_ids: torch.Tensor, ancestors: torch.Tensor | None,
                    mode: int, scale: float, max_rows: int, work: tuple, out: torch.Tensor | None = None,
                    lse: torch.Tensor | None = None, min_chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out [T, Hq, D] in q's dtype, lse [T, Hq] natural log or None) of every request's rows of q [T, Hq, D] (request
    b's from qo[b] to qo[b + 1], at most max_rows) over its kv_lens[b] keys in pages page_ids[kv_indptr[b]:], k_cache
    and v_cache [slots, Hkv, D] (a layer's pages flattened), seen as `mode` says (TREE: ancestors [B, max_rows, W]
    int32, 16 bits a word); `work`: shared_scratch's buffers and the splits; a split takes at least min_chunk keys (a multiple of
    BLOCK_N; default MIN_CHUNK, read at the call). Rows of q outside every request are not written."""
    requests = qo.numel() - 1
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    out = torch.empty_like(q) if out is None else out
    want_lse = lse is not None or mode == PREFIX
    if want_lse and lse is None:
        lse = torch.empty(q.shape[0], heads, dtype=torch.float32, device=q.device)
    block_g = triton.next_power_of_2(group)
    block_q = _rows(max_rows, group) // block_g
    words = 1 if ancestors is None else ancestors.shape[-1]
    anc = qo if ancestors is None else ancestors
    part, part_lse, lock, splits = work
    _paged_attention_kernel[(requests, kv_heads, splits)](
        q, k_cache, v_cache, out, lse if want_lse else out, part, part_lse, lock, qo, kv_indptr, kv_lens, page_ids, anc,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), scale * 1.4426950408889634, kv_heads, splits,
        MIN_CHUNK if min_chunk is None else min_chunk, max_rows, words, MODE=mode, PAGE=page_size, G=group, D=dim,
        BLOCK_Q=block_q, BLOCK_G=block_g, BLOCK_D=triton.next_power_of_2(dim), BLOCK_N=BLOCK_N, WRITE_LSE=want_lse,
        IEEE=q.dtype == torch.float32, ONE_WORD=words == 1, num_warps=4)
    return out, (lse if want_lse else None)
