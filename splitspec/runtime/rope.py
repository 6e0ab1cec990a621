"""Rotary position embedding: inverse frequencies per rope type, and the rotation itself.

The frequency formulas are those of transformers' `modeling_rope_utils` (tests compare the two), so a
checkpoint rotates the same here as in the reference implementation.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from splitspec import kernels
from splitspec.kernels import torch_ops
from splitspec.runtime.config import RopeConfig


def rotary_dim(rope: RopeConfig, head_dim: int) -> int:
    return int(head_dim * rope.partial_rotary_factor)


def inv_freq_and_scale(rope: RopeConfig, head_dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rot_dim // 2] in fp32, attention scale applied to cos and sin)."""
    dim = rotary_dim(rope, head_dim)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # [dim // 2]
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "default":
        return inv_freq, 1.0
    if rope.rope_type == "linear":
        return inv_freq / float(rope.get("factor")), 1.0
    if rope.rope_type == "llama3":
        return _llama3(inv_freq, rope), 1.0
    if rope.rope_type == "yarn":
        return _yarn(rope, dim, max_position_embeddings)
    raise ValueError(f"rope type {rope.rope_type!r} is not supported")


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short kept, the band between interpolated."""
    factor = float(rope.get("factor"))
    low_freq_factor = float(rope.get("low_freq_factor"))
    high_freq_factor = float(rope.get("high_freq_factor"))
    old_context_len = float(rope.get("original_max_position_embeddings"))
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(rope: RopeConfig, dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    factor = float(rope.get("factor"))
    original_max = rope.get("original_max_position_embeddings") or max_position_embeddings

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = rope.get("attention_factor")
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = rope.get("beta_fast") or 32
    beta_slow = rope.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


# CUDA graphs read the cache at the address they were captured with, so before the first capture it is made for every
# position a forward can ask for, never to move again: the model's context and the draft nodes past it (a tree verified
# near a request's limit, a draft loop's beam steps after it: tokens past the limit are dropped at emit, but their
# positions are still rotated). A tree of up to this many nodes a request is covered twice over.
POSITIONS_PAST_CONTEXT = 1024


class RotaryEmbedding(nn.Module):
    """RoPE at explicit positions (tree depths allowed) for q [T, Hq, D] and k [T, Hkv, D].

    cos/sin live in a per-position fp32 cache ([num_positions, rot_dim // 2]); `reserve` grows it outside the
    forward (from CPU-side positions, so no device sync) until `reserve_for_graphs` fixes it for CUDA graphs,
    `cos_sin` gathers once per batch and `apply` rotates in every layer.
    """

    def __init__(self, rope: RopeConfig, head_dim: int, max_position_embeddings: int):
        super().__init__()
        self.rot_dim = rotary_dim(rope, head_dim)
        self._rope, self._head_dim, self._max_pos = rope, head_dim, max_position_embeddings
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None
        self._device: torch.device | None = None  # as the caller names it ("cuda" and "cuda:0" differ)
        self._fixed = False  # reserve_for_graphs made it: it never moves again

    @property
    def cos_cache(self) -> torch.Tensor:
        return self._cos

    @property
    def sin_cache(self) -> torch.Tensor:
        return self._sin

    @property
    def num_cached_positions(self) -> int:
        return 0 if self._cos is None else self._cos.shape[0]

    def reserve(self, num_positions: int, device: torch.device) -> None:
        """Make the cache cover positions [0, num_positions) on `device`."""
        device = torch.device(device)
        if self._device == device and self.num_cached_positions >= num_positions:
            return
        if self._fixed:  # moving it would leave captured graphs reading freed memory: refused, loudly
            raise RuntimeError(f"RoPE positions up to {num_positions - 1} on {device} asked of a cache fixed at "
                               f"{self.num_cached_positions} positions on {self._device} for CUDA graphs (a draft "
                               f"tree more than {POSITIONS_PAST_CONTEXT} positions past the model's context)")
        grow = 2 * self.num_cached_positions if self._device == device else 0  # amortise growth, never re-double
        size = max(num_positions, grow, 1)
        inv_freq, scale = inv_freq_and_scale(self._rope, self._head_dim, self._max_pos)
        freqs = torch.arange(size, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [size, rot_dim // 2]
        self._cos = (freqs.cos() * scale).to(device)
        self._sin = (freqs.sin() * scale).to(device)
        self._device = device

    def reserve_for_graphs(self, context: int, device: torch.device) -> None:
        """Before a CUDA graph captures it: the cache for every position a forward can ask for (the model's context
        and POSITIONS_PAST_CONTEXT more), fixed there. Before, a tree verified at a request's limit (the context's
        end) asked for positions past the context, the cache grew, and graphs captured earlier went on reading the
        freed one."""
        self.reserve(context + POSITIONS_PAST_CONTEXT, device)
        self._fixed = True

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] positions -> cos, sin [T, 1, rot_dim // 2] (positions must be reserved)."""
        return self._cos[positions].unsqueeze(1), self._sin[positions].unsqueeze(1)

    def apply(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate with gathered cos/sin (the torch path, differentiable: the head trainer uses it)."""
        return torch_ops.rotate(q, cos, sin, self.rot_dim), torch_ops.rotate(k, cos, sin, self.rot_dim)

    def rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """NeoX-style (rotate_half) rotation of the first rot_dim dims at `positions` (reserved), as HF
        Llama/Qwen do: one Triton kernel on a GPU (splitspec.kernels), the torch twin elsewhere."""
        return kernels.apply_rope(q, k, self._cos, self._sin, positions, self.rot_dim)
