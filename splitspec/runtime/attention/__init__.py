"""Attention backends, by name. Entries are imported lazily: GPU backends stay optional imports."""

from __future__ import annotations

import importlib

from splitspec.runtime.attention.base import AttentionBackend, AttentionBatch

# name -> "module:Class"
ATTENTION_BACKENDS: dict[str, str] = {
    "torch": "splitspec.runtime.attention.torch_backend:TorchAttentionBackend",
}


def get_attention_backend(name: str) -> type[AttentionBackend]:
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r} (available: {', '.join(ATTENTION_BACKENDS)})")
    module_name, class_name = ATTENTION_BACKENDS[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)


__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "AttentionBatch", "get_attention_backend"]
