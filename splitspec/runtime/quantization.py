"""Which weights load quantized, decided at load from the flag and the checkpoint (SGLang's
`--quantization` for the target, `--speculative-draft-model-quantization` for a draft; vLLM's reading of
config.json's quantization_config). FP8 is the one method implemented (runtime.fp8).

    flag            checkpoint                          the model's Linear layers
    none            bf16 / fp16 / fp32                  unquantized, in --dtype
    none or fp8     FP8 (quantization_config, F8_E4M3)  FP8 as stored: the layers whose weights are F8_E4M3
                                                        (a checkpoint's ignored layers stay in --dtype); auto-detected
    fp8             bf16 / fp16 / fp32                  FP8, quantized at load (per output channel): every Linear
                                                        but lm_head; embeddings and norms stay in --dtype (as vLLM)
    unquant         bf16 / fp16 / fp32                  unquantized (SGLang: a draft kept unquantized beside an FP8 target)
    unquant         FP8                                 refused: an FP8 checkpoint has no unquantized weights to load
    awq, gptq, ...  any                                 refused at start: only fp8 is implemented
    any             AWQ, GPTQ, block-wise FP8, ...      refused, naming what config.json says and what loads

FP8 checkpoints are the llm-compressor / vLLM layout: `<layer>.weight` F8_E4M3 [N, K], `<layer>.weight_scale`
float, per tensor ([] or [1]) or per channel ([N] or [N, 1]); `input_scale` (static activation scales) and
`k_scale` / `v_scale` (an FP8 KV cache) are read past: activations are quantized dynamically per token, and
the KV cache stays in --dtype. config.json's quantization_config says quant_method "fp8" (without
weight_block_size) or "compressed-tensors" with 8-bit float weights of strategy tensor or channel.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitspec.runtime.config import ConfigError, ModelConfig

if TYPE_CHECKING:  # imported as a model loads: the flags check a method's name without torch (check_method)
    import torch
    from torch import nn

logger = logging.getLogger(__name__)

# SGLang's --quantization choices (python/sglang/srt/server_args.py QUANTIZATION_CHOICES): accepted as names,
# refused at start unless implemented here
SGLANG_METHODS = ("awq", "fp8", "mxfp8", "gptq", "marlin", "gptq_marlin", "awq_marlin", "bitsandbytes", "gguf",
                  "modelopt", "modelopt_fp8", "modelopt_fp4", "petit_nvfp4", "w8a8_int8", "w8a8_fp8", "moe_wna16",
                  "qoq", "w4afp8", "mxfp4", "auto-round", "compressed-tensors", "quark", "unquant")
METHODS = ("fp8", "unquant")  # implemented: FP8 weights, and unquantized on purpose
FP8_CODE = "F8_E4M3"  # the safetensors dtype of float8_e4m3fn
OTHER_FP8_CODES = ("F8_E5M2", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ")
UNQUANTIZED_LINEARS = ("lm_head",)  # module names (last component) that never quantize
# checkpoint tensors an FP8 checkpoint carries that this runtime reads past (see the module docstring)
UNUSED_SCALE_SUFFIXES = (".input_scale", ".k_scale", ".v_scale", ".kv_scale")


@dataclass(frozen=True)
class QuantPlan:
    """What load_model does: mode "none", "online" (quantize these layers at load) or "checkpoint"
    (these layers' FP8 weights and scales are in the checkpoint); modules: the Linear layers that become
    Fp8Linear."""

    mode: str = "none"
    modules: tuple[str, ...] = ()

    @property
    def quantized(self) -> bool:
        return bool(self.modules)


def check_method(name: str | None, flag: str = "--quantization") -> None:
    """Refuse a method this runtime does not implement, naming what does."""
    if name is None or name in METHODS:
        return
    known = "SGLang's" if name in SGLANG_METHODS else "not a method SGLang knows either;"
    raise ConfigError(f"{flag} {name}: {known} {name} weights are not implemented here; fp8 is (FP8 weights quantized "
                      "at load, or an FP8 checkpoint), and unquant loads unquantized")


def checkpoint_method(config: ModelConfig) -> str | None:
    """"fp8" when config.json's quantization_config describes FP8 weights this runtime loads, None when
    it has none; a ConfigError naming the field for anything else."""
    qc = config.raw.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    where = "config.json quantization_config"
    if method == "fp8":
        if qc.get("weight_block_size"):
            raise ConfigError(f"{where}: block-wise FP8 (weight_block_size {qc['weight_block_size']}, weight_scale_inv, "
                              "DeepSeek style) is not supported; FP8 checkpoints with per-tensor or per-channel "
                              "weight_scale load")
        return "fp8"
    if method == "compressed-tensors":
        _check_compressed_tensors(qc, where)
        return "fp8"
    raise ConfigError(f"{where}: quant_method {method or '(none)'!r} is not supported; FP8 checkpoints load (quant_method "
                      "fp8, or compressed-tensors with 8-bit float weights per tensor or per channel), or an "
                      "unquantized checkpoint with --quantization fp8")


def _check_compressed_tensors(qc: dict, where: str) -> None:
    """llm-compressor's FP8 layouts (format float-quantized / naive-quantized): 8-bit float weights with
    a scale per tensor or per channel. Anything else (int4/int8 packs, groups, blocks) is refused."""
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ConfigError(f"{where}: compressed-tensors without config_groups is not supported")
    for name, group in groups.items():
        weights = group.get("weights") or {}
        kind = (weights.get("type"), weights.get("num_bits"), weights.get("strategy"))
        if kind[:2] != ("float", 8) or kind[2] not in ("tensor", "channel"):
            raise ConfigError(f"{where}: compressed-tensors group {name!r} has weights of type {kind[0]}, {kind[1]} bits, "
                              f"strategy {kind[2]}; only 8-bit float weights per tensor or per channel (FP8) load")


def plan(model: nn.Module, spec: dict, tensors: dict, config: ModelConfig, flag: str | None) -> QuantPlan:
    """The QuantPlan for a model built unquantized (on the meta device), its checkpoint_spec, the
    checkpoint's tensor index (None: dummy weights) and the flag (None, fp8 or unquant)."""
    check_method(flag)
    method = checkpoint_method(config)
    if tensors is None:  # dummy weights: quantized from the random ones when the flag or config.json asks
        wanted = flag == "fp8" or (method == "fp8" and flag != "unquant")
        return QuantPlan("online", quantizable_linears(model)) if wanted else QuantPlan()
    dtypes = {key: info.dtype for key, info in tensors.items()}
    other = sorted(k for k, d in dtypes.items() if d in OTHER_FP8_CODES)
    if other:
        raise ConfigError(f"tensor {other[0]!r} has dtype {dtypes[other[0]]}: FP8 checkpoints load with {FP8_CODE} "
                          "(float8_e4m3fn) weights only")
    if any(k.endswith(".weight_scale_inv") for k in dtypes):
        raise ConfigError("the checkpoint has block-wise FP8 scales (weight_scale_inv, DeepSeek style), which are not "
                          "supported; FP8 checkpoints with per-tensor or per-channel weight_scale load")
    prequantized = method == "fp8" or FP8_CODE in dtypes.values()
    if prequantized:
        if flag == "unquant":
            raise ConfigError(f"{config.architecture}: the checkpoint's weights are FP8 ({FP8_CODE} with weight_scale); "
                              "unquant cannot load them unquantized (drop it to load them as FP8)")
        modules = _stored_fp8_linears(model, spec, dtypes)
        if not modules:
            raise ConfigError("config.json's quantization_config says FP8 but the checkpoint has no "
                              f"{FP8_CODE} weight of a linear layer")
        return QuantPlan("checkpoint", modules)
    if flag == "fp8":
        return QuantPlan("online", quantizable_linears(model))
    return QuantPlan()


def quantizable_linears(model: nn.Module) -> tuple[str, ...]:
    """Every nn.Linear but the lm_head (embeddings are nn.Embedding or shared tensors: never quantized)."""
    from torch import nn

    skip = getattr(model, "unquantized_linears", UNQUANTIZED_LINEARS)
    return tuple(name for name, module in model.named_modules()
                 if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] not in skip)


