"""Helpers shared by the tests: tiny random HF models, runners, reference logits, tie-aware greedy
comparison (ARCHITECTURE.md §3.1)."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from splitspec import lifeline

# The runtime tests run on CPU in CI; SPLITSPEC_TEST_DEVICE=cuda runs the same suite on a GPU
# (references stay on CPU in fp32; our outputs are compared on the test device).
DEVICE = os.environ.get("SPLITSPEC_TEST_DEVICE", "cpu")
NEAR_TIE = 1e-4  # fp32: a greedy divergence is acceptable only where the reference's top-2 margin is below this
NEAR_TIE_DIVERGENCES: list[str] = []  # reported at the end of the session

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


# config.json of published checkpoints in their own (transformers 4) dialect, shrunk; the fields that
# steer behaviour (rope block, dtype, sliding-window switches, tie, bias defaults) are as published.
PUBLISHED_V4_CONFIGS = {
    "llama-3.1": LLAMA31_V4_CONFIG,
    "llama-2": {  # meta-llama/Llama-2-7b-hf: rope_scaling null, no rope_theta, fp16
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 112,
        "max_position_embeddings": 4096, "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 4,
        "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None, "tie_word_embeddings": False,
        "torch_dtype": "float16", "transformers_version": "4.31.0.dev0", "use_cache": True, "vocab_size": 300,
    },
    "qwen2.5": {  # Qwen/Qwen2.5-7B-Instruct: sliding_window set but use_sliding_window false
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_dropout": 0.0, "bos_token_id": 151643 % 300,
        "eos_token_id": 151645 % 300, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
        "intermediate_size": 112, "max_position_embeddings": 32768, "max_window_layers": 28, "num_attention_heads": 4,
        "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
        "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 300,
    },
    "mistral-7b-v0.1": {  # mistralai/Mistral-7B-v0.1: sliding window on every layer (shrunk to 5)
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 112,
        "max_position_embeddings": 32768, "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 5, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "transformers_version": "4.34.0.dev0", "use_cache": True, "vocab_size": 300,
    },
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


def load_runner(model_dir, max_total_tokens: int = 4096, page_size: int = 4, dtype: str = "float32", **kwargs):
    from splitspec.runtime.runner import ModelRunner, RuntimeConfig

    return ModelRunner.load(RuntimeConfig(model_path=str(model_dir), dtype=dtype, device=DEVICE,
                                          max_total_tokens=max_total_tokens, page_size=page_size, **kwargs))


def hf_logits(model, ids: list[int], position_ids: list[int] | None = None) -> torch.Tensor:
    with torch.no_grad():
        kwargs = {} if position_ids is None else {"position_ids": torch.tensor([position_ids])}
        return model(torch.tensor([ids]), **kwargs).logits[0].float().to(DEVICE)


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_greedy_match(ours: list[int], expected: list[int], reference, prompt: list[int], label: str = "") -> None:
    """Greedy outputs must be equal, except that at the first divergence the reference may have had a
    near-tie (top-2 logit margin < NEAR_TIE) which our token is part of; such cases are counted."""
    if ours == expected:
        return
    i = next((j for j, (a, b) in enumerate(zip(ours, expected)) if a != b), min(len(ours), len(expected)))
    assert i < min(len(ours), len(expected)), f"{label}: lengths differ ({len(ours)} vs {len(expected)}) with equal prefixes"
    logits = hf_logits(reference, prompt + expected[:i])[-1]
    top = logits.max()
    margin = (top - logits[expected[i]]).item() + (top - logits[ours[i]]).item()
    top2 = logits.topk(2).values
    assert margin < NEAR_TIE and (top2[0] - top2[1]).item() < NEAR_TIE, (
        f"{label}: greedy diverged at output {i} ({ours[i]} vs {expected[i]}) without a near-tie "
        f"(top-2 margin {(top2[0] - top2[1]).item():.2e})"
    )
    NEAR_TIE_DIVERGENCES.append(f"{label} at output {i}: top-2 margin {(top2[0] - top2[1]).item():.1e}")


_LOGS = tempfile.mkdtemp(prefix="splitspec-test-logs-")
atexit.register(shutil.rmtree, _LOGS, ignore_errors=True)


class ServiceLog:
    """A service's stderr kept in a file, read whole on demand (`process.stderr.read()`). Not a pipe: a pipe
    nobody drains fills at 64 KiB and then blocks the service at its next log line (a gateway logging the
    tracebacks of cancelled requests once stopped answering that way)."""

    def __init__(self, path: str):
        self.path = path

    def read(self) -> str:
        return Path(self.path).read_text(errors="replace")

    def close(self) -> None:  # Popen's __exit__ closes its stderr
        pass


def spawn_service(argv: list[str], **popen_kwargs) -> subprocess.Popen:
    """A long-running service process (dies with the test run) whose stderr goes to a file."""
    fd, path = tempfile.mkstemp(dir=_LOGS, suffix=".log")
    try:
        process = lifeline.spawn(argv, stdout=subprocess.DEVNULL, stderr=fd, **popen_kwargs)
    finally:
        os.close(fd)
    process.stderr = ServiceLog(path)
    return process
