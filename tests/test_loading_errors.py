"""Bad checkpoints fail at start with an error naming the tensor or field; nothing half-loads."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch
from helpers import load_runner
from safetensors.torch import load_file, save_file

from splitspec import lifeline
from splitspec.runtime import loader
from splitspec.runtime.config import ConfigError, ModelConfig, parse_rope
from splitspec.runtime.loader import CheckpointError


@pytest.fixture
def broken(tmp_path, tiny_checkpoints):
    """A writable copy of a tiny checkpoint plus a function that rewrites its tensors."""
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoints["qwen2-qkv-bias"], path)

    def edit(fn):
        tensors = load_file(path / "model.safetensors")
        fn(tensors)
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        return path

    return edit


@pytest.fixture
def no_data_reads(monkeypatch):
    """Fails the test if any tensor data is read: validation must come first."""

    def forbidden(*args, **kwargs):
        raise AssertionError("tensor data was read before the checkpoint was validated")

    monkeypatch.setattr(loader, "_load_tensors", forbidden)


def test_missing_tensor_is_named(broken, no_data_reads):
    path = broken(lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(CheckpointError, match=r"missing tensors: model\.layers\.1\.self_attn\.k_proj\.bias"):
        load_runner(path)


def test_unexpected_tensor_is_named(broken, no_data_reads):
    path = broken(lambda t: t.update({"model.layers.0.mlp.extra_proj.weight": torch.zeros(3, 3)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensors: model\.layers\.0\.mlp\.extra_proj\.weight \(in model\.safetensors\)"):
        load_runner(path)


def test_misshaped_tensor_is_named(broken, no_data_reads):
    path = broken(lambda t: t.update({"model.layers.2.mlp.up_proj.weight": torch.zeros(95, 64)}))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.2\.mlp\.up_proj\.weight' in model\.safetensors has shape \[95, 64\], expected \[96, 64\]"):
        load_runner(path)


def test_quantized_dtype_is_refused(broken, no_data_reads):
    path = broken(lambda t: t.update({"model.norm.weight": torch.ones(64, dtype=torch.int8)}))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' .* dtype I8"):
        load_runner(path)


def test_misshaped_tensor_in_last_shard_fails_before_any_load(tmp_path, no_data_reads):
    from conftest import make_hf_model

    path = tmp_path / "sharded"
    make_hf_model("llama-tied").save_pretrained(path, max_shard_size="50KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    last_file = sorted(set(index["weight_map"].values()))[-1]
    tensors = load_file(path / last_file)
    name = sorted(tensors)[0]
    tensors[name] = torch.zeros(2, 2)
    save_file(tensors, path / last_file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"'{name}' in {last_file} has shape \[2, 2\]"):
        load_runner(path)


def test_missing_shard_file_is_named(tmp_path):
    from conftest import make_hf_model

    path = tmp_path / "sharded"
    make_hf_model("llama-tied").save_pretrained(path, max_shard_size="50KB")
    victim = sorted(path.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"shard files listed but not found: {victim.name}"):
        load_runner(path)


def test_tied_checkpoint_needs_no_lm_head_but_untied_does(broken):
    path = broken(lambda t: None)
    config = json.loads((path / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"missing tensors: lm_head\.weight"):
        load_runner(path)


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "n_embd": 8}))
    with pytest.raises(ConfigError, match=r"architecture 'GPT2LMHeadModel' is not supported \(supported: .*LlamaForCausalLM"):
        ModelConfig.from_dir(tmp_path)


def test_missing_config_field_is_named(tiny_checkpoints):
    raw = json.loads((tiny_checkpoints["llama-tied"] / "config.json").read_text())
    del raw["intermediate_size"]
    with pytest.raises(ConfigError, match="required field 'intermediate_size' is missing"):
        ModelConfig.from_dict(raw)


def test_unsupported_rope_type_is_named():
    with pytest.raises(ConfigError, match=r"rope_scaling\.rope_type='longrope' is not supported"):
        parse_rope({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}})
    with pytest.raises(ConfigError, match=r"rope_parameters\.rope_type='dynamic'"):
        parse_rope({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}})


def test_both_rope_dialects_agree():
    v4 = parse_rope({"rope_theta": 500000.0, "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})
    v5 = parse_rope({"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})
    assert v4 == v5 and v4.theta == 500000.0 and v4.get("factor") == 8.0
    assert parse_rope({}).rope_type == "default" and parse_rope({}).theta == 10000.0


def test_cli_reports_bad_checkpoint_without_traceback(broken):
    path = broken(lambda t: t.pop("model.embed_tokens.weight"))
    result = lifeline.run(
        [sys.executable, "-P", "-m", "splitspec", "generate", "--model-path", str(path), "--input-ids", "1,2", "--log-level", "error"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "missing tensors: model.embed_tokens.weight" in result.stderr
    assert "Traceback" not in result.stderr


def test_mistral_consolidated_weights_are_not_loaded_twice(tmp_path, tiny_checkpoints):
    """Mistral repos ship consolidated.safetensors beside the HF weights; without an index only the
    HF files are read."""
    path = tmp_path / "mistral"
    shutil.copytree(tiny_checkpoints["mistral-sliding"], path)
    save_file({"tok_embeddings.weight": torch.zeros(4, 4)}, path / "consolidated.safetensors")
    assert set(loader.read_checkpoint_index(path)) == set(load_file(path / "model.safetensors"))
    load_runner(path)
