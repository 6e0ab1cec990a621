"""Layers shared by every model family."""

from __future__ import annotations

import torch
from torch import nn

from splitspec import kernels


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back (as HF Llama/Qwen do)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """residual given: (norm(residual + x), residual + x), the add fused into the norm on a GPU."""
        if residual is None:
            return kernels.rms_norm(x, self.weight, self.eps)
        return kernels.add_rms_norm(x, residual, self.weight, self.eps)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused into one [2I, H] projection."""

    # checkpoint name -> index of its block in the fused weight (rows along dim 0)
    packed = {"gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.silu_and_mul(self.gate_up_proj(x)))
