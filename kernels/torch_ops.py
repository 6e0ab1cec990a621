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


def gumbel_argmax(logits: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """argmax_v(logits[b, v] + G(keys[b], v)) for logits [B, V] fp32 and position keys [B]: a position-keyed
    Gumbel-max sample of each row (splitspec.runtime.sampling)."""
    from splitspec.runtime.sampling import gumbel_from_keys

    return (logits + gumbel_from_keys(keys, logits.shape[-1])).argmax(dim=-1)
