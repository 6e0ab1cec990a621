"""A hub id resolves through huggingface_hub's cache offline (HF_HUB_OFFLINE=1), revision included."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from splitspec import lifeline


REPO_ID = "acme/tiny-llama"
COMMIT_MAIN = "1" * 40
COMMIT_V2 = "2" * 40


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory, tiny_checkpoints):
    """A synthetic HF hub cache laid out as huggingface_hub writes it: blobs, snapshots, refs.
    `main` holds one checkpoint, tag `v2` (commit 222...) a different one."""
    cache = tmp_path_factory.mktemp("hf") / "hub"
    repo = cache / ("models--" + REPO_ID.replace("/", "--"))
    for commit, family in ((COMMIT_MAIN, "llama-tied"), (COMMIT_V2, "qwen2-qkv-bias")):
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True)
        for file in tiny_checkpoints[family].iterdir():
            blob = repo / "blobs" / f"{commit[:8]}-{file.name}"
            blob.parent.mkdir(exist_ok=True)
            shutil.copy(file, blob)
            (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT_MAIN)
    (repo / "refs" / "v2").write_text(COMMIT_V2)
    return cache


def generate(model: str, cache, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_HOME": str(cache.parent)}
    return lifeline.run(
        [sys.executable, "-P", "-m", "splitspec", "generate", "--model-path", model, "--input-ids", "3,4,5",
         "--max-new-tokens", "8", "--ignore-eos", "--json", "--log-level", "warning", *extra],
        capture_output=True, text=True, timeout=300, env=env,
    )


def output_ids(result: subprocess.CompletedProcess) -> list[int]:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["output_ids"]


def test_hub_id_resolves_offline_by_revision(hf_cache, tiny_checkpoints):
    runs = [(str(tiny_checkpoints["llama-tied"]),), (str(tiny_checkpoints["qwen2-qkv-bias"]),), (REPO_ID,),
            (REPO_ID, "--revision", "v2"), (REPO_ID, "--revision", COMMIT_V2)]
    with ThreadPoolExecutor(3) as pool:  # separate processes: side by side
        local_main, local_v2, hub_main, hub_v2, hub_commit = map(
            output_ids, pool.map(lambda run: generate(run[0], hf_cache, *run[1:]), runs))
    assert local_main != local_v2  # the two revisions are distinguishable
    assert hub_main == local_main
    assert hub_v2 == local_v2
    assert hub_commit == local_v2


def test_unknown_hub_id_offline_is_a_clear_error(hf_cache):
    result = generate("acme/not-cached", hf_cache)
    assert result.returncode == 2
    assert "acme/not-cached" in result.stderr and "Traceback" not in result.stderr
    result = generate(REPO_ID, hf_cache, "--revision", "no-such-branch")
    assert result.returncode == 2 and "no-such-branch" in result.stderr
