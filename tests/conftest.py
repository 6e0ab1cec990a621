"""Shared fixtures: tiny random HF checkpoints of every supported family, made with transformers.

Every parameter is randomised (norm weights around 1, biases non-zero), so a loader that drops a bias
or a norm cannot pass an equivalence test by accident.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from helpers import NEAR_TIE_DIVERGENCES, PUBLISHED_V4_CONFIGS, TINY_FAMILIES, make_hf_model, randomize, save_checkpoint  # noqa: E402

# The files that take longest (slowest first, measured on a 2-core CI machine with 2 workers) run first, so that
# pytest-xdist's workers (--dist loadfile --no-loadscope-reorder hands out files in collection order) end together instead of one of them
# running a long end-to-end file alone at the end.
SLOW_FILES_FIRST = (
    "test_soak.py", "test_seed_launch_lines.py", "test_faults.py", "test_train_heads.py", "test_draft_loading.py",
    "test_mtp.py", "test_demo_models.py", "test_fuzz.py", "test_eagle.py", "test_drafter_pool.py", "test_launcher.py",
    "test_gateway.py", "test_speculative.py", "test_torch_compile.py", "test_long_prompt.py", "test_train.py",
    "test_kernels_interpreted.py", "test_bench.py", "test_dashboards.py", "test_token_map.py", "test_verifier_service.py",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    order = {item: i for i, item in enumerate(items)}
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), order[item]))


def _cpu_seconds() -> float:
    return sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
               for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))


_FILE_TEARDOWN_CPU: dict[str, float] = {}  # nodeid -> CPU seconds its file's fixtures took to tear down after it


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """SPLITSPEC_TEST_CPU_LOG=path: one JSON line per test with the CPU seconds it cost (this process and every
    child process it reaped, set-up and tear-down included), to see where a 2-core CI's time goes. A file's shared
    fixtures (servers started once for its tests) are reaped after its last test: their whole life's CPU gets a line
    of its own, "FILE::(the file's fixtures, torn down)", rather than being that test's."""
    log = os.environ.get("SPLITSPEC_TEST_CPU_LOG")
    before, began = (_cpu_seconds(), time.time()) if log else (0.0, 0.0)
    yield
    if log:
        shared = _FILE_TEARDOWN_CPU.pop(item.nodeid, 0.0)
        with open(log, "a") as out:  # with its wall-clock span and worker: how busy the workers kept the cores
            out.write(json.dumps({"test": item.nodeid, "cpu_s": round(_cpu_seconds() - before - shared, 2),
                                  "start": round(began, 2), "end": round(time.time(), 2),
                                  "worker": os.environ.get("PYTEST_XDIST_WORKER", "")}) + "\n")
            if shared:
                out.write(json.dumps({"test": f"{item.nodeid.split('::')[0]}::(the file's fixtures, torn down)",
                                      "cpu_s": round(shared, 2)}) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """The CPU of a file's last tear-down, where its module-scoped fixtures end (see pytest_runtest_protocol)."""
    last = os.environ.get("SPLITSPEC_TEST_CPU_LOG") and (nextitem is None or nextitem.path != item.path)
    before = _cpu_seconds() if last else 0.0
    yield
    if last:
        _FILE_TEARDOWN_CPU[item.nodeid] = _cpu_seconds() - before


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
    """Under pytest-xdist a worker hands its near-tie divergences to the controller, which reports them all (and
    removes the folder the workers shared trained drafts through)."""
    from draft_training import shared_root

    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["near_tie_divergences"] = list(NEAR_TIE_DIVERGENCES)
        workeroutput["shared_root"] = str(shared_root())
    else:  # the controller, once every worker is down
        for root in SHARED_ROOTS:
            shutil.rmtree(root, ignore_errors=True)


SHARED_ROOTS: set[str] = set()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):  # the controller, as each xdist worker ends (the hook exists only with xdist)
    output = getattr(node, "workeroutput", {})
    NEAR_TIE_DIVERGENCES.extend(output.get("near_tie_divergences", []))
    if output.get("shared_root"):
        SHARED_ROOTS.add(output["shared_root"])


def pytest_terminal_summary(terminalreporter):
    """ARCHITECTURE.md §3.1: greedy divergences at near-ties are allowed, counted and reported."""
    terminalreporter.write_line(f"greedy near-tie divergences: {len(NEAR_TIE_DIVERGENCES)}")
    for line in NEAR_TIE_DIVERGENCES:
        terminalreporter.write_line(f"  {line}")
