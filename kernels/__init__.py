"""Triton kernels for the hot paths of a forward, each with a torch twin that computes the same thing.

    rms_norm(x, weight, eps)                    x / rms(x) * weight (HF's order: fp32 norm, cast, times weight)
    add_rms_norm(x, residual, weight, eps)      residual += x (in x's dtype); returns (rms_norm(residual), residual)
    silu_and_mul(gate_up)                       silu(gate) * up of a fused [T, 2I] projection
    apply_rope(q, k, cos_cache, sin_cache, positions, rot_dim)
                                                NeoX rotation of q [T, Hq, D] and k [T, Hkv, D] at positions
    rope_and_store(q, k, v, cos_cache, sin_cache, positions, rot_dim, k_cache, v_cache, slots)
                                                apply_rope, k and v written into the paged cache at slots; returns q

On a CUDA tensor with Triton importable the Triton kernel runs; otherwise (CPU, or SPLITSPEC_KERNELS=torch)
the twin does. Twins are the reference: tests/test_kernels.py compares the two on a GPU.
"""

from __future__ import annotations

from splitspec.kernels.ops import add_rms_norm, apply_rope, rms_norm, rope_and_store, silu_and_mul, twins, use_triton

__all__ = ["add_rms_norm", "apply_rope", "rms_norm", "rope_and_store", "silu_and_mul", "twins", "use_triton"]
