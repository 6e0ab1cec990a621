"""Shared fixtures: tiny random HF checkpoints of every supported family, made with transformers.

Every parameter is randomised (norm weights around 1, biases non-zero), so a loader that drops a bias
or a norm cannot pass an equivalence test by accident.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

# The runtime tests run on CPU in CI; SPLITSPEC_TEST_DEVICE=cuda runs the same suite on a GPU
# (references stay on CPU in fp32; our outputs are compared on the test device).
DEVICE = os.environ.get("SPLITSPEC_TEST_DEVICE", "cpu")

# name -> (transformers config class name, config kwargs); each exercises one feature of the family
TINY_FAMILIES: dict[str, tuple[str, dict]] = {
    "llama-gqa-llama3": (
        "LlamaConfig",
        dict(
            num_key_value_heads=2,
            rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_position_embeddings=32),
            rope_theta=500000.0,
        ),
    ),
    "llama-tied": ("LlamaConfig", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "llama-linear-rope-bias": (
        "LlamaConfig",
        dict(num_key_value_heads=1, attention_bias=True, mlp_bias=True,
             rope_scaling=dict(rope_type="linear", factor=2.0)),
    ),
    "qwen2-qkv-bias": ("Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen2-sliding": (
        "Qwen2Config",
        dict(num_key_value_heads=2, use_sliding_window=True, sliding_window=5, max_window_layers=1),
    ),
    "qwen3-qk-norm": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=24)),
    "mistral-sliding": ("MistralConfig", dict(num_key_value_heads=2, sliding_window=6)),
    "llama-yarn": (
        "LlamaConfig",
        dict(num_key_value_heads=2, rope_scaling=dict(rope_type="yarn", factor=4.0,
                                                      original_max_position_embeddings=64)),
    ),
}

BASE_CONFIG = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    vocab_size=211, max_position_embeddings=256, rms_norm_eps=1e-6,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)

# Llama-3.1-8B's config.json in the published (transformers 4) dialect, shrunk; rope block exact.
LLAMA31_V4_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000 % 300,
    "eos_token_id": 128001 % 300,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 112,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0",
    "use_cache": True,
    "vocab_size": 300,
}


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator)
        if name.endswith("norm.weight"):
            param.copy_(1.0 + 0.1 * noise)
        else:
            param.copy_(0.08 * noise)


def make_hf_model(family: str, seed: int = 0, **overrides):
    import transformers

    config_cls, kwargs = TINY_FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**BASE_CONFIG, **kwargs, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model, seed)
    return model.eval()


def save_checkpoint(model, path: Path, **save_kwargs) -> Path:
    model.save_pretrained(path, **save_kwargs)
    return path


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """family -> directory of a saved tiny checkpoint (fp32 safetensors)."""
    root = tmp_path_factory.mktemp("tiny")
    return {family: save_checkpoint(make_hf_model(family, seed=i), root / family) for i, family in enumerate(TINY_FAMILIES)}


@pytest.fixture(scope="session")
def llama31_v4_dir(tmp_path_factory) -> Path:
    """A checkpoint whose config.json is hand-written in the published v4 dialect (rope_scaling +
    rope_theta), with the weights of a model built from that same config."""
    import transformers

    path = tmp_path_factory.mktemp("llama31v4")
    (path / "config.json").write_text(json.dumps(LLAMA31_V4_CONFIG))
    config = transformers.AutoConfig.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model, seed=31)
    model.save_pretrained(path)
    (path / "config.json").write_text(json.dumps(LLAMA31_V4_CONFIG, indent=2))  # undo the v5 rewrite
    return path


def load_runner(model_dir, max_total_tokens: int = 4096, page_size: int = 4, dtype: str = "float32", **kwargs):
    from splitspec.runtime.runner import ModelRunner, RuntimeConfig

    return ModelRunner.load(RuntimeConfig(model_path=str(model_dir), dtype=dtype, device=DEVICE,
                                          max_total_tokens=max_total_tokens, page_size=page_size, **kwargs))


def hf_logits(model, ids: list[int], position_ids: list[int] | None = None) -> torch.Tensor:
    with torch.no_grad():
        kwargs = {} if position_ids is None else {"position_ids": torch.tensor([position_ids])}
        return model(torch.tensor([ids]), **kwargs).logits[0].float().to(DEVICE)
