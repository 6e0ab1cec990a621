"""The EAGLE-3 head in its published format (REFERENCES §2): tiny random checkpoints laid out as the
published ones (midlayer.* with q/k/v over 2H, hidden_norm, input_layernorm, own lm_head over a cut
draft vocabulary with d2t, no embedding, t2d present) load, and our head's logits equal an independent
forward written here from §2.4 with transformers' Llama modules, for a one-layer and a two-layer head.
The verifier captures the layers §2.3 names, and loading failures say exactly what is wrong."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from splitspec.runtime.batch import SequenceInput
from splitspec.runtime.config import ConfigError, ModelConfig
from splitspec.runtime.kv_cache import BlockTable
from splitspec.runtime.loader import CheckpointError
from splitspec.runtime.runner import ModelRunner, RuntimeConfig

H, HEADS, KV_HEADS, INTER, VOCAB, DRAFT_VOCAB = 64, 4, 2, 160, 97, 40


def head_config(num_layers: int = 1, aux_ids: list[int] | None = None, draft_vocab: int = DRAFT_VOCAB) -> dict:
    """The published template's fields (no rope_theta: RoPE base 10000), at toy size."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "intermediate_size": INTER,
              "num_hidden_layers": num_layers, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
              "vocab_size": VOCAB, "draft_vocab_size": draft_vocab, "rms_norm_eps": 1e-5,
              "max_position_embeddings": 512, "tie_word_embeddings": False, "torch_dtype": "float16"}
    if aux_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_ids, "use_aux_hidden_state": True}
    return config


def hot_ids(draft_vocab: int = DRAFT_VOCAB, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(VOCAB, generator=g)[:draft_vocab].sort().values


def head_state(seed: int, num_layers: int = 1, midlayer: bool = True, draft_vocab: int = DRAFT_VOCAB) -> dict:
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.08):
        return torch.randn(*shape, generator=g) * scale

    hd = H // HEADS
    first = "midlayer." if midlayer else "layers.0."
    used = hot_ids(draft_vocab)
    state = {
        "fc.weight": rand(H, 3 * H),
        f"{first}hidden_norm.weight": 1 + rand(H, scale=0.1),
        f"{first}input_layernorm.weight": 1 + rand(H, scale=0.1),
        f"{first}post_attention_layernorm.weight": 1 + rand(H, scale=0.1),
        f"{first}self_attn.q_proj.weight": rand(HEADS * hd, 2 * H),
        f"{first}self_attn.k_proj.weight": rand(KV_HEADS * hd, 2 * H),
        f"{first}self_attn.v_proj.weight": rand(KV_HEADS * hd, 2 * H),
        f"{first}self_attn.o_proj.weight": rand(H, HEADS * hd),
        f"{first}mlp.gate_proj.weight": rand(INTER, H),
        f"{first}mlp.up_proj.weight": rand(INTER, H),
        f"{first}mlp.down_proj.weight": rand(H, INTER),
        "norm.weight": 1 + rand(H, scale=0.1),
        "lm_head.weight": rand(draft_vocab, H, scale=0.3),
        "d2t": used - torch.arange(draft_vocab),  # offsets (REFERENCES §2.5)
        "t2d": torch.zeros(VOCAB, dtype=torch.bool).index_fill_(0, used, True),
    }
    for i in range(1, num_layers):
        p = f"layers.{i}."
        state.update({
            f"{p}input_layernorm.weight": 1 + rand(H, scale=0.1), f"{p}post_attention_layernorm.weight": 1 + rand(H, scale=0.1),
            f"{p}self_attn.q_proj.weight": rand(HEADS * hd, H), f"{p}self_attn.k_proj.weight": rand(KV_HEADS * hd, H),
            f"{p}self_attn.v_proj.weight": rand(KV_HEADS * hd, H), f"{p}self_attn.o_proj.weight": rand(H, HEADS * hd),
            f"{p}mlp.gate_proj.weight": rand(INTER, H), f"{p}mlp.up_proj.weight": rand(INTER, H),
            f"{p}mlp.down_proj.weight": rand(H, INTER)})
    return state


def write_head(path, config: dict, state: dict, fmt: str = "bin"):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if fmt == "bin":
        torch.save(state, path / "pytorch_model.bin")
    else:
        save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    return path


def load_head(path, dtype="float32") -> ModelRunner:
    return ModelRunner.load(RuntimeConfig(model_path=str(path), dtype=dtype, device="cpu", max_total_tokens=256,
                                          family="eagle3"))


