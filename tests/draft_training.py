"""Small draft heads for the demo target, trained in the tests in seconds so that acceptance is real
(a random head accepts almost nothing): an EAGLE-3 head over a cut draft vocabulary, and MiMo-layout
MTP layers written into a copy of the target (with zero q/k/v biases its outputs are the demo
target's). Training data: the target's own greedy continuations of the code prompts; each head
learns the target's next-token distribution (cross-entropy against it)."""

from __future__ import annotations

import fcntl
import functools
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from helpers import hf_model
from safetensors.torch import load_file, save_file

from splitspec.demo import demo_model_dirs


def shared_root() -> Path | None:
    """A folder every pytest-xdist worker of this run shares (None outside xdist); conftest removes it at the end."""
    uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    return Path(tempfile.gettempdir()) / f"splitspec-tests-{uid}" if uid else None


def across_workers(name: str, compute):
    """compute() once per test run: the first worker to ask computes and saves it, the others wait and load it."""
    root = shared_root()
    if root is None:
        return compute()
    root.mkdir(exist_ok=True)
    path = root / f"{name}.pt"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return torch.load(path)
        value = compute()
        torch.save(value, path)
        return value


@functools.lru_cache(maxsize=1)
def greedy_corpus() -> tuple[list[torch.Tensor], tuple]:
    """(sequences, per sequence ([input of layer i for i < L] + [the last layer's output before the final
    norm], the final normed state)), cached (across xdist workers too)."""
    return across_workers("greedy_corpus", _greedy_corpus)


def _greedy_corpus() -> tuple[list[torch.Tensor], tuple]:
    from test_speculative import PROMPTS, run
    from transformers import AutoTokenizer

    from splitspec.runtime.runner import ModelRunner, RuntimeConfig
    from splitspec.runtime.sampling_params import SamplingParams

    target_dir = demo_model_dirs()["target"]
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    runner = ModelRunner.load(RuntimeConfig(model_path=str(target_dir), dtype="float32", device="cpu", max_total_tokens=16384))
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    outs = run(runner, prompts, [SamplingParams(temperature=0.0, max_new_tokens=96, ignore_eos=True)] * len(prompts))
    reference = hf_model(target_dir)
    sequences = [torch.tensor(p + o.output_ids) for p, o in zip(prompts, outs)]
    last_output = []  # the last decoder layer's output: the state before the final norm
    hook = reference.model.layers[-1].register_forward_hook(
        lambda module, args, output: last_output.append((output[0] if isinstance(output, tuple) else output)[0]))
    with torch.no_grad():
        states = []
        for seq in sequences:
            out = reference.model(seq[None], output_hidden_states=True)
            states.append(([h[0] for h in out.hidden_states[:-1]] + [last_output.pop()], out.last_hidden_state[0]))
    hook.remove()
    return sequences, tuple(states)


def _target_weights():
    reference = hf_model(demo_model_dirs()["target"])
    return reference.model.embed_tokens.weight.detach(), reference.lm_head.weight.detach(), reference.config


