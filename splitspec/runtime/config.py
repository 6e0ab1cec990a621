"""ModelConfig: the frozen view of an HF `config.json` that the runtime needs; `eos_token_ids`: a model
directory's stop tokens, read as transformers reads them.

Both config dialects are read:
- transformers >= 5 writes `rope_parameters` = {"rope_type", "rope_theta", ...};
- published checkpoints carry `rope_scaling` (or nothing) plus a top-level `rope_theta`.
Both become one `RopeConfig`. Anything the runtime cannot honour is an error at start that names the
field, never a silent approximation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """config.json asks for something this runtime does not support, or is malformed."""


# architectures[0] -> family (the model registry's key)
ARCHITECTURE_FAMILIES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "MiMoForCausalLM": "llama",  # Qwen2 layers; its MTP layers are the drafter's (runtime.models.mtp)
    # draft heads renamed as SGLang's copies are (most published heads say LlamaForCausalLM; the
    # --speculative-algorithm then decides the family)
    "LlamaForCausalLMEagle": "eagle",
    "LlamaForCausalLMEagle3": "eagle3",
}

# --load-format values (runtime/loader.py): pt is pytorch_model.bin files only
LOAD_FORMATS = ("auto", "safetensors", "pt", "dummy", "dummy-decisive")
# --dtype names -> torch's dtype names (names, so that reading a config needs no torch: a drafter process of no model)
DTYPES = {
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}

# rope type -> keys its parameters must carry
ROPE_REQUIRED_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor",),
}
SUPPORTED_ROPE_TYPES = tuple(ROPE_REQUIRED_KEYS)


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters, dialect-independent. `params` holds the type's own keys."""

    rope_type: str = "default"
    theta: float = 10000.0
    params: tuple[tuple[str, Any], ...] = ()
    partial_rotary_factor: float = 1.0

    def get(self, key: str, default: Any = None) -> Any:
        return dict(self.params).get(key, default)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    family: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # bias on q/k/v projections
    o_bias: bool = False  # bias on o_proj
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    hidden_act: str = "silu"
    # per layer: attention window in tokens (a key is visible when q_pos - k_pos < window), None = full
    sliding_windows: tuple[int | None, ...] = ()
    torch_dtype: str | None = None  # the checkpoint's declared dtype
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    num_nextn_predict_layers: int = 0  # MTP layers the checkpoint carries beside the model (MiMo)
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def eagle3_capture_layers(self) -> tuple[int, ...]:
        """EAGLE-3's default captured layers: the inputs of layers 2, L//2, L-3 (REFERENCES §2.3).
        Below 7 layers these collide or go out of order, so the ids must then be given explicitly."""
        num_layers = self.num_hidden_layers
        layers = (2, num_layers // 2, num_layers - 3)
        if not layers[0] < layers[1] < layers[2]:
            raise ConfigError(
                f"EAGLE-3's default capture layers (2, L//2, L-3) = {layers} are not distinct for a {num_layers}-layer "
                "target; set eagle_config.eagle_aux_hidden_state_layer_ids in the draft config"
            )
        return layers

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path}: not found (a model directory needs config.json)")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc})") from exc
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        architecture = _architecture(raw, source)
        num_heads = _required(raw, "num_attention_heads", source)
        hidden_size = _required(raw, "hidden_size", source)
        head_dim = raw.get("head_dim") or hidden_size // num_heads
        model_type = raw.get("model_type", "")
        act = raw.get("hidden_act", raw.get("hidden_activation", "silu"))
        if act not in ("silu", "swish"):
            raise ConfigError(f"{source}: hidden_act={act!r} is not supported (silu only)")
        num_layers = _required(raw, "num_hidden_layers", source)
        attention_bias = bool(raw.get("attention_bias", False))
        is_qwen2 = model_type in ("qwen2", "mimo") or architecture in ("Qwen2ForCausalLM", "MiMoForCausalLM")
        return cls(
            architecture=architecture,
            family=ARCHITECTURE_FAMILIES[architecture],
            model_type=model_type,
            vocab_size=_required(raw, "vocab_size", source),
            hidden_size=hidden_size,
            intermediate_size=_required(raw, "intermediate_size", source),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rope=parse_rope(raw, source),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias and no o bias; Llama/Qwen3/Mistral: attention_bias on all four
            qkv_bias=True if is_qwen2 else attention_bias,
            o_bias=False if is_qwen2 else attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=architecture == "Qwen3ForCausalLM",
            hidden_act="silu",
            sliding_windows=_sliding_windows(raw, architecture, num_layers, source),
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_as_tuple(raw.get("eos_token_id")),
            num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0),
            raw=raw,
        )


def _architecture(raw: dict, source: str) -> str:
    architectures = raw.get("architectures") or []
    if not architectures:
        raise ConfigError(f"{source}: field 'architectures' is missing")
    architecture = architectures[0]
    if architecture not in ARCHITECTURE_FAMILIES:
        supported = ", ".join(sorted(ARCHITECTURE_FAMILIES))
        raise ConfigError(f"{source}: architecture {architecture!r} is not supported (supported: {supported})")
    return architecture


def _required(raw: dict, key: str, source: str) -> int:
    if key not in raw or raw[key] is None:
        raise ConfigError(f"{source}: required field {key!r} is missing")
    return int(raw[key])


def _as_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def parse_rope(raw: dict, source: str = "config.json") -> RopeConfig:
    """Both dialects -> RopeConfig. v5: `rope_parameters` (theta inside); v4: `rope_scaling` + `rope_theta`."""
    params = raw.get("rope_parameters")
    field_name = "rope_parameters" if params is not None else "rope_scaling"
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ConfigError(f"{source}: per-layer-type 'rope_parameters' are not supported")
    if params is None:
        params = dict(raw.get("rope_scaling") or {})
        theta = raw.get("rope_theta", params.get("rope_theta", 10000.0))
    else:
        params = dict(params)
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    params.pop("rope_theta", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"{source}: {field_name}.rope_type={rope_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    partial = float(params.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    missing = [key for key in ROPE_REQUIRED_KEYS[rope_type] if params.get(key) is None]
    if missing:
        raise ConfigError(f"{source}: {field_name} of type {rope_type!r} needs {', '.join(missing)}")
    return RopeConfig(
        rope_type=rope_type,
        theta=float(theta),
        params=tuple(sorted(params.items())),
        partial_rotary_factor=partial,
    )


def _sliding_windows(raw: dict, architecture: str, num_layers: int, source: str) -> tuple[int | None, ...]:
    """Per-layer attention window, as transformers decides it for each family."""
    window = raw.get("sliding_window")
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        if len(layer_types) != num_layers:
            raise ConfigError(f"{source}: layer_types has {len(layer_types)} entries for {num_layers} layers")
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        if not raw.get("use_sliding_window", False) or window is None:
            return (None,) * num_layers
        first = int(raw.get("max_window_layers", num_layers))
        return tuple(window if i >= first else None for i in range(num_layers))
    if architecture == "MistralForCausalLM" and window is not None:
        return (int(window),) * num_layers
    return (None,) * num_layers


def eos_token_ids(model_dir: Path, config_eos: tuple[int, ...], tokenizer) -> set[int]:
    """EOS ids from generation_config.json, config.json and the tokenizer (as transformers does)."""
    ids = set(config_eos)
    gen_config = model_dir / "generation_config.json"
    if gen_config.is_file():
        eos = json.loads(gen_config.read_text()).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
