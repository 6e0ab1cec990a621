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
