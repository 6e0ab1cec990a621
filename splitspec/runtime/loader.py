"""Weight loading: HF safetensors (single file or sharded with an index), PyTorch `pytorch_model.bin`
files (read with torch.load(weights_only=True, mmap=True): no code runs, headers before data; EAGLE
heads are published this way), or random `dummy` weights.

Loading is all-or-nothing. The model is first built on the meta device; the checkpoint's tensor
names, shapes and dtypes are read from the safetensors headers and checked against what the model
expects; only then is memory allocated and data read. A missing, unexpected or misshaped tensor is a
`CheckpointError` that names it (and its file), raised before any weight is materialised.

FP8 (runtime.quantization decides which Linear layers, runtime.fp8 computes): the chosen layers become
Fp8Linear before the checks, so the checkpoint is checked against FP8 weights and their scales; a float
weight loading into an FP8 layer is quantized per output channel as it is copied in (one tensor at a
time on the device, never the whole model in full precision).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from splitspec.runtime import quantization
from splitspec.runtime.config import LOAD_FORMATS, ModelConfig
from splitspec.runtime.fp8 import FP8_DTYPE, quantize_per_channel
from splitspec.runtime.models import model_class

logger = logging.getLogger(__name__)

DECISIVE = ("dummy weights made decisive (--load-format dummy-decisive): embedding x50, lm_head = the embedding, "
            "sublayer input norms x0.1 (the same shapes and kernels, so the same cost)")
FLOAT_DTYPES = {"F32", "F16", "BF16", "F64"}
INT_DTYPES = {"I64", "I32", "I16", "I8", "U8"}
TORCH_DTYPE_CODES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
                     torch.int64: "I64", torch.int32: "I32", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
# checkpoint tensors that carry nothing a model needs (old Llama exports saved RoPE buffers)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
MAX_LISTED = 8


class CheckpointError(ValueError):
    """The checkpoint does not match the model its config describes."""


@dataclass(frozen=True)
class TensorTarget:
    """Where a checkpoint tensor goes: rows [row_start, row_start + shape[0]) of a model parameter (or
    persistent buffer: EAGLE-3's integer d2t)."""

    param: str
    row_start: int
    shape: tuple[int, ...]
    floating: bool = True  # a float tensor (cast to the model dtype); else an integer one, kept as is
    fp8: bool = False  # an FP8 layer's weight: F8_E4M3 as stored, or a float tensor quantized as it loads
    scale: bool = False  # an FP8 layer's weight_scale rows: the checkpoint's may be one per tensor ([] or [1])


@dataclass(frozen=True)
class TensorInfo:
    file: str
    shape: tuple[int, ...]
    dtype: str
    key: str | None = None  # the name in the file, when the model knows the tensor by another


def checkpoint_spec(model: nn.Module) -> dict[str, TensorTarget]:
    """The checkpoint tensors a model expects, derived from its parameters, persistent buffers and
    fused modules."""
    params = dict(model.named_parameters())
    spec: dict[str, TensorTarget] = {}
    fused: set[str] = set()
    for module_name, module in model.named_modules():
        for fused_name, sources in getattr(module, "packed", {}).items():
            prefix = f"{module_name}." if module_name else ""
            sizes = _block_rows(module, fused_name, sources)
            for leaf in ("weight", "bias", "weight_scale"):
                param_name = f"{prefix}{fused_name}.{leaf}"
                if param_name not in params:
                    continue
                fused.add(param_name)
                row = 0
                for source, rows in zip(sources, sizes):
                    shape = (rows, *params[param_name].shape[1:])
                    spec[f"{prefix}{source}.{leaf}"] = _target(param_name, row, shape, params[param_name])
                    row += rows
    for name, param in params.items():
        if name not in fused:
            spec[name] = _target(name, 0, tuple(param.shape), param)
    for name, buffer in quantization.persistent_buffers(model).items():
        spec[name] = TensorTarget(name, 0, tuple(buffer.shape), buffer.is_floating_point())
    return spec


def _target(param_name: str, row: int, shape: tuple[int, ...], param: torch.Tensor) -> TensorTarget:
    return TensorTarget(param_name, row, shape, fp8=param.dtype == FP8_DTYPE, scale=param_name.endswith(".weight_scale"))


def rename_for_model(model: nn.Module, tensors: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
    """The checkpoint's tensors under the model's names: a model with `checkpoint_name(key)` renames them
    (None drops a tensor it does not own, e.g. the target's layers around its MTP layers)."""
    rename = getattr(model, "checkpoint_name", None)
    if rename is None:
        return tensors
    out: dict[str, TensorInfo] = {}
    for key, info in tensors.items():
        name = rename(key)
        if name is None:
            continue
        if name in out:
            raise CheckpointError(f"tensors {out[name].key!r} and {key!r} both load into {name!r}")
        out[name] = TensorInfo(info.file, info.shape, info.dtype, key)
    return out



def _block_rows(module: nn.Module, fused_name: str, sources: tuple[str, ...]) -> tuple[int, ...]:
    split_sizes = getattr(module, "split_sizes", None)
    if split_sizes is not None and len(split_sizes) == len(sources):
        return tuple(split_sizes)
    total = getattr(module, fused_name).weight.shape[0]
    assert total % len(sources) == 0, f"{fused_name}: cannot split {total} rows evenly"
    return (total // len(sources),) * len(sources)


def read_checkpoint_index(model_dir: Path, load_format: str = "auto") -> dict[str, TensorInfo]:
    """Tensor name -> (file, shape, dtype), from the safetensors headers only (no tensor data). auto:
    safetensors when there are any, else pytorch_model.bin; safetensors / pt: only that format."""
    index_path = model_dir / "model.safetensors.index.json"
    bin_index = model_dir / "pytorch_model.bin.index.json"
    has_bin = bin_index.is_file() or (model_dir / "pytorch_model.bin").is_file()
    if load_format == "pt":
        if not has_bin:
            raise CheckpointError(f"{model_dir}: --load-format pt needs pytorch_model.bin (or its index), none found")
        return _read_bin_index(model_dir, bin_index)
    if load_format == "auto" and not index_path.is_file() and not any(model_dir.glob("*.safetensors")) and has_bin:
        return _read_bin_index(model_dir, bin_index)
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text()).get("weight_map", {})
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (model_dir / f).is_file()]
        if missing:
            raise CheckpointError(f"{index_path}: shard files listed but not found: {', '.join(missing)}")
    else:  # Mistral's consolidated*.safetensors repeat the weights in another layout
        files = sorted(p.name for p in model_dir.glob("*.safetensors") if not p.name.startswith("consolidated"))
    if not files:
        found = sorted(p.name for p in model_dir.iterdir())
        raise CheckpointError(
            f"{model_dir}: no *.safetensors weights found (found: {', '.join(found) or 'nothing'}); "
            "use --load-format dummy for random weights"
        )
    tensors: dict[str, TensorInfo] = {}
    for file in files:
        with safe_open(str(model_dir / file), framework="pt") as handle:
            for key in handle.keys():
                if key in tensors:
                    raise CheckpointError(f"tensor {key!r} appears in both {tensors[key].file} and {file}")
                view = handle.get_slice(key)
                tensors[key] = TensorInfo(file, tuple(view.get_shape()), view.get_dtype())
    return tensors


def _read_bin_index(model_dir: Path, index_path: Path) -> dict[str, TensorInfo]:
    if index_path.is_file():
        files = sorted(set(json.loads(index_path.read_text()).get("weight_map", {}).values()))
        missing = [f for f in files if not (model_dir / f).is_file()]
        if missing:
            raise CheckpointError(f"{index_path}: shard files listed but not found: {', '.join(missing)}")
    else:
        files = ["pytorch_model.bin"]
    tensors: dict[str, TensorInfo] = {}
    for file in files:
        for key, tensor in _torch_load(model_dir / file).items():
            if key in tensors:
                raise CheckpointError(f"tensor {key!r} appears in both {tensors[key].file} and {file}")
            tensors[key] = TensorInfo(file, tuple(tensor.shape), TORCH_DTYPE_CODES.get(tensor.dtype, str(tensor.dtype)))
    return tensors


def _torch_load(path: Path) -> dict[str, torch.Tensor]:
    """A state dict from a PyTorch file, memory-mapped (tensor data is read when touched)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 (torch raises UnpicklingError, RuntimeError, ...)
        raise CheckpointError(f"{path}: not a loadable PyTorch state dict ({exc})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path}: expected a dict of tensors")
    return state


def validate_checkpoint(spec: dict[str, TensorTarget], tensors: dict[str, TensorInfo], config: ModelConfig,
                        ignored: tuple[str, ...] = ()) -> None:
    """Raise CheckpointError naming every missing, unexpected, misshaped or non-float tensor."""
    ignorable = {k for k in tensors if k.endswith(IGNORED_SUFFIXES) or k in ignored}
    if config.tie_word_embeddings:
        ignorable.add("lm_head.weight")  # some tied checkpoints also store the (identical) head
    problems: list[str] = []
    missing = sorted(set(spec) - set(tensors))
    unexpected = sorted(set(tensors) - set(spec) - ignorable)
    if missing:
        problems.append(f"missing tensors: {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_listing([f'{k} (in {tensors[k].file})' for k in unexpected])}")
    for key in sorted(set(spec) & set(tensors)):
        info, target = tensors[key], spec[key]
        shapes = (target.shape,) if not target.scale else ((), (1,), target.shape, (*target.shape, 1))
        if info.shape not in shapes:
            problems.append(f"tensor {key!r} in {info.file} has shape {list(info.shape)}, expected {list(target.shape)}"
                            + (" (or one value for the tensor)" if target.scale else ""))
        if not target.floating:
            if info.dtype not in INT_DTYPES:
                problems.append(f"tensor {key!r} in {info.file} has dtype {info.dtype}, expected an integer tensor")
        elif info.dtype == quantization.FP8_CODE and not target.fp8:
            problems.append(f"tensor {key!r} in {info.file} has dtype {info.dtype}, but only the weights of linear "
                            "layers load FP8 (embeddings, norms, lm_head and biases must be float)")
        elif info.dtype not in FLOAT_DTYPES and info.dtype != quantization.FP8_CODE:
            problems.append(f"tensor {key!r} in {info.file} has dtype {info.dtype} (quantized checkpoints other than "
                            "FP8 are not supported)")
    if problems:
        raise CheckpointError(f"checkpoint does not match {config.architecture}: " + "; ".join(problems))


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:MAX_LISTED])
    return shown + (f" and {len(names) - MAX_LISTED} more" if len(names) > MAX_LISTED else "")


def load_model(
    model_dir: str | Path | None,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    seed: int = 0,
    quantization_flag: str | None = None,
) -> nn.Module:
    """Build the model for `config` and fill it from `model_dir` (or randomly for 'dummy').
    quantization_flag: None, "fp8" or "unquant" (runtime.quantization); the model's `quant_plan` says
    what it did."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"--load-format {load_format!r} is not supported (choose from {', '.join(LOAD_FORMATS)})")
    with torch.device("meta"):
        model = model_class(config)(config).to(dtype)
    spec = checkpoint_spec(model)
    if load_format in ("dummy", "dummy-decisive"):
        qplan = quantization.plan(model, spec, None, config, quantization_flag)
        _materialize(model, device)
        _init_dummy(model, seed)
        if load_format == "dummy-decisive":
            _make_decisive(model)
        quantization.swap_in_fp8(model, qplan.modules, device, dtype, quantize=True)  # the same weights, quantized
        model.quant_plan = qplan
        logger.info("initialised %s with random (dummy) weights, seed %d%s", config.architecture, seed,
                    f"; {DECISIVE}" if load_format == "dummy-decisive" else "")
        return model.eval()
    model_dir = Path(model_dir)
    tensors = rename_for_model(model, read_checkpoint_index(model_dir, load_format))
    qplan = quantization.plan(model, spec, tensors, config, quantization_flag)
    ignored = tuple(getattr(model, "ignored_checkpoint_keys", ()))
    if qplan.quantized:
        quantization.swap_in_fp8(model, qplan.modules, device, dtype)
        spec = checkpoint_spec(model)
        if qplan.mode == "online":  # the scales are computed from the float weights as they load
            spec = {k: v for k, v in spec.items() if not v.scale}
        ignored += quantization.unused_checkpoint_keys(tensors)
    model.quant_plan = qplan
    # tensors a model can take from elsewhere when the checkpoint lacks them (an EAGLE-3 head without a
    # draft vocabulary shares the target's lm_head); the model learns which ones were absent
    optional = set(getattr(model, "optional_checkpoint_keys", ()))
    model.absent_checkpoint_keys = sorted(k for k in optional & set(spec) if k not in tensors)
    spec = {k: v for k, v in spec.items() if k not in model.absent_checkpoint_keys}
    validate_checkpoint(spec, tensors, config, ignored)
    _materialize(model, device)
    _load_tensors(model, spec, tensors, model_dir, device)
    return model.eval()


def _materialize(model: nn.Module, device: torch.device) -> None:
    """`model.to_empty(device)`, tensor by tensor: uninitialised storage of each parameter's and buffer's shape
    and dtype on `device`. (to_empty's empty_like of a meta tensor runs through torch's reference ops, whose
    first use imports torch's meta registrations and symbolic shapes: about a CPU second per process.)"""
    made: dict[int, torch.Tensor] = {}  # a tensor shared by two modules (tied weights) stays shared

    def empty(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            fresh = torch.empty(t.shape, dtype=t.dtype, device=device)
            made[id(t)] = nn.Parameter(fresh, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else fresh
        return made[id(t)]

    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is not None:
                    table[name] = empty(tensor)


@torch.no_grad()
def _load_tensors(model: nn.Module, spec, tensors, model_dir: Path, device: torch.device) -> None:
    params = {**dict(model.named_parameters()), **quantization.persistent_buffers(model)}
    by_file: dict[str, list[str]] = {}
    for key in spec:
        by_file.setdefault(tensors[key].file, []).append(key)
    start, num_bytes = time.perf_counter(), 0
    bar = tqdm(total=len(spec), desc="Loading weights", unit="tensor", disable=None)
    for file, keys in sorted(by_file.items()):
        if file.endswith(".safetensors"):
            handle = safe_open(str(model_dir / file), framework="pt", device=str(device))
            get = handle.get_tensor
        else:
            state = _torch_load(model_dir / file)
            get = state.__getitem__
        for key in keys:
            target = spec[key]
            data = get(tensors[key].key or key)
            num_bytes += data.numel() * data.element_size()
            rows = slice(target.row_start, target.row_start + target.shape[0])
            if target.fp8 and data.dtype != FP8_DTYPE:  # a float weight into an FP8 layer: quantized per row
                q, scale = quantize_per_channel(data.to(device))
                params[target.param][rows].copy_(q)
                params[f"{target.param}_scale"][rows].copy_(scale)
            else:  # casts dtype; a per-tensor scale ([] or [1]) fills its rows, [N, 1] is read as [N]
                dest = params[target.param][rows]
                dest.copy_(data.reshape(dest.shape) if target.scale and data.numel() == dest.numel() else data)
            bar.update()
    bar.close()
    logger.info(
        "loaded %d tensors (%.1f MB) from %d file(s) in %.1fs",
        len(spec), num_bytes / 1e6, len(by_file), time.perf_counter() - start,
    )


@torch.no_grad()
def _init_dummy(model: nn.Module, seed: int) -> None:
    """Random weights from the config alone: N(0, 0.02) matrices, unit norms, zero biases."""
    first = next(model.parameters())
    generator = torch.Generator(device=first.device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.copy_(torch.randn(param.shape, generator=generator, device=param.device, dtype=torch.float32) * 0.02)
    for buffer in quantization.persistent_buffers(model).values():
        buffer.zero_()  # EAGLE-3's d2t: draft id i is target id i


@torch.no_grad()
def _make_decisive(model: nn.Module) -> None:
    """Random weights leave a model's top two logits a few hundredths apart at almost every position, so greedy
    decoding hinges on bf16 rounding, which differs between a decode step and a tree verification: a recorded
    continuation replayed as drafts (--speculative-replay) would stop being the target's own within a few tokens.
    Make the residual stream carry the token's embedding, large, past small sublayer outputs, and read logits with
    the embedding itself: the current token then wins by a wide margin whatever the rounding, and every shape and
    kernel stays as it was."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "embed_tokens") or not hasattr(model, "lm_head_weight"):
        raise ValueError(f"--load-format dummy-decisive: {type(model).__name__} is not a Llama-family decoder")
    embed = inner.embed_tokens.weight
    if tuple(model.lm_head_weight.shape) != tuple(embed.shape):
        raise ValueError("--load-format dummy-decisive needs an lm_head of the embedding's shape")
    embed.mul_(50.0)
    if model.lm_head_weight is not embed:
        model.lm_head_weight.copy_(embed)
    for layer in inner.layers:
        layer.input_layernorm.weight.mul_(0.1)
        layer.post_attention_layernorm.weight.mul_(0.1)


def read_embed_and_head(model_dir: Path, dtype: torch.dtype, device: torch.device,
                        with_head: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A Llama-family target's input embedding and lm_head (the embedding when tied; None without
    with_head), read alone: what a draft head shares when it runs in another process than the target."""
    config = ModelConfig.from_dir(model_dir)
    tensors = read_checkpoint_index(model_dir)
    names = ["model.embed_tokens.weight"]
    if with_head:
        names.append("model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight")
    missing = [n for n in names if n not in tensors]
    if missing:
        raise CheckpointError(f"{model_dir}: the target's {', '.join(sorted(set(missing)))} not found")
    out = []
    for name in names:
        file = tensors[name].file
        if file.endswith(".safetensors"):
            with safe_open(str(model_dir / file), framework="pt", device="cpu") as handle:
                out.append(handle.get_tensor(name).to(device=device, dtype=dtype))
        else:
            out.append(_torch_load(model_dir / file)[name].to(device=device, dtype=dtype))
    return out[0], (out[1] if with_head else None)
