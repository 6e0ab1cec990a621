"""Shared fixtures: tiny random HF checkpoints of every supported family, made with transformers.

Every parameter is randomised (norm weights around 1, biases non-zero), so a loader that drops a bias
or a norm cannot pass an equivalence test by accident.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from helpers import NEAR_TIE_DIVERGENCES, PUBLISHED_V4_CONFIGS, TINY_FAMILIES, make_hf_model, randomize, save_checkpoint  # noqa: E402

@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """family -> directory of a saved tiny checkpoint (fp32 safetensors)."""
    root = tmp_path_factory.mktemp("tiny")
    return {family: save_checkpoint(make_hf_model(family, seed=i), root / family) for i, family in enumerate(TINY_FAMILIES)}


def write_v4_checkpoint(path: Path, config: dict, seed: int) -> Path:
    """A checkpoint whose config.json is the given hand-written (published-dialect) one, with the
    weights of a model transformers builds from that same config."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    hf_config = transformers.AutoConfig.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    randomize(model, seed=seed)
    model.save_pretrained(path)
    (path / "config.json").write_text(json.dumps(config, indent=2))  # undo the v5 rewrite
    return path


@pytest.fixture(scope="session")
def published_v4_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("v4")
    return {name: write_v4_checkpoint(root / name, config, seed=31 + i)
            for i, (name, config) in enumerate(PUBLISHED_V4_CONFIGS.items())}


@pytest.fixture(scope="session")
def llama31_v4_dir(published_v4_dirs) -> Path:
    return published_v4_dirs["llama-3.1"]


def pytest_sessionfinish(session):
    """Under pytest-xdist a worker hands its near-tie divergences to the controller, which reports them all."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["near_tie_divergences"] = list(NEAR_TIE_DIVERGENCES)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):  # the controller, as each xdist worker ends (the hook exists only with xdist)
    NEAR_TIE_DIVERGENCES.extend(getattr(node, "workeroutput", {}).get("near_tie_divergences", []))


def pytest_terminal_summary(terminalreporter):
    """ARCHITECTURE.md §3.1: greedy divergences at near-ties are allowed, counted and reported."""
    terminalreporter.write_line(f"greedy near-tie divergences: {len(NEAR_TIE_DIVERGENCES)}")
    for line in NEAR_TIE_DIVERGENCES:
        terminalreporter.write_line(f"  {line}")
