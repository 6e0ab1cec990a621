"""`splitspec train lm`: the stdlib corpus and its manifest, a smoke training through the CLI (loss
falls, the output loads in transformers and in the runtime), and an interrupted run resumed exactly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import assert_greedy_match, hf_model, load_runner
from safetensors.torch import load_file

from splitspec import lifeline
from splitspec.train import corpus
from splitspec.train.dataset import check_manifest, prepare_dataset


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dataset")
    prepare_dataset(path, vocab_size=1024)
    return path


def train_cli(out: Path, dataset: Path, *extra: str) -> list[str]:
    return [sys.executable, "-P", "-m", "splitspec", "train", "lm", "--preset", "smoke", "--out", str(out),
            "--dataset", str(dataset), "--device", "cpu", *extra]


def test_corpus_rule_and_manifest():
    files = corpus.select_files()
    paths = [f.path for f in files]
    assert paths == sorted(paths) and len(paths) > 300
    assert not [p for p in paths if {"test", "tests", "idle_test", "encodings"} & set(p.split("/")[:-1])]
    assert "argparse.py" in paths and "json/decoder.py" in paths
    held_out = [f for f in files if f.held_out]
    assert 0.02 < len(held_out) / len(files) < 0.1
    recorded = corpus.manifest(files)
    assert corpus.compare_manifest(recorded, files) == []
    edited = json.loads(json.dumps(recorded))
    edited["python_version"] = "3.99.0"
    edited["files"][0][1] = "0" * 64
    removed = edited["files"].pop(1)
    edited["files"].append(["made/up.py", "1" * 64])
    differences = corpus.compare_manifest(edited, files)
    assert any("Python 3.99.0 recorded" in d for d in differences)
    assert any("1 file(s) changed: " + paths[0] in d for d in differences)
    assert any("1 file(s) new here: " + removed[0] in d for d in differences)
    assert any("1 file(s) missing here: made/up.py" in d for d in differences)


def test_dataset_has_tokenizer_tokens_and_manifest(dataset):
    from transformers import AutoTokenizer

    assert check_manifest(dataset) == []
    tokenizer = AutoTokenizer.from_pretrained(dataset)
    text = "def f(x):\n    return {'a': [1, 2.5]}  # ok\n"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.decode(tokenizer.encode("x = 1\n")[-1:]) == "\n"  # newlines are tokens of their own
    assert "# user: hi" in tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    tokens = load_file(dataset / "tokens.safetensors")
    assert tokens["train"].numel() > 1_000_000 and tokens["held_out"].numel() > 10_000
    assert int(tokens["train"].max()) < len(tokenizer)


def test_smoke_training_learns_and_loads(tmp_path, dataset):
    out = tmp_path / "lm"
    result = lifeline.run(train_cli(out, dataset), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    report = json.loads((out / "training.json").read_text())
    history = [h["held_out_loss"] for h in report["history"]]
    assert history[-1] < history[0] - 1.0, history  # it learned
    assert report["best_held_out_loss"] < report["bigram_held_out_loss"] + 1.0
    assert not (out / "train_state.pt").exists()
    reference, runner = hf_model(out), load_runner(out)
    prompt = [5, 6, 7, 8]
    with torch.no_grad():
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                      min_new_tokens=12)[0, 4:].tolist()
    from splitspec.generate import generate_ids
    from splitspec.runtime.sampling_params import SamplingParams

    gen = generate_ids(runner, [prompt], [SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)], set())
    assert_greedy_match(gen[0].output_ids, expected, reference, prompt, "smoke-trained model")


def test_interrupted_training_resumes_to_the_same_weights(tmp_path, dataset):
    steps = ["--steps", "60", "--save-every", "15", "--eval-every", "20"]
    straight = tmp_path / "straight"
    assert lifeline.run(train_cli(straight, dataset, *steps), capture_output=True, timeout=600).returncode == 0
    interrupted = tmp_path / "interrupted"
    process = lifeline.spawn(train_cli(interrupted, dataset, *steps), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    while not (interrupted / "train_state.pt").exists() and process.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert process.poll() is None, "training ended before it could be interrupted"
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert not (interrupted / "training.json").exists()
    resumed = lifeline.run(train_cli(interrupted, dataset, *steps), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed" in resumed.stderr
    a, b = load_file(straight / "model.safetensors"), load_file(interrupted / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((straight / "training.json").read_text())["history"] == \
        json.loads((interrupted / "training.json").read_text())["history"]
