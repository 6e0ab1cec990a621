"""The EAGLE-1/2 head in its published format (REFERENCES §1): tiny random checkpoints laid out as the
published ones (fc with and without bias, keys without `model.`, no layer-0 input norm, an fp32
pytorch_model.bin or safetensors, the embedding copy stored but ignored) load, and our head's logits
equal an independent forward written here from §1.4 with transformers' Llama layers. Mismatched
checkpoints are refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from splitspec.runtime.batch import SequenceInput
from splitspec.runtime.kv_cache import BlockTable
from splitspec.runtime.loader import CheckpointError
from splitspec.runtime.runner import ModelRunner, RuntimeConfig

H, HEADS, KV_HEADS, INTER, VOCAB = 64, 4, 2, 160, 97


def head_config(bias) -> dict:
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "intermediate_size": INTER,
              "num_hidden_layers": 1, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "vocab_size": VOCAB,
              "rms_norm_eps": 1e-5, "max_position_embeddings": 512, "rope_theta": 500000.0, "torch_dtype": "float32"}
    if bias is not None:
        config["bias"] = bias
    return config


def head_state(seed: int, with_bias: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.08):
        return torch.randn(*shape, generator=g) * scale

    hd = H // HEADS
    state = {
        "embed_tokens.weight": rand(VOCAB, H, scale=1.0),  # the published files carry a copy; it must be ignored
        "fc.weight": rand(H, 2 * H),
        "layers.0.self_attn.q_proj.weight": rand(HEADS * hd, H),
        "layers.0.self_attn.k_proj.weight": rand(KV_HEADS * hd, H),
        "layers.0.self_attn.v_proj.weight": rand(KV_HEADS * hd, H),
        "layers.0.self_attn.o_proj.weight": rand(H, HEADS * hd),
        "layers.0.mlp.gate_proj.weight": rand(INTER, H),
        "layers.0.mlp.up_proj.weight": rand(INTER, H),
        "layers.0.mlp.down_proj.weight": rand(H, INTER),
        "layers.0.post_attention_layernorm.weight": 1 + rand(H, scale=0.1),
    }
    if with_bias:
        state["fc.bias"] = rand(H)
    return state


def write_head(path, config: dict, state: dict, fmt: str):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if fmt == "bin":
        torch.save(state, path / "pytorch_model.bin")
    else:
        save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    return path


def reference_logits(config: dict, state: dict, target_embed, target_head, tokens, features, positions) -> torch.Tensor:
    """REFERENCES §1.4 with transformers' layers: fc(cat[embed, h]) -> layer 0 without input norm ->
    the target's head, no final norm; causal attention over the given positions."""
    hf = LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures", "bias", "torch_dtype")})
    hf._attn_implementation = "eager"
    layer = LlamaDecoderLayer(hf, layer_idx=0)
    layer.input_layernorm = torch.nn.Identity()
    layer.load_state_dict({k.removeprefix("layers.0."): v for k, v in state.items() if k.startswith("layers.0.")},
                          strict=True)
    fc = torch.nn.Linear(2 * H, H, bias="fc.bias" in state)
    fc.weight.data = state["fc.weight"]
    if "fc.bias" in state:
        fc.bias.data = state["fc.bias"]
    with torch.no_grad():
        x = fc(torch.cat([target_embed[tokens], features], -1))[None]
        position_ids = torch.tensor([positions])
        cos_sin = LlamaRotaryEmbedding(hf)(x, position_ids)
        n = len(tokens)
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = layer(x, attention_mask=mask, position_ids=position_ids, position_embeddings=cos_sin)
        out = out[0] if isinstance(out, tuple) else out
        return (out[0] @ target_head.T).float()


def load_head(path, dtype="float32") -> ModelRunner:
    return ModelRunner.load(RuntimeConfig(model_path=str(path), dtype=dtype, device="cpu", max_total_tokens=256,
                                          family="eagle"))


@pytest.mark.parametrize("bias, fmt", [(None, "bin"), (True, "safetensors"), (False, "bin"), (False, "safetensors")])
def test_eagle_head_logits_equal_an_independent_forward(tmp_path, bias, fmt):
    with_bias = bias is not False  # no "bias" key means a bias (the reference's default)
    config, state = head_config(bias), head_state(seed=3, with_bias=with_bias)
    path = write_head(tmp_path / "head", config, state, fmt)
    g = torch.Generator().manual_seed(9)
    target_embed, target_head = torch.randn(VOCAB, H, generator=g), torch.randn(VOCAB, H, generator=g) * 0.1
    runner = load_head(path)
    assert (runner.model.fc.bias is not None) == with_bias
    runner.model.share_target(target_embed, target_head)
    tokens = [5, 17, 3, 88, 42, 42, 7, 60]
    features = torch.randn(len(tokens), H, generator=g)
    want = reference_logits(config, state, target_embed, target_head, tokens, features, list(range(len(tokens))))
    # in two forwards: 5 rows, then 3 more on top of the KV the first wrote
    table = BlockTable()
    first = runner.batch([SequenceInput(table, tokens[:5], logits="all")])
    got_a = runner.forward(first, features=features[:5]).logits
    runner.kv_cache.set_length(table, 5)
    second = runner.batch([SequenceInput(table, tokens[5:], logits="all")])
    got_b = runner.forward(second, features=features[5:]).logits
    got = torch.cat([got_a, got_b])
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()


def test_an_fp32_head_is_cast_on_load(tmp_path):
    config, state = head_config(None), head_state(seed=4, with_bias=True)
    path = write_head(tmp_path / "head", config, state, "bin")
    runner = load_head(path, dtype="bfloat16")
    assert runner.model.fc.weight.dtype == torch.bfloat16
    assert torch.equal(runner.model.fc.weight.float(), state["fc.weight"].to(torch.bfloat16).float())


@pytest.mark.parametrize("bias, drop, add, message", [
    (True, "fc.bias", None, "missing tensors: fc.bias"),
    (False, None, ("fc.bias", (H,)), "unexpected tensors: fc.bias"),
    (None, None, ("layers.0.input_layernorm.weight", (H,)), "unexpected tensors: layers.0.input_layernorm.weight"),
    (None, "layers.0.mlp.up_proj.weight", None, "missing tensors: layers.0.mlp.up_proj.weight"),
])
def test_mismatched_heads_are_refused_by_name(tmp_path, bias, drop, add, message):
    state = head_state(seed=5, with_bias=bias is not False)
    if drop:
        state.pop(drop, None)
    if add:
        state[add[0]] = torch.zeros(add[1])
    path = write_head(tmp_path / "head", head_config(bias), state, "bin")
    with pytest.raises(CheckpointError, match=message.replace(".", r"\.")):
        load_head(path)