def train_eagle3_head(out: Path, draft_vocab: int = 1024, steps: int = 120) -> Path:
    """An EAGLE-3 head on layers (2, 4, 5) of the 8-layer demo target (the default capture), its draft
    vocabulary the target ids most frequent in the corpus, written in the published layout."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

    sequences, states = greedy_corpus()
    embed, head_w, target = _target_weights()
    hidden = target.hidden_size
    counts = torch.bincount(torch.cat(sequences), minlength=target.vocab_size)
    used = counts.argsort(descending=True, stable=True)[:draft_vocab].sort().values
    hf = LlamaConfig(hidden_size=hidden, intermediate_size=512, num_hidden_layers=1, num_attention_heads=target.num_attention_heads,
                     num_key_value_heads=target.num_key_value_heads, head_dim=target.head_dim, vocab_size=target.vocab_size,
                     rms_norm_eps=1e-5, max_position_embeddings=target.max_position_embeddings)
    hf._attn_implementation = "eager"
    torch.manual_seed(0)
    attn = LlamaAttention(hf, layer_idx=0)
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(attn, name, torch.nn.Linear(2 * hidden, getattr(attn, name).out_features, bias=False))
    mlp = LlamaMLP(hf)
    norms = torch.nn.ModuleDict({n: LlamaRMSNorm(hidden, eps=1e-5) for n in
                                 ("hidden_norm", "input_layernorm", "post_attention_layernorm", "norm")})
    fc = torch.nn.Linear(3 * hidden, hidden, bias=False)
    lm_head = torch.nn.Linear(hidden, draft_vocab, bias=False)
    lm_head.weight.data = head_w[used].clone()
    rope = LlamaRotaryEmbedding(hf)
    modules = torch.nn.ModuleList([attn, mlp, norms, fc, lm_head])
    optimizer = torch.optim.AdamW(modules.parameters(), lr=2e-3)
    for step in range(steps):
        loss = 0.0
        for seq, (layer_inputs, final) in zip(sequences[step % 4 :: 4], states[step % 4 :: 4]):
            n = len(seq) - 2
            feats = torch.cat([layer_inputs[i][:n] for i in (2, 4, 5)], -1)
            h = fc(feats)
            positions = torch.arange(n)[None]
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            x_in = torch.cat([norms["input_layernorm"](embed[seq[1 : n + 1]]), norms["hidden_norm"](h)], -1)[None]
            x = h[None] + attn(x_in, position_embeddings=rope(h[None], positions), attention_mask=mask)[0]
            x = (x + mlp(norms["post_attention_layernorm"](x)))[0]
            target_probs = torch.softmax(final[1 : n + 1] @ head_w[used].T, -1)
            loss = loss - (target_probs * torch.log_softmax(lm_head(norms["norm"](x)), -1)).sum(-1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    state = {"fc.weight": fc.weight, "norm.weight": norms["norm"].weight, "lm_head.weight": lm_head.weight,
             "midlayer.hidden_norm.weight": norms["hidden_norm"].weight,
             "midlayer.input_layernorm.weight": norms["input_layernorm"].weight,
             "midlayer.post_attention_layernorm.weight": norms["post_attention_layernorm"].weight}
    state.update({f"midlayer.self_attn.{k}": v for k, v in attn.state_dict().items()})
    state.update({f"midlayer.mlp.{k}": v for k, v in mlp.state_dict().items()})
    state = {k: v.detach().clone() for k, v in state.items()}
    state["d2t"] = used - torch.arange(draft_vocab)
    state["t2d"] = torch.zeros(target.vocab_size, dtype=torch.bool).index_fill_(0, used, True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden, "intermediate_size": 512,
              "num_hidden_layers": 1, "num_attention_heads": target.num_attention_heads, "head_dim": target.head_dim,
              "num_key_value_heads": target.num_key_value_heads, "vocab_size": target.vocab_size,
              "draft_vocab_size": draft_vocab, "rms_norm_eps": 1e-5, "max_position_embeddings": target.max_position_embeddings,
              "tie_word_embeddings": False, "torch_dtype": "float32"}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    torch.save(state, out / "pytorch_model.bin")
    return out


def mtp_state(prefix: str, layer) -> dict[str, torch.Tensor]:
    return {f"{prefix}{k}": v.detach().clone() for k, v in layer.state_dict().items()}


def train_mimo_target(out: Path, num_layers: int = 2, prenorm: bool = False, steps: int = 70) -> Path:
    """A MiMo-layout copy of the demo target: its weights with zero q/k/v biases (a Qwen2 whose outputs
    are the demo target's) plus `num_layers` MTP layers, layer k trained to predict token p+2+k from
    (h[p], token p+1+k) as MTP layer k of a multi-layer draft does; position 0's embedding masked. h is
    the final normed state (what SGLang's EAGLE worker hands MTP), or with prenorm the last layer's output
    before the norm (what its multi-layer worker hands). Trained once per session (cached), written
    wherever asked."""
    return write_mimo_target(out, _trained_mtp_layers(num_layers, prenorm, steps))


@functools.lru_cache(maxsize=2)
def _trained_mtp_layers(num_layers: int, prenorm: bool, steps: int) -> list[dict[str, torch.Tensor]]:
    return across_workers(f"mtp_layers_{num_layers}_{prenorm}_{steps}", lambda: _train_mtp_layers(num_layers, prenorm, steps))


def _train_mtp_layers(num_layers: int, prenorm: bool, steps: int) -> list[dict[str, torch.Tensor]]:
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RMSNorm, Qwen2RotaryEmbedding

    sequences, states = greedy_corpus()
    embed, head_w, target = _target_weights()
    hidden = target.hidden_size
    hf = Qwen2Config(hidden_size=hidden, intermediate_size=target.intermediate_size, num_hidden_layers=num_layers,
                     num_attention_heads=target.num_attention_heads, num_key_value_heads=target.num_key_value_heads,
                     vocab_size=target.vocab_size, rms_norm_eps=target.rms_norm_eps,
                     max_position_embeddings=target.max_position_embeddings)
    hf._attn_implementation = "eager"
    torch.manual_seed(0)
    layers = []
    for k in range(num_layers):
        layer = torch.nn.ModuleDict({
            "token_layernorm": Qwen2RMSNorm(hidden, eps=hf.rms_norm_eps), "hidden_layernorm": Qwen2RMSNorm(hidden, eps=hf.rms_norm_eps),
            "input_proj": torch.nn.Linear(2 * hidden, hidden, bias=False), "block": Qwen2DecoderLayer(hf, layer_idx=k),
            "final_layernorm": Qwen2RMSNorm(hidden, eps=hf.rms_norm_eps)})
        layers.append(layer)
    rope = Qwen2RotaryEmbedding(hf)
    optimizer = torch.optim.AdamW(torch.nn.ModuleList(layers).parameters(), lr=2e-3)
    for step in range(steps):
        loss = 0.0
        for seq, (layer_states, final) in zip(sequences[step % 4 :: 4], states[step % 4 :: 4]):
            h = layer_states[-1] if prenorm else final
            for k, layer in enumerate(layers):
                n = len(seq) - 2 - k
                positions = torch.arange(n)
                e = embed[seq[1 + k : n + 1 + k]].clone()
                e[positions == 0] = 0
                x = layer["input_proj"](torch.cat([layer["hidden_layernorm"](h[:n]), layer["token_layernorm"](e)], -1))[None]
                mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
                y = layer["block"](x, attention_mask=mask, position_ids=positions[None],
                                   position_embeddings=rope(x, positions[None]))
                x = layer["final_layernorm"]((y[0] if isinstance(y, tuple) else y)[0])
                target_probs = torch.softmax(final[1 + k : n + 1 + k] @ head_w.T, -1)
                loss = loss - (target_probs * torch.log_softmax(x @ head_w.T, -1)).sum(-1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return [
        {**mtp_state("", layer["block"]), **{f"{n}.weight": layer[n].weight.detach().clone()
                                             for n in ("token_layernorm", "hidden_layernorm", "final_layernorm")},
         "input_proj.weight": layer["input_proj"].weight.detach().clone()} for layer in layers]


def write_mimo_target(out: Path, mtp_layers: list[dict[str, torch.Tensor]]) -> Path:
    """The demo target as a MiMo checkpoint (zero q/k/v biases) carrying these MTP layers' tensors
    (names relative to model.mtp_layers.{i}.)."""
    source = demo_model_dirs()["target"]
    out.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "generation_config.json"):
            shutil.copy(f, out / f.name)
    config = json.loads((source / "config.json").read_text())
    config.update(architectures=["MiMoForCausalLM"], model_type="mimo", num_nextn_predict_layers=len(mtp_layers),
                  dtype="float32")
    (out / "config.json").write_text(json.dumps(config))
    tensors = {}
    for shard in sorted(source.glob("*.safetensors")):
        tensors.update({k: v.float() for k, v in load_file(shard).items()})
    for i in range(config["num_hidden_layers"]):
        for name in ("q_proj", "k_proj", "v_proj"):
            rows = tensors[f"model.layers.{i}.self_attn.{name}.weight"].shape[0]
            tensors[f"model.layers.{i}.self_attn.{name}.bias"] = torch.zeros(rows)
    for i, layer in enumerate(mtp_layers):
        tensors.update({f"model.mtp_layers.{i}.{k}": v.contiguous() for k, v in layer.items()})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