def reference_logits(config: dict, state: dict, embed, tokens, features, positions) -> tuple[torch.Tensor, torch.Tensor]:
    """REFERENCES §2.4 with transformers' modules: fc when the features are 3H wide; the first layer's
    attention over cat([input_layernorm(embed), hidden_norm(h)]) with the residual h; later layers plain
    Llama decoder layers; logits = lm_head(norm(x)) over the draft vocabulary. Returns (logits, x)."""
    hf = LlamaConfig(**{k: v for k, v in config.items()
                        if k not in ("architectures", "torch_dtype", "draft_vocab_size", "eagle_config")})
    hf._attn_implementation = "eager"
    first = "midlayer." if any(k.startswith("midlayer.") for k in state) else "layers.0."

    def sub(prefix):
        return {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}

    attn = LlamaAttention(hf, layer_idx=0)
    for name in ("q_proj", "k_proj", "v_proj"):  # q/k/v read the 2H concatenation
        out_features = getattr(attn, name).out_features
        setattr(attn, name, torch.nn.Linear(2 * H, out_features, bias=False))
    attn.load_state_dict(sub(first + "self_attn."), strict=True)
    mlp = LlamaMLP(hf)
    mlp.load_state_dict(sub(first + "mlp."), strict=True)
    norms = {}
    for name in ("hidden_norm", "input_layernorm", "post_attention_layernorm"):
        norms[name] = LlamaRMSNorm(H, eps=hf.rms_norm_eps)
        norms[name].weight.data = state[f"{first}{name}.weight"]
    later = []
    for i in range(1, config["num_hidden_layers"]):
        layer = LlamaDecoderLayer(hf, layer_idx=i)
        layer.load_state_dict(sub(f"layers.{i}."), strict=True)
        later.append(layer)
    final_norm = LlamaRMSNorm(H, eps=hf.rms_norm_eps)
    final_norm.weight.data = state["norm.weight"]
    with torch.no_grad():
        h = features @ state["fc.weight"].T if features.shape[-1] == 3 * H else features
        position_ids = torch.tensor([positions])
        cos_sin = LlamaRotaryEmbedding(hf)(h[None], position_ids)
        n = len(tokens)
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        x_in = torch.cat([norms["input_layernorm"](embed[tokens]), norms["hidden_norm"](h)], -1)[None]
        x = h[None] + attn(x_in, position_embeddings=cos_sin, attention_mask=mask)[0]
        x = x + mlp(norms["post_attention_layernorm"](x))
        for layer in later:
            out = layer(x, attention_mask=mask, position_ids=position_ids, position_embeddings=cos_sin)
            x = out[0] if isinstance(out, tuple) else out
        return (final_norm(x[0]) @ state["lm_head.weight"].T).float(), x[0]


@pytest.mark.parametrize("num_layers, midlayer, fmt", [(1, True, "bin"), (1, False, "safetensors"), (2, True, "bin")])
def test_eagle3_head_logits_equal_an_independent_forward(tmp_path, num_layers, midlayer, fmt):
    config, state = head_config(num_layers), head_state(seed=3, num_layers=num_layers, midlayer=midlayer)
    path = write_head(tmp_path / "head", config, state, fmt)
    g = torch.Generator().manual_seed(9)
    embed = torch.randn(VOCAB, H, generator=g)
    runner = load_head(path)
    runner.model.share_target(embed)
    assert torch.equal(runner.model.hot_token_ids(), hot_ids())  # d + d2t[d]
    tokens = [5, 17, 3, 88, 42, 42, 7, 60]
    features = torch.randn(len(tokens), 3 * H, generator=g)  # the target's three captured layers
    want, want_x = reference_logits(config, state, embed, tokens, features, list(range(len(tokens))))
    # in two forwards: 5 rows, then 3 more on top of the KV the first wrote
    table = BlockTable()
    first = runner.batch([SequenceInput(table, tokens[:5], logits="all")])
    out_a = runner.forward(first, return_hidden=True, features=features[:5])
    runner.kv_cache.set_length(table, 5)
    second = runner.batch([SequenceInput(table, tokens[5:], logits="all")])
    out_b = runner.forward(second, return_hidden=True, features=features[5:])
    got = torch.cat([out_a.logits, out_b.logits])
    assert got.shape == (len(tokens), DRAFT_VOCAB)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()
    x = torch.cat([out_a.hidden_states, out_b.hidden_states])  # the feature the next draft step gets: pre-norm x
    assert torch.allclose(x, want_x, atol=1e-4, rtol=1e-4)
    # a draft step: the head's own output (H wide) goes in without fc
    runner.kv_cache.set_length(table, len(tokens))
    step = runner.batch([SequenceInput(table, [11], logits="all")])
    got_step = runner.forward(step, features=x[-1:]).logits
    want_step, _ = reference_logits(config, state, embed, tokens + [11], torch.cat([features @ state["fc.weight"].T, x[-1:]]),
                                    list(range(len(tokens) + 1)))
    assert torch.allclose(got_step[0], want_step[-1], atol=1e-4, rtol=1e-4)


