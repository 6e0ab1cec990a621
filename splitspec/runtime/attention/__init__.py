"""Attention backends, by name. Entries are imported lazily: GPU backends stay optional imports, and the flags that
name a backend parse without importing torch (`splitspec up` and `splitspec drafter --help` never do)."""

from __future__ import annotations

from splitspec.registry import load_entry

# name -> "module:Class"
ATTENTION_BACKENDS: dict[str, str] = {
    "torch": "splitspec.runtime.attention.torch_backend:TorchAttentionBackend",
    "flashinfer": "splitspec.runtime.attention.flashinfer_backend:FlashInferAttentionBackend",
}
# SGLang's --attention-backend values that splitspec does not implement yet: accepted, served by torch
SGLANG_ATTENTION_BACKENDS = ("fa3", "fa4", "triton", "torch_native", "flex_attention", "trtllm_mha",
                             "aiter", "wave", "ascend", "intel_amx", "cutlass_mla", "flashmla")


def get_attention_backend(name: str) -> type:
    """The AttentionBackend class (attention/base.py) registered as name."""
    return load_entry(ATTENTION_BACKENDS, name, "--attention-backend")


__all__ = ["ATTENTION_BACKENDS", "SGLANG_ATTENTION_BACKENDS", "get_attention_backend"]
