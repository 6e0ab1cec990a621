"""The torch twins of the Triton kernels: the reference semantics, and the CPU path."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    residual = residual + x
    return rms_norm(residual, weight, eps), residual


def rms_norm_pair(a: torch.Tensor, weight_a: torch.Tensor, b: torch.Tensor, weight_b: torch.Tensor,
                  eps: float) -> torch.Tensor:
    """[rms_norm(a), rms_norm(b)] side by side (last dim): an EAGLE-3 head's input."""
    return torch.cat([rms_norm(a, weight_a, eps), rms_norm(b, weight_b, eps)], dim=-1)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot_dim: int) -> torch.Tensor:
    """NeoX-style (rotate_half) rotation of the first rot_dim dims; cos/sin [T, 1, rot_dim // 2] fp32."""
    rot, rest = x[..., :rot_dim], x[..., rot_dim:]
    x1, x2 = rot.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return torch.cat((rotated, rest), dim=-1) if rest.numel() else rotated


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
               positions: torch.Tensor, rot_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos_cache[positions].unsqueeze(1), sin_cache[positions].unsqueeze(1)
    return rotate(q, cos, sin, rot_dim), rotate(k, cos, sin, rot_dim)


def rope_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                   positions: torch.Tensor, rot_dim: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slots: torch.Tensor) -> torch.Tensor:
    """apply_rope, then k and v written to the flat caches ([slots, kv_heads, head_dim]) at slots; returns q."""
    q, k = apply_rope(q, k, cos_cache, sin_cache, positions, rot_dim)
    k_cache[slots] = k.to(k_cache.dtype)
    v_cache[slots] = v.to(v_cache.dtype)
    return q


