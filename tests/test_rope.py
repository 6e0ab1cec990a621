"""RoPE frequencies equal transformers' for every supported rope type, at real-model head sizes."""

from __future__ import annotations

import pytest
import torch

from splitspec.runtime.config import ModelConfig
from splitspec.runtime.rope import inv_freq_and_scale

BASE = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
            num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8, vocab_size=100,
            max_position_embeddings=131072)

CASES = {
    "default": dict(rope_theta=10000.0),
    "llama3.1": dict(rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                            high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "linear": dict(rope_theta=10000.0, rope_scaling=dict(type="linear", factor=4.0)),
    "yarn-qwen": dict(rope_theta=1000000.0, max_position_embeddings=131072,
                      rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=32768)),
    "yarn-mscale": dict(rope_theta=10000.0, rope_scaling=dict(rope_type="yarn", factor=8.0, mscale=0.707,
                                                              mscale_all_dim=1.0, original_max_position_embeddings=4096,
                                                              beta_fast=32, beta_slow=1)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_inv_freq_matches_transformers(case):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    raw = {**BASE, **CASES[case]}
    ours = ModelConfig.from_dict(raw)
    inv_freq, scale = inv_freq_and_scale(ours.rope, ours.head_dim, ours.max_position_embeddings)
    hf_config = LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"})
    rope_type = hf_config.rope_parameters["rope_type"]
    if rope_type == "default":
        expected = 1.0 / (hf_config.rope_parameters["rope_theta"] ** (torch.arange(0, 128, 2).float() / 128))
        expected_scale = 1.0
    else:
        expected, expected_scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    assert torch.allclose(inv_freq, expected.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(expected_scale)


@pytest.mark.parametrize(
    "rope_scaling, message",
    [
        (dict(rope_type="llama3", factor=8.0), "needs low_freq_factor, high_freq_factor, original_max_position_embeddings"),
        (dict(type="linear"), "needs factor"),
        (dict(rope_type="yarn", original_max_position_embeddings=4096), "needs factor"),  # as transformers
    ],
)
def test_incomplete_rope_blocks_fail_at_start(rope_scaling, message):
    from splitspec.runtime.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict({**BASE, "rope_scaling": rope_scaling})


def test_empty_rope_parameters_mean_default():
    assert ModelConfig.from_dict({**BASE, "rope_parameters": {}}).rope.rope_type == "default"


def test_rope_cache_grows_once_and_is_reused():
    """reserve() must not rebuild (or double) the cache when called again for covered positions,
    including when the device is named differently from how torch reports it."""
    from splitspec.runtime.rope import RotaryEmbedding

    rope = RotaryEmbedding(ModelConfig.from_dict(BASE).rope, head_dim=128, max_position_embeddings=4096)
    rope.reserve(100, torch.device("cpu"))
    first = rope._cos
    for _ in range(5):
        rope.reserve(100, "cpu")
        rope.reserve(50, torch.device("cpu"))
    assert rope._cos is first and rope.num_cached_positions == 100
    rope.reserve(150, "cpu")
    assert rope.num_cached_positions == 200  # grown once, amortised
    rope.reserve(150, "cpu")
    assert rope.num_cached_positions == 200