def _stored_fp8_linears(model: nn.Module, spec: dict, dtypes: dict[str, str]) -> tuple[str, ...]:
    """The Linear layers whose checkpoint weights are all F8_E4M3 (a fused layer's blocks must agree)."""
    from torch import nn

    linears = {f"{name}.weight": name for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    sources: dict[str, list[str]] = {}
    for key, target in spec.items():
        if target.param in linears and key in dtypes:
            sources.setdefault(linears[target.param], []).append(key)
    out = []
    for name, keys in sources.items():
        fp8 = [k for k in keys if dtypes[k] == FP8_CODE]
        if fp8 and len(fp8) != len(keys):
            floats = sorted(set(keys) - set(fp8))
            raise ConfigError(f"{fp8[0]!r} is {FP8_CODE} but {floats[0]!r} is {dtypes[floats[0]]}; they load into one "
                              f"fused layer ({name}), which must be all FP8 or all unquantized")
        if fp8:
            out.append(name)
    return tuple(sorted(out))


def swap_in_fp8(model: nn.Module, modules: tuple[str, ...], device: torch.device, dtype: torch.dtype,
                quantize: bool = False) -> None:
    """Replace these nn.Linear modules by Fp8Linear: empty ones on the meta device (to be loaded), or, with
    quantize, the loaded weights quantized per channel (dummy weights)."""
    from splitspec.runtime.fp8 import Fp8Linear, gemm_kind

    for name in modules:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, leaf)
        gemm = gemm_kind(device, dtype, linear.in_features, linear.out_features)
        if quantize:
            layer = Fp8Linear.from_linear(linear, gemm)
        else:
            layer = Fp8Linear(linear.in_features, linear.out_features, linear.bias is not None, dtype, "meta", gemm)
        setattr(parent, leaf, layer)


