"""FP8 weights: float8_e4m3fn values with one float32 scale per output channel, and the linear layer
that computes with them (SGLang's / vLLM's `--quantization fp8`).

    quantize:    s[j] = max_i |W[j, i]| / 448            one scale per output row (per channel)
                 Q[j, i] = fp8(W[j, i] / s[j])            448: the largest float8_e4m3fn value
    dequantize:  W~[j, i] = Q[j, i] * s[j]

Per-channel rather than per-tensor scales: each row uses fp8's whole range, so a row of small weights
is not crushed by another row's outlier, at the cost of 4 bytes per row (0.1% of a 4096-wide row).
The scale factors out of the matrix product, y[:, j] = s[j] * (x @ Q^T)[:, j], so a per-channel weight
needs no dequantized copy; and a fused projection (q/k/v, gate/up) quantizes each checkpoint block
row by row exactly as it would the fused matrix. Per-tensor checkpoint scales are per-channel scales
that happen to be equal along a block, so they load without requantizing.

Fp8Linear computes y = x W~^T + b one of three ways, chosen once per layer at load (`gemm_kind`):

    rowwise     CUDA, compute capability >= 8.9, bf16 activations: W8A8. x is quantized to fp8 per
                token (a dynamic scale per row of x), then torch._scaled_mm with row-wise scales
                (scale_a [T, 1], scale_b [1, N]) writes bf16.
    tensorwise  the same GPUs where row-wise scaling is not available (or fp16/fp32 activations): x
                quantized with one dynamic scale per call; torch._scaled_mm in fp32, then times the
                weight's channel scales.
    twin        CPU, older GPUs, and layers whose sizes torch._scaled_mm refuses (not multiples of 16):
                weight-only FP8, Q cast to the activation dtype (exact: every fp8 value is a bf16 value)
                and F.linear, then the channel scales.

`fp8_linear_reference` is the float32 definition the three are tested against. No path syncs with the
host (no .item(), no data-dependent shapes), so CUDA graphs and torch.compile capture them.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from splitspec import kernels

logger = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
MIN_SCALE = 1e-12  # an all-zero row (or token) gets this scale instead of 0
SCALED_MM_ALIGNMENT = 16  # torch._scaled_mm needs K and N multiples of 16
GEMM_KINDS = ("rowwise", "tensorwise", "twin")


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (Q [N, K] float8_e4m3fn, s [N] float32) with weight ~= Q * s[:, None]."""
    w = weight.float()
    scale = (w.abs().amax(dim=-1) / FP8_MAX).clamp(min=MIN_SCALE)  # [N]
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Q [N, K] fp8, s [N] (or a scalar) -> Q * s in dtype."""
    scale = scale.float().reshape(-1, 1) if scale.numel() > 1 else scale.float().reshape(())
    return (q.float() * scale).to(dtype)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [T, K] -> (fp8 [T, K], scale [T, 1] float32): each token's own dynamic scale (one Triton
    kernel on a GPU: kernels.quantize_fp8_per_token)."""
    return kernels.quantize_fp8_per_token(x)


def quantize_per_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [T, K] -> (fp8 [T, K], scale [] float32): one dynamic scale for the whole tensor."""
    amax = torch.linalg.vector_norm(x, ord=float("inf"), dtype=torch.float32)
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def fp8_linear_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The definition, in float32: x @ (Q * s)^T + b (the weight dequantized, x as it is)."""
    return F.linear(x.float(), dequantize(q, scale), None if bias is None else bias.float())


def fp8_gemm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, kind: str) -> torch.Tensor:
    """y = x @ (Q * s)^T + b in x's dtype, by `kind` (see the module docstring). x [T, K], q [N, K] fp8,
    scale [N] float32, bias [N] or None."""
    if kind == "twin":
        y = (F.linear(x, q.to(x.dtype)) * scale).to(x.dtype)  # fp8 -> bf16/fp16/fp32 is exact
    elif kind == "rowwise":
        xq, x_scale = quantize_per_token(x)
        y = torch._scaled_mm(xq, q.t(), scale_a=x_scale, scale_b=scale.view(1, -1), out_dtype=x.dtype)
    elif kind == "tensorwise":
        xq, x_scale = quantize_per_tensor(x)
        one = torch.ones((), device=x.device, dtype=torch.float32)
        y = torch._scaled_mm(xq, q.t(), scale_a=x_scale, scale_b=one, out_dtype=torch.float32)
        y = (y * scale).to(x.dtype)
    else:
        raise ValueError(f"unknown FP8 GEMM kind {kind!r} (one of {', '.join(GEMM_KINDS)})")
    return y if bias is None else y + bias  # bias apart: _scaled_mm's fused bias has dtype rules per mode


def gemm_kind(device: torch.device, dtype: torch.dtype, in_features: int, out_features: int) -> str:
    """The one place that picks how an FP8 layer multiplies: W8A8 torch._scaled_mm on CUDA devices that
    have FP8 tensor cores (compute capability >= 8.9) for sizes it takes, else the weight-only twin."""
    if device.type != "cuda" or in_features % SCALED_MM_ALIGNMENT or out_features % SCALED_MM_ALIGNMENT:
        return "twin"
    return _cuda_gemm_kind(device.index if device.index is not None else torch.cuda.current_device(), dtype)


@functools.cache
def _cuda_gemm_kind(index: int, dtype: torch.dtype) -> str:
    """Row-wise scaling where this torch and GPU run it (probed once with a tiny product), else
    tensor-wise, else the twin."""
    if torch.cuda.get_device_capability(index) < (8, 9):
        return "twin"
    device = torch.device("cuda", index)
    x = torch.randn(3, 32, device=device).to(dtype)
    q, scale = quantize_per_channel(torch.randn(16, 32, device=device))
    want = fp8_linear_reference(x, q, scale, None)
    for kind in ("rowwise", "tensorwise") if dtype == torch.bfloat16 else ("tensorwise",):
        try:
            got = fp8_gemm(x, q, scale, None, kind).float()
        except (RuntimeError, NotImplementedError) as exc:  # this torch build or GPU lacks the mode
            logger.info("torch._scaled_mm %s on %s (%s): not available (%s)", kind, device, dtype, str(exc).splitlines()[0])
            continue
        if torch.allclose(got, want, rtol=0.1, atol=0.1 * float(want.abs().max())):
            return kind
        logger.warning("torch._scaled_mm %s on %s gave wrong results in a probe; not used", kind, device)
    return "twin"


class Fp8Linear(nn.Module):
    """nn.Linear with an FP8 weight: `weight` [N, K] float8_e4m3fn, `weight_scale` [N] float32 (one per
    output channel), `bias` [N] in the activation dtype or None. Parameter names are the FP8
    checkpoints' (llm-compressor / vLLM "fp8"), so they load by name. `gemm` is set at load (gemm_kind)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str | None = None, gemm: str = "twin"):
        super().__init__()
        self.in_features, self.out_features, self.gemm = in_features, out_features, gemm
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, dtype=torch.float32, device=device), requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, gemm: str = "twin") -> "Fp8Linear":
        """linear's weight quantized per channel (its bias kept)."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, linear.weight.dtype,
                    linear.weight.device, gemm)
        with torch.no_grad():
            q, scale = quantize_per_channel(linear.weight)
            layer.weight.copy_(q)
            layer.weight_scale.copy_(scale)
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = fp8_gemm(x.reshape(-1, self.in_features), self.weight, self.weight_scale, self.bias, self.gemm)
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, gemm={self.gemm}"
