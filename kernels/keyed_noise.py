"""The counter-based noise that keys sampling by (seed, output position, vocabulary index), for
splitspec.runtime.sampling (which says why) and the kernels that fuse it: murmur3's 32-bit finaliser
evaluated with int64 tensor ops, so the CPU, a GPU and a Triton kernel reproduce it bit for bit. Uniforms
take 23 bits, (k + 0.5) / 2^23, exact in fp32 and strictly inside (0, 1).

It lives below both: the sampling module calls the kernels, and the kernels' torch twin and Triton kernel
reproduce this noise."""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
GOLDEN32 = 0x9E3779B9
SEED_SALT = 0x243F6A88
COIN_SALT = 0x5BD1E995  # keys the coin-rule uniforms apart from the Gumbel noise
FINAL_COIN_SALT = 0x27D4EB2F  # and the bonus-token coin apart from the level coins
UNIFORM_BITS = 23  # (k + 0.5) / 2^23 is exact in fp32 for k < 2^23, so a uniform is never 0 or 1


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """(h * c) mod 2^32 for uint32 h and c, in int64 without overflow (16-bit halves)."""
    low = (h & 0xFFFF) * c  # < 2^48
    high = (((h >> 16) * c) & 0xFFFF) << 16  # < 2^32
    return (low + high) & MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 tensors holding uint32 values (a bijection of uint32)."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def position_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[B] int64 seeds and output positions -> [B] uint32 keys (as int64)."""
    key = _fmix32((seeds & MASK32) ^ SEED_SALT)
    key = _fmix32(key ^ ((seeds >> 32) & MASK32))
    return _fmix32(key ^ (positions & MASK32))


def gumbel_from_keys(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The noise [B, V] of rows keyed by position_keys [B] (kernels.ops.gumbel_argmax fuses it on a GPU)."""
    keys = keys[:, None]  # [B, 1]
    vocab = _mul32(torch.arange(vocab_size, device=keys.device, dtype=torch.long), GOLDEN32)  # [V]
    bits = _fmix32((_fmix32(vocab[None, :] ^ keys) + keys) & MASK32)  # [B, V]
    uniform = ((bits >> (32 - UNIFORM_BITS)).float() + 0.5) * (1.0 / 2**UNIFORM_BITS)  # strictly in (0, 1)
    return -torch.log(-torch.log(uniform))