def unused_checkpoint_keys(tensors: dict) -> tuple[str, ...]:
    """An FP8 checkpoint's static activation and KV-cache scales, read past (logged once)."""
    unused = tuple(k for k in tensors if k.endswith(UNUSED_SCALE_SUFFIXES))
    if any(k.endswith(".input_scale") for k in unused):
        logger.info("FP8 checkpoint: its static input_scale tensors are not used; activations are quantized "
                    "dynamically per token (or run in --dtype on the weight-only path)")
    if any(not k.endswith(".input_scale") for k in unused):
        logger.warning("FP8 checkpoint: its k_scale / v_scale (an FP8 KV cache) are not used; the KV cache stays in --dtype")
    return unused


def describe(model: nn.Module, qplan: QuantPlan, dtype: torch.dtype) -> str:
    """One log line: what was quantized, how it multiplies, and the weight bytes."""
    from splitspec.runtime.fp8 import Fp8Linear

    if not qplan.quantized:
        return ""
    gemms = sorted({m.gemm for m in model.modules() if isinstance(m, Fp8Linear)})
    how = {"rowwise": "W8A8 torch._scaled_mm, per-token activation scales",
           "tensorwise": "W8A8 torch._scaled_mm, per-tensor activation scales",
           "twin": f"weight-only, dequantized to {str(dtype).replace('torch.', '')}"}
    source = "quantized at load (per output channel)" if qplan.mode == "online" else "from the FP8 checkpoint"
    return (f"FP8 weights {source}: {len(qplan.modules)} linear layers ({'; '.join(how[g] for g in gemms)}); "
            f"embeddings, norms and lm_head in {str(dtype).replace('torch.', '')}")


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's buffers that a checkpoint holds (not the non-persistent ones, such as RoPE caches), by name."""
    out = {}
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                out[f"{module_name}.{name}" if module_name else name] = buffer
    return out


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of the model's own weights (parameters and persistent buffers; shared tensors not counted):
    total, and how much of it is FP8 layers (their weights and scales)."""
    from splitspec.runtime.fp8 import Fp8Linear

    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total += sum(b.numel() * b.element_size() for b in persistent_buffers(model).values())
    fp8 = sum(p.numel() * p.element_size() for m in model.modules() if isinstance(m, Fp8Linear)
              for p in (m.weight, m.weight_scale))
    return {"total": total, "fp8_layers": fp8}
