"""Sampling parameters and position-keyed sampling (ARCHITECTURE.md §3.2).

A request's token at output position t is

    argmax_v( processed_logits[v] + G(seed, t, v) )

where `processed_logits` are the target logits after temperature, top-k and top-p, and G is Gumbel
noise that depends only on (seed, t, v). Gumbel-max makes this an exact sample of softmax(processed);
keying the noise by position makes it independent of batching, step boundaries and speculation: a
tree verifier computes the target's sample at a node's parent and accepts the child equal to it, so a
seeded request produces the same text with speculation on or off.

The noise (splitspec.kernels.keyed_noise, below both this module and the kernels that fuse it) is a
counter-based integer hash (murmur3's 32-bit finaliser, rounds chained over seed, position and vocabulary
index) evaluated with int64 tensor ops, so CPU, GPU and a Triton kernel can
reproduce it bit for bit. Uniforms take 23 bits, (k + 0.5) / 2^23, exact in fp32 and strictly
inside (0, 1): the Gumbel noise lies in [-2.8, 16.6], a truncation of 2^-24 probability per draw.

Filtering follows SGLang (`top_k_top_p_min_p_sampling_from_probs_torch`): top-p is measured on the
tempered distribution before top-k renormalises it, and a token is removed when the probability mass
ranked strictly before it exceeds top_p.
"""

from __future__ import annotations

import torch

from splitspec.kernels.keyed_noise import (COIN_SALT, FINAL_COIN_SALT, GOLDEN32, MASK32, SEED_SALT,  # noqa: F401
                                           UNIFORM_BITS, _fmix32, _mul32, gumbel_from_keys, position_keys)
from splitspec.runtime.batch import to_device
from splitspec.runtime.sampling_params import SamplingParams


def keyed_gumbel(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise [B, V] fp32 that depends only on (seed, position, vocab index)."""
    return gumbel_from_keys(position_keys(seeds.long(), positions.long()), vocab_size)


def keyed_uniform(seed: int, positions: list[int], salt: int = COIN_SALT) -> list[float]:
    """Uniforms in (0, 1), one per output position, keyed by (seed, position, salt): the coins of
    SGLang's acceptance rule, reproducible like the Gumbel noise."""
    keys = position_keys(torch.full((len(positions),), seed, dtype=torch.long), torch.tensor(positions, dtype=torch.long))
    bits = _fmix32(keys ^ salt)
    return (((bits >> (32 - UNIFORM_BITS)).double() + 0.5) / 2**UNIFORM_BITS).tolist()


def process_logits(logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
                   min_ps: torch.Tensor | None = None) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p as SGLang applies them; removed tokens get -inf.

    logits [B, V] fp32; temperatures [B] (> 0); top_ks [B] (-1 = off); top_ps [B] (1.0 = off); min_ps [B]
    (0 = off). Top-k and top-p: a Triton kernel on a GPU (no sort), its torch twin elsewhere
    (kernels.torch_ops.top_k_top_p says the rule). Min-p keeps a token whose probability is at least min_p
    times the most likely one's; the most likely token survives top-k and top-p, so the test is on the
    tempered logits: logit >= max logit + log(min_p).
    """
    from splitspec.kernels import ops

    processed = ops.top_k_top_p(logits.float(), temperatures.float(), top_ks, top_ps.float())
    if min_ps is not None and bool((min_ps > 0).any()):
        floor = processed.max(dim=-1, keepdim=True).values + torch.log(min_ps.float().clamp_min(1e-38))[:, None]
        processed = processed.masked_fill(processed < floor, float("-inf"))
    return processed


def sample(logits: torch.Tensor, params: list[SamplingParams], output_positions: list[int]) -> torch.Tensor:
    """One token per row of logits [B, V]: argmax for greedy rows, keyed Gumbel-max otherwise."""
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if not rows:
        return tokens
    device = logits.device
    chosen = [params[i] for i in rows]
    if any(p.seed is None for p in chosen):
        raise ValueError("sampling needs a seed per request (SamplingParams.with_seed())")
    index = to_device(torch.tensor(rows), device)  # every host value goes over without waiting for the device
    processed = process_logits(
        logits[index],
        to_device(torch.tensor([p.temperature for p in chosen]), device),
        to_device(torch.tensor([p.top_k for p in chosen]), device),
        to_device(torch.tensor([p.top_p for p in chosen]), device),
        to_device(torch.tensor([p.min_p for p in chosen]), device) if any(p.min_p for p in chosen) else None,
    )
    keys = position_keys(to_device(torch.tensor([p.seed for p in chosen], dtype=torch.long), device),
                         to_device(torch.tensor([output_positions[i] for i in rows], dtype=torch.long), device))
    from splitspec.kernels import ops

    tokens[index] = ops.gumbel_argmax(processed, keys)  # argmax(processed + keyed Gumbel noise)
    return tokens
