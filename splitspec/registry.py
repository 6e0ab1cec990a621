"""Registries name implementations as "module:Class" strings and import them only when chosen, so an
optional dependency (FlashInfer, a model drafter's weights code) is never imported unless used."""

from __future__ import annotations

import importlib


def load_entry(table: dict[str, str], name: str, what: str):
    """The class registered under name; a ValueError listing the choices when there is none."""
    if name not in table:
        raise ValueError(f"{what} {name!r} is not available (available: {', '.join(table)})")
    module_name, class_name = table[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)
