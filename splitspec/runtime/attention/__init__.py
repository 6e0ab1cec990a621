"""Attention backends, by name. Entries are imported lazily: GPU backends stay optional imports."""

from __future__ import annotations

from splitspec.registry import load_entry
from splitspec.runtime.attention.base import AttentionBackend, AttentionBatch

# name -> "module:Class"
ATTENTION_BACKENDS: dict[str, str] = {
    "torch": "splitspec.runtime.attention.torch_backend:TorchAttentionBackend",
    "flashinfer": "splitspec.runtime.attention.flashinfer_backend:FlashInferAttentionBackend",
}


def get_attention_backend(name: str) -> type[AttentionBackend]:
    return load_entry(ATTENTION_BACKENDS, name, "--attention-backend")


__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "AttentionBatch", "get_attention_backend"]
