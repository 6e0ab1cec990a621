"""The model a command serves when no --model-path is given.

The demo target is the default of `splitspec generate`, `verifier`, `bench` and the drafters. The modules
that read --model-path (splitspec.model_flags, splitspec.draft_models) sit below the demo models, whose
building trains heads and measures them through generation, so they must not import them: the command
line's entry (splitspec.cli) names the provider once, and they ask this module. Called outside that entry,
with no provider set, a missing --model-path is an error that says so.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

_provider: Callable[[], Path] | None = None


def set_provider(provider: Callable[[], Path] | None) -> None:
    global _provider
    _provider = provider


def default_model() -> Path:
    if _provider is None:
        raise ValueError("--model-path is required here (the demo target is the default of the splitspec command)")
    return _provider()