def move_kv_slots(pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """pool [planes, num_slots, width] (every layer's K and V): row src[i] -> row dst[i] in every plane, as if
    the moves ran in order. Tree compaction never reads a row an earlier move wrote (a path's j-th node comes
    from node p_j >= j, and p_j > p_k for k < j), so gathering first and scattering after is the same."""
    pool[:, dst] = pool[:, src]


def verify_tree_greedy(candidates: torch.Tensor, parents: torch.Tensor, targets: torch.Tensor,
                       max_depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy tree acceptance for a batch of trees padded to N nodes (a pad node's parent is -1).

    candidates, parents, targets [B, N]: node tokens, parent nodes, the target's argmax after each node.
    Level by level from the root, the accepted child of the last accepted node is its lowest-indexed child
    whose token equals the target's token there. Returns accept_index [B, max_depth + 1] (path node indices
    from the root, -1 after its end), accept_len [B] (accepted drafts) and bonus [B] (the target's token
    after the last accepted node)."""
    batch, n = candidates.shape
    nodes = torch.arange(n, device=candidates.device)
    last = torch.zeros(batch, dtype=torch.long, device=candidates.device)
    active = torch.ones(batch, dtype=torch.bool, device=candidates.device)
    accept_index = torch.full((batch, max_depth + 1), -1, dtype=torch.long, device=candidates.device)
    accept_index[:, 0] = 0
    accept_len = torch.zeros(batch, dtype=torch.long, device=candidates.device)
    for depth in range(1, max_depth + 1):
        want = targets.gather(1, last[:, None])
        match = (parents == last[:, None]) & (candidates == want) & active[:, None]
        found = torch.where(match, nodes, n).min(dim=1).values
        active = active & (found < n)
        last = torch.where(active, found, last)
        accept_index[:, depth] = torch.where(active, found, -1)
        accept_len += active.long()
    return accept_index, accept_len, targets.gather(1, last[:, None])[:, 0]


def chain_acceptance(targets: torch.Tensor, input_ids: torch.Tensor, lengths: torch.Tensor, n: int) -> torch.Tensor:
    """B verified chains of n nodes, q >= n rows each (targets, input_ids [B * q]: the target's token at every row;
    the rows verified, each chain's root then its n - 1 drafts): [3, B] int64 of each chain's accepted drafts (the
    leading drafts equal to the target's token at the row before), its accepted row among B * n rows (b * n +
    accepted) and its length after acceptance (lengths [B], its verified length, + 1 + accepted)."""
    count = lengths.shape[0]
    q = targets.shape[0] // count
    drafts, tokens = input_ids.view(count, q)[:, 1:n], targets.view(count, q)[:, : n - 1]
    accepted = (drafts == tokens).long().cumprod(1).sum(1)
    starts = torch.arange(0, count * n, n, device=accepted.device)
    return torch.stack([accepted, starts + accepted, lengths.long() + 1 + accepted])


def shift_paged_inputs(shift: torch.Tensor, kv_lens: torch.Tensor, positions: torch.Tensor, kv_indptr: torch.Tensor,
                       page_ids: torch.Tensor, out_slots: torch.Tensor, q: int, page_size: int) -> None:
    """A paged graph's inputs, planned for r requests of q rows at their upper lengths, moved by shift [r] (<= 0) in
    place: the key counts kv_lens [r] (int32), the positions [r * q] and each row's K/V slot out_slots [r * q], row j of
    request i at key index (its moved count - q + j), in page page_ids[kv_indptr[i] + index // page_size]."""
    r = shift.shape[0]
    kv_lens.add_(shift.to(kv_lens.dtype))
    positions[: r * q].view(r, q).add_(shift.view(r, 1))
    index = (kv_lens.view(r, 1).long() - q + torch.arange(q, device=positions.device)).view(-1)
    # (expanded, not repeat_interleave: that reads its output size back from the device, a wait for the whole queue)
    first = kv_indptr[:r].long().view(r, 1).expand(r, q).reshape(-1)
    pages = page_ids.index_select(0, first + torch.div(index, page_size, rounding_mode="floor")).long()
    torch.add(pages * page_size, torch.remainder(index, page_size), out=out_slots[: r * q])


def gumbel_argmax(logits: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """argmax_v(logits[b, v] + G(keys[b], v)) for logits [B, V] fp32 and position keys [B]: a position-keyed
    Gumbel-max sample of each row (splitspec.runtime.sampling)."""
    from splitspec.kernels.keyed_noise import gumbel_from_keys

    return (logits + gumbel_from_keys(keys, logits.shape[-1])).argmax(dim=-1)


def draft_topk(logits: torch.Tensor, parent_scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft step's candidates: for each row of logits [R, V] its k most likely tokens [R, k] and their
    probabilities times the row's parent score [R] (the beam's cumulative score; 1 at the root)."""
    probs, index = torch.softmax(logits.float(), -1).topk(k, dim=-1)
    return parent_scores.float()[:, None] * probs, index


def top_k_top_p(logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor,
                top_ps: torch.Tensor) -> torch.Tensor:
    """Temperature, then SGLang's top-k and top-p on logits [B, V] fp32; removed tokens get -inf.

    A token is kept when fewer than top_k tokens are strictly more likely and the mass of the tokens strictly
    more likely is at most top_p (top-p measured before top-k renormalises; top_k <= 0 and top_p = 1 are off).
    Ties are kept or removed together, so the kept set is every token at or above a threshold: the same with
    any sort and in the Triton kernel, which finds that threshold without sorting."""
    scaled = logits / temperatures[:, None]
    values = scaled.sort(dim=-1, descending=True).values  # [B, V]
    probs = values.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    first = torch.searchsorted(-values, -values)  # each value's tie group's first position = tokens strictly above
    mass_above = mass_before.gather(1, first)
    k = torch.where(top_ks > 0, top_ks, scaled.shape[-1]).to(first.dtype)[:, None]
    kept = ((first < k) & (mass_above <= top_ps[:, None])).sum(dim=-1)  # a prefix of the sorted row, at least 1
    threshold = values.gather(1, (kept - 1).clamp(min=0)[:, None])
    return scaled.masked_fill(scaled < threshold, float("-inf"))


def accept_tree_coins(candidates: torch.Tensor, next_token: torch.Tensor, next_sibling: torch.Tensor,
                      probs: torch.Tensor, coins: torch.Tensor, final_coins: torch.Tensor, threshold_single: float,
                      threshold_acc: float, max_depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SGLang's threshold rule (verifier_svc.acceptance.accept_with_coins) for a batch of padded trees.

    candidates, next_token, next_sibling [B, N] (links as runtime.tree.child_links, -1 none); probs [B, N, V]
    the processed target distribution after each node; coins, final_coins [B, N]. Level by level, the
    children of the last accepted node are tried in order and child c is accepted when p(c) >= threshold_single
    or the level's coin <= (mass of the children tried so far) / threshold_acc. The bonus token is the
    inverse-CDF draw, with the last node's final coin, from its distribution without the children rejected
    there. Returns accept_index [B, max_depth + 1] (path nodes, -1 after the end), accept_len [B], bonus [B]."""
    batch, n = candidates.shape
    device = candidates.device
    rows = torch.arange(batch, device=device)
    last = torch.zeros(batch, dtype=torch.long, device=device)
    coin = coins[:, 0].float()
    active = torch.ones(batch, dtype=torch.bool, device=device)
    ended_by_rejection = torch.zeros(batch, dtype=torch.bool, device=device)
    accept_index = torch.full((batch, max_depth + 1), -1, dtype=torch.long, device=device)
    accept_index[:, 0] = 0
    for depth in range(1, max_depth + 1):
        child = torch.where(active, next_token[rows, last], -1)
        has_children = child >= 0
        chosen = torch.full_like(child, -1)
        cumulative = torch.zeros(batch, dtype=torch.float32, device=device)
        for _ in range(n):
            trying = (child >= 0) & (chosen < 0)
            safe = child.clamp(min=0)
            p = probs[rows, last, candidates[rows, safe]].float()
            cumulative = cumulative + torch.where(trying, p, 0.0)
            passes = trying & ((p >= threshold_single) | (threshold_acc == 0)
                               | (coin <= cumulative / (threshold_acc or 1.0)))
            chosen = torch.where(passes, child, chosen)
            child = torch.where(trying & ~passes, next_sibling[rows, safe], -1)
        stop = active & (chosen < 0)
        ended_by_rejection = torch.where(stop, has_children, ended_by_rejection)
        active = active & (chosen >= 0)
        accept_index[:, depth] = torch.where(active, chosen, -1)
        safe = chosen.clamp(min=0)
        coin = torch.where(active, coins[rows, safe].float(), coin)
        last = torch.where(active, chosen, last)
    weights = probs[rows, last].float().clone()  # [B, V]
    for b in torch.nonzero(ended_by_rejection).flatten().tolist():
        child = int(next_token[b, last[b]])
        while child >= 0:
            weights[b, candidates[b, child]] = 0.0
            child = int(next_sibling[b, child])
    cdf = weights.cumsum(dim=-1)
    goal = final_coins[rows, last].float() * cdf[:, -1]
    bonus = torch.searchsorted(cdf, goal[:, None], right=True)[:, 0].clamp(max=weights.shape[-1] - 1)
    return accept_index, (accept_index[:, 1:] >= 0).sum(dim=-1), bonus


FP8_E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
FP8_MIN_SCALE = 1e-12  # an all-zero row gets this scale instead of 0


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [T, K] -> (float8_e4m3fn [T, K], scale [T, 1] float32): each row's own dynamic scale
    max|x| / 448, and x / scale rounded to the nearest float8 (saturating)."""
    amax = torch.linalg.vector_norm(x, ord=float("inf"), dim=-1, keepdim=True, dtype=torch.float32)  # max |x|
    # an IEEE division as the Triton kernel's: CUDA divides a tensor by a Python scalar as a product with its
    # reciprocal, one ulp off for some rows
    scale = (amax / torch.full_like(amax, FP8_E4M3_MAX)).clamp(min=FP8_MIN_SCALE)
    return (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn), scale


def tree_mask_bits(kv_lens: torch.Tensor, byte_offsets: torch.Tensor, ancestors: torch.Tensor, out: torch.Tensor) -> None:
    """Request r's attention mask over its kv_lens[r] keys, packed to bits into out from byte byte_offsets[r] (until
    byte_offsets[r + 1]): Q rows of kv_lens[r] elements, row-major, little bit order (FlashInfer's custom mask).
    Element (i, c) is 1 for a key of the cached prefix (c < kv_lens[r] - Q), else bit d = c - (kv_lens[r] - Q) of
    node i's ancestor bits, ancestors[r, i, d // 16] >> d % 16 (16 bits a word: node i and its ancestors set).
    Bits past a request's Q * kv_lens[r] in its last byte are 0; bytes outside the requests' ranges are kept.
    No host sync (a CUDA graph captures it): every byte of out is computed, those outside kept as they were."""
    requests, q, _ = ancestors.shape
    device = out.device
    b = torch.arange(out.numel(), device=device)
    offsets = byte_offsets.long()
    r = torch.searchsorted(offsets[1:].contiguous(), b, right=True).clamp(max=requests - 1)
    live = b < offsets[r + 1]
    e = (b - offsets[r])[:, None] * 8 + torch.arange(8, device=device)
    kv = kv_lens.long()[r][:, None]
    i = e // kv
    d = e - i * kv - (kv - q)
    dd = d.clamp(min=0)
    word = ancestors.long()[r[:, None], i.clamp(max=q - 1), dd // 16]
    bit = torch.where(d >= 0, (word >> (dd % 16)) & 1, 1)
    bit = torch.where(i < q, bit, 0)
    packed = (bit << torch.arange(8, device=device)).sum(-1).to(torch.uint8)
    out.copy_(torch.where(live, packed, out))


def merge_own_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, out_prefix: torch.Tensor,
                        lse_prefix: torch.Tensor, scale: float) -> torch.Tensor:
    """Each row's attention over its own keys merged with its attention over other keys: q [R, Hq, D], keys and
    values [R, J, Hkv, D] (grouped-query heads share them), out_prefix [R, Hq, D] and lse_prefix [R, Hq] (fp32,
    natural-log sum of exp) the attention over the others -> [R, Hq, D] in q's dtype. One softmax in which the
    others are one more key, scored by their log-sum-exp and valued at their output."""
    rows, heads, dim = q.shape
    kv = keys.shape[2]
    group = (rows, kv, heads // kv)
    scores = torch.einsum("rhgd,rjhd->rhgj", q.float().reshape(*group, dim), keys.float()) * scale
    weights = torch.softmax(torch.cat([lse_prefix.float().reshape(*group, 1), scores], -1), -1)
    out = weights[..., :1] * out_prefix.float().reshape(*group, dim) \
        + torch.einsum("rhgj,rjhd->rhgd", weights[..., 1:], values.float())
    return out.reshape(rows, heads, dim).to(q.dtype)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_size: int, qo: torch.Tensor,
                    kv_indptr: torch.Tensor, kv_lens: torch.Tensor, page_ids: torch.Tensor, ancestors: torch.Tensor | None,
                    mode: int, scale: float, out: torch.Tensor | None = None,
                    lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Request b's rows of q [T, Hq, D] (qo[b] to qo[b + 1]) over its kv_lens[b] keys, which sit in pages
    page_ids[kv_indptr[b]:] of k_cache and v_cache [slots, Hkv, D] (slot = page * page_size + offset), each row seeing,
    by mode: 0 every key; 1 the keys up to its own (row i of n is key kv_len - n + i); 2 the keys before the request's
    n new ones and the new ones its ancestor bits name (ancestors [B, n, W] int32, 16 bits a word). -> (out [T, Hq, D]
    in q's dtype, lse [T, Hq] float32 natural log, or None unless mode 0 or lse is given); rows outside every request
    are not written. Reads the offsets and lengths on the host (the Triton kernel does not)."""
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    out = torch.empty_like(q) if out is None else out
    if lse is None and mode == 0:
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    qo_h, base_h, kv_h = qo.tolist(), kv_indptr.tolist(), kv_lens.tolist()
    for b in range(len(qo_h) - 1):
        n, kv = qo_h[b + 1] - qo_h[b], kv_h[b]
        if n == 0:
            continue
        j = torch.arange(kv, device=q.device)
        slots = page_ids[base_h[b] + j // page_size].long() * page_size + j % page_size
        keys = k_cache[slots].float().repeat_interleave(heads // kv_heads, 1)  # [kv, Hq, D]
        values = v_cache[slots].float().repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("ihd,jhd->hij", q[qo_h[b]:qo_h[b + 1]].float(), keys) * scale
        if mode == 1:
            seen = j[None, :] <= kv - n + torch.arange(n, device=q.device)[:, None]
        elif mode == 2:
            node = (j - (kv - n)).clamp(min=0)
            words = ancestors[b].long()[:, node // 16]  # [n, kv]
            seen = (j < kv - n)[None, :] | (((words >> (node % 16)) & 1) == 1)
        else:
            seen = torch.ones(n, kv, dtype=torch.bool, device=q.device)
        scores = scores.masked_fill(~seen, float("-inf"))
        rows_lse = torch.logsumexp(scores, -1)  # [Hq, n]
        weights = torch.exp(scores - rows_lse.clamp(min=torch.finfo(torch.float32).min)[..., None])
        out[qo_h[b]:qo_h[b + 1]] = torch.einsum("hij,jhd->ihd", weights, values).to(out.dtype)
        if lse is not None:
            lse[qo_h[b]:qo_h[b + 1]] = rows_lse.t()
    return out, lse
