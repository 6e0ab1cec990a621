"""The runtime's forward equals transformers' on tiny random checkpoints of every family (fp32, 1e-4)."""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICE, PUBLISHED_V4_CONFIGS, TINY_FAMILIES, hf_logits, hf_model, load_runner, make_hf_model, random_ids, save_checkpoint

from splitspec.runtime.batch import SequenceInput
from splitspec.runtime.kv_cache import BlockTable

TOL = 1e-4


def our_logits(runner, ids, positions=None) -> torch.Tensor:
    table = BlockTable()
    out = runner.forward(runner.batch([SequenceInput(table, ids, positions=positions, logits="all")]))
    runner.kv_cache.release(table)
    return out.logits


def prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    return random_ids(n, vocab, seed)


@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_logits_match_transformers(tiny_checkpoints, family):
    path = tiny_checkpoints[family]
    reference, runner = hf_model(path), load_runner(path)
    ids = prompt(23, runner.config.vocab_size)  # longer than every sliding window in the fixtures
    expected = hf_logits(reference, ids)
    got = our_logits(runner, ids)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < TOL
    assert runner.kv_cache.allocator.num_used == 0


@pytest.mark.parametrize("name", sorted(PUBLISHED_V4_CONFIGS))
def test_published_v4_configs_match_transformers(published_v4_dirs, name):
    """Published config.json files as they are (rope_scaling null, no rope_theta, fp16/bf16 dtypes,
    sliding_window set but switched off, windows on every layer)."""
    path = published_v4_dirs[name]
    reference, runner = hf_model(path), load_runner(path)
    ids = prompt(19, 300, seed=8)
    assert (our_logits(runner, ids) - hf_logits(reference, ids)).abs().max().item() < TOL


def test_published_config_quirks_are_read():
    from splitspec.runtime.config import ModelConfig

    qwen = ModelConfig.from_dict(PUBLISHED_V4_CONFIGS["qwen2.5"])
    assert qwen.sliding_windows == (None, None) and qwen.qkv_bias and not qwen.o_bias and qwen.rope.theta == 1e6
    llama2 = ModelConfig.from_dict(PUBLISHED_V4_CONFIGS["llama-2"])
    assert llama2.rope.rope_type == "default" and llama2.rope.theta == 10000.0 and llama2.torch_dtype == "float16"
    mistral = ModelConfig.from_dict(PUBLISHED_V4_CONFIGS["mistral-7b-v0.1"])
    assert mistral.sliding_windows == (5, 5)


def test_llama31_v4_dialect_config(llama31_v4_dir):
    """Published dialect (rope_scaling + rope_theta) with Llama-3.1's exact rope block, at positions
    well past original_max_position_embeddings where llama3 scaling changes the rotation."""
    reference, runner = hf_model(llama31_v4_dir), load_runner(llama31_v4_dir)
    assert runner.config.rope.rope_type == "llama3" and runner.config.rope.theta == 500000.0
    ids = prompt(17, 300, seed=3)
    for start in (0, 20000):
        positions = list(range(start, start + len(ids)))
        expected = hf_logits(reference, ids, positions)
        got = our_logits(runner, ids, positions)
        assert (got - expected).abs().max().item() < TOL


def test_rope_scaling_is_exercised(llama31_v4_dir):
    """The v4 test above would not notice a dropped rope_scaling unless it changes the logits."""
    import json

    from splitspec.runtime.config import ModelConfig
    from splitspec.runtime.rope import inv_freq_and_scale

    raw = json.loads((llama31_v4_dir / "config.json").read_text())
    scaled = ModelConfig.from_dict(raw)
    plain = ModelConfig.from_dict({k: v for k, v in raw.items() if k != "rope_scaling"})
    a, _ = inv_freq_and_scale(scaled.rope, scaled.head_dim, scaled.max_position_embeddings)
    b, _ = inv_freq_and_scale(plain.rope, plain.head_dim, plain.max_position_embeddings)
    assert not torch.allclose(a, b)