def test_capture_layers_default_and_explicit_ids():
    """Default: the inputs of layers 2, L//2, L-3; explicit eagle_aux_hidden_state_layer_ids read as SGLang
    does (+1: id i is the output of layer i). The runner's captured states equal transformers'
    output_hidden_states at those indices (hidden_states[i] is the input of layer i)."""
    from helpers import hf_model

    from splitspec.demo import demo_model_dirs
    from splitspec.runtime.models.eagle3 import capture_layers

    target_dir = demo_model_dirs()["target"]
    target = ModelConfig.from_dir(target_dir)
    assert capture_layers(ModelConfig.from_dict(head_config()), target) == (2, 4, 5)
    explicit = ModelConfig.from_dict(head_config(aux_ids=[1, 3, 6]))
    assert capture_layers(explicit, target) == (2, 4, 7)
    # captured in layer order whatever order the config lists (SGLang and vLLM append in the layer loop)
    assert capture_layers(ModelConfig.from_dict(head_config(aux_ids=[6, 1, 3])), target) == (2, 4, 7)
    with pytest.raises(ConfigError, match=r"eagle_aux_hidden_state_layer_ids \[1, 3, 8\]: need distinct layer ids of the "
                                          r"8-layer target \(0\.\.7\)"):
        capture_layers(ModelConfig.from_dict(head_config(aux_ids=[1, 3, 8])), target)
    runner = ModelRunner.load(RuntimeConfig(model_path=str(target_dir), dtype="float32", device="cpu", max_total_tokens=256))
    reference = hf_model(target_dir)
    tokens = [13, 290, 351, 13, 290, 351, 700, 5, 9]
    with torch.no_grad():
        states = reference(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    for layers in ((2, 4, 5), (2, 4, 7)):
        runner.set_capture_layers(layers)
        table = BlockTable()
        out = runner.forward(runner.batch([SequenceInput(table, tokens)]))
        runner.kv_cache.release(table)
        want = torch.cat([states[i][0] for i in layers], -1)
        assert torch.allclose(out.aux_hidden_states, want, atol=2e-4, rtol=1e-3), layers


def test_a_full_draft_vocabulary_needs_no_d2t(tmp_path):
    """Vicuna-style heads: draft vocab = target vocab, d2t all zeros or absent; no map."""
    state = head_state(seed=4, draft_vocab=VOCAB)
    path = write_head(tmp_path / "head", head_config(draft_vocab=VOCAB), state)
    assert load_head(path).model.hot_token_ids() is None
    state.pop("d2t"), state.pop("t2d")
    config = head_config()
    del config["draft_vocab_size"]
    assert load_head(write_head(tmp_path / "head2", config, state)).model.hot_token_ids() is None


def test_an_fp16_head_loads_cast_and_keeps_d2t_integer(tmp_path):
    state = {k: (v.half() if v.is_floating_point() else v) for k, v in head_state(seed=5).items()}
    runner = load_head(write_head(tmp_path / "head", head_config(), state), dtype="bfloat16")
    assert runner.model.fc.weight.dtype == torch.bfloat16 and runner.model.d2t.dtype == torch.int64
    assert torch.equal(runner.model.hot_token_ids(), hot_ids())


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.pop("midlayer.hidden_norm.weight"), r"missing tensors: layers\.0\.hidden_norm\.weight"),
    (lambda s: s.pop("d2t"), r"missing tensors: d2t"),
    (lambda s: s.update({"midlayer.extra.weight": torch.zeros(3)}), r"unexpected tensors: layers\.0\.extra\.weight \(in pytorch_model\.bin\)"),
    (lambda s: s.update({"midlayer.self_attn.q_proj.weight": torch.zeros(H, H)}),
     r"tensor 'layers\.0\.self_attn\.q_proj\.weight' in pytorch_model\.bin has shape \[64, 64\], expected \[64, 128\]"),
    (lambda s: s.update({"lm_head.weight": torch.zeros(VOCAB, H)}),
     r"tensor 'lm_head\.weight' in pytorch_model\.bin has shape \[97, 64\], expected \[40, 64\]"),
    (lambda s: s.update({"d2t": s["d2t"].float()}), r"tensor 'd2t' in pytorch_model\.bin has dtype F32, expected an integer tensor"),
])
def test_mismatched_eagle3_heads_are_refused_by_name(tmp_path, edit, message):
    state = head_state(seed=6)
    edit(state)
    with pytest.raises(CheckpointError, match=message):
        load_head(write_head(tmp_path / "head", head_config(), state))


def test_midlayer_and_layers_0_names_for_one_tensor_are_refused(tmp_path):
    state = head_state(seed=6)
    state["layers.0.hidden_norm.weight"] = state["midlayer.hidden_norm.weight"].clone()
    with pytest.raises(CheckpointError, match=r"tensors 'midlayer\.hidden_norm\.weight' and 'layers\.0\.hidden_norm\.weight' "
                                              r"both load into 'layers\.0\.hidden_norm\.weight'"):
        load_head(write_head(tmp_path / "head", head_config(), state))


def test_sglangs_renamed_architecture_loads(tmp_path):
    """SGLang's copies of the heads say LlamaForCausalLMEagle3 (REFERENCES §2.1); the same files load."""
    config = head_config()
    config["architectures"] = ["LlamaForCausalLMEagle3"]
    assert ModelConfig.from_dict(config).family == "eagle3"
    runner = load_head(write_head(tmp_path / "head", config, head_state(seed=7)))
    assert torch.equal(runner.model.hot_token_ids(), hot_ids())