def test_sharded_checkpoint_with_index(tmp_path):
    model = make_hf_model("qwen3-qk-norm", seed=7)
    path = save_checkpoint(model, tmp_path / "sharded", max_shard_size="60KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 2
    runner = load_runner(path)
    ids = prompt(11, runner.config.vocab_size)
    assert (our_logits(runner, ids) - hf_logits(model, ids)).abs().max().item() < TOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoints(tmp_path, dtype):
    """A bf16/fp16 checkpoint runs in its own dtype on request, in fp32 when asked, and by default in
    fp32 on a CPU and its own dtype on a GPU."""
    model = make_hf_model("llama-gqa-llama3", seed=5).to(dtype)
    path = save_checkpoint(model, tmp_path / str(dtype))
    ids = prompt(9, 211)
    auto = load_runner(path, dtype="auto")
    assert auto.dtype == (dtype if DEVICE.startswith("cuda") else torch.float32)
    native = load_runner(path, dtype=str(dtype).replace("torch.", ""))
    assert native.dtype == dtype and next(native.model.parameters()).dtype == dtype
    as_fp32 = load_runner(path, dtype="float32")
    expected = hf_logits(model.float(), ids)  # the same (rounded) weights in fp32
    assert (our_logits(as_fp32, ids) - expected).abs().max().item() < TOL
    # half precision: close to the fp32 result, with the same top token almost everywhere
    half = our_logits(native, ids)
    assert (half.argmax(-1) == expected.argmax(-1)).float().mean() > 0.8
    assert (half - expected).abs().max().item() < 0.1


def test_dummy_load_format_needs_only_config(tmp_path, tiny_checkpoints):
    only_config = tmp_path / "config-only"
    only_config.mkdir()
    (only_config / "config.json").write_text((tiny_checkpoints["llama-tied"] / "config.json").read_text())
    first = load_runner(only_config, load_format="dummy", seed=1)
    again = load_runner(only_config, load_format="dummy", seed=1)
    other = load_runner(only_config, load_format="dummy", seed=2)
    ids = prompt(6, first.config.vocab_size)
    assert torch.equal(our_logits(first, ids), our_logits(again, ids))
    assert not torch.equal(our_logits(first, ids), our_logits(other, ids))


def test_hidden_states_and_captured_layers(tiny_checkpoints):
    """Final normed hidden state = HF's last hidden_states entry; captured layer i = HF hidden_states[i]."""
    path = tiny_checkpoints["llama-gqa-llama3"]
    reference = hf_model(path)
    runner = load_runner(path, capture_layers=(0, 1, 3))
    ids = prompt(8, runner.config.vocab_size)
    table = BlockTable()
    out = runner.forward(runner.batch([SequenceInput(table, ids)]), return_hidden=True)
    with torch.no_grad():
        hf = reference(torch.tensor([ids]), output_hidden_states=True).hidden_states
    assert (out.hidden_states - hf[-1][0].to(DEVICE)).abs().max().item() < TOL
    hidden = runner.config.hidden_size
    assert out.aux_hidden_states.shape == (len(ids), 3 * hidden)
    for slot, layer in enumerate((0, 1)):
        assert (out.aux_hidden_states[:, slot * hidden : (slot + 1) * hidden] - hf[layer][0].to(DEVICE)).abs().max() < TOL
    # index num_layers is the last layer's output before the final norm: normed, it is the final state
    pre_norm = out.aux_hidden_states[:, 2 * hidden :]
    assert (runner.model.model.norm(pre_norm) - out.hidden_states).abs().max().item() < TOL
    assert not torch.allclose(pre_norm, out.hidden_states, atol=1e-2)


def test_eagle3_default_capture_layers():
    from splitspec.runtime.config import ConfigError, ModelConfig

    def config(num_layers):
        return ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
                                      "num_hidden_layers": num_layers, "num_attention_heads": 4, "vocab_size": 10})

    assert config(32).eagle3_capture_layers() == (2, 16, 29)  # Llama-3.1-8B (REFERENCES §2.3)
    assert config(8).eagle3_capture_layers() == (2, 4, 5)
    with pytest.raises(ConfigError, match=r"\(2, 3, 3\) are not distinct for a 6-layer target"):
        config(6).eagle3_capture_layers()
