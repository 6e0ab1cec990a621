"""`splitspec train eagle|eagle3`: the training forward is the serving forward (step 0 against the runtime
head loaded from the saved files; the training-time test's step 1 against a draft node at depth 1),
a short run through the CLI lowers the held-out loss, writes a head the runtime loads in the published
layout and reports an accept length measured through the engine, and an interrupted run resumes
exactly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from helpers import assert_greedy_match

from splitspec import lifeline
from splitspec.demo import demo_model_dirs
from splitspec.runtime.batch import SequenceInput
from splitspec.runtime.kv_cache import BlockTable
from splitspec.runtime.runner import ModelRunner, RuntimeConfig
from splitspec.train.heads import HeadTrainConfig, HeadTrainer
from splitspec.train.text_tokens import load_text_tokens

TARGET = demo_model_dirs()["target"]


@pytest.fixture(scope="module")
def tokens():
    return load_text_tokens(["stdlib"], TARGET)


def trainer(tmp_path, tokens, kind, **overrides) -> HeadTrainer:
    cfg = HeadTrainConfig(kind=kind, **{**dict(steps=4, batch_size=2, seq_len=48, eval_every=2, eval_windows=2,
                                            save_every=2, draft_vocab_size=512, accept_prompts=0), **overrides})
    return HeadTrainer(TARGET, tmp_path / kind, tokens[0][:20000], tokens[1][:5000], cfg)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_the_training_forward_is_the_serving_forward(tmp_path, tokens, kind):
    """Random-initialised heads (made non-trivial) saved and loaded back: step 0 of training gives the runtime
    head's logits on every row; for EAGLE-3 step 1 of the training-time test gives, at row p, the logits of a
    depth-1 draft node (token t[p+2], the head's own output at row p as feature, position p+1) over the
    committed rows 0..p."""
    torch.manual_seed(1)
    tr = trainer(tmp_path, tokens, kind, ttt_steps=2)
    with torch.no_grad():
        for p in tr.head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    tr.out_dir.mkdir(parents=True)
    tr.save()
    head = ModelRunner.load(RuntimeConfig(model_path=str(tr.out_dir), dtype="float32", device="cpu", max_total_tokens=512,
                                          family=kind))
    target = ModelRunner.load(RuntimeConfig(model_path=str(TARGET), dtype="float32", device="cpu", max_total_tokens=512))
    window = tokens[1][:33][None]
    final, aux, _ = tr.target(window)
    t = window.shape[1] - 2
    # the training forward, step by step (the same code the loss runs)
    tr.head.eval()
    embed = tr.head.embed_weight
    positions = torch.arange(t)[None]
    cache: list = []
    layer = tr.head.layers[0]
    with torch.no_grad():
        if kind == "eagle3":
            feature = tr.head.fc(aux[:, :t])
            x0 = tr._layer(layer, torch.cat([layer.input_layernorm(embed[window[:, 1 : t + 1]]), layer.hidden_norm(feature)], -1),
                           feature, positions, cache)
            logits0 = tr.head.lm_head(tr.head.norm(x0))[0]
            tokens1 = window[:, 2 : t + 2]
            x1 = tr._layer(layer, torch.cat([layer.input_layernorm(embed[tokens1]), layer.hidden_norm(x0)], -1), x0,
                           positions + 1, cache)
            logits1 = tr.head.lm_head(tr.head.norm(x1))[0]
            head.model.share_target(target.model.model.embed_tokens.weight)
            features = aux[0, :t]
        else:
            feature = tr.head.fc(torch.cat([embed[window[:, 1 : t + 1]], final[:, :t]], -1))
            x0 = tr._layer(layer, feature, feature, positions, cache)
            logits0 = torch.nn.functional.linear(x0, tr.head.lm_head_weight)[0]
            head.model.share_target(target.model.model.embed_tokens.weight, target.model.lm_head_weight)
            features = final[0, :t]
    table = BlockTable()
    served = head.forward(head.batch([SequenceInput(table, window[0, 1 : t + 1].tolist(), logits="all")]), return_hidden=True,
                          features=features)
    assert torch.allclose(served.logits, logits0, atol=2e-4, rtol=1e-3), (served.logits - logits0).abs().max()
    head.kv_cache.release(table)
    if kind == "eagle3":
        for p in (0, 7, t - 1):
            table = BlockTable()
            head.forward(head.batch([SequenceInput(table, window[0, 1 : p + 2].tolist())]), features=features[: p + 1])
            head.kv_cache.set_length(table, p + 1)
            node = head.forward(head.batch([SequenceInput(table, [int(window[0, p + 2])], [p + 1], None, "all")]),
                                features=x0[0, p : p + 1])
            head.kv_cache.release(table)
            assert torch.allclose(node.logits[0], logits1[p], atol=2e-4, rtol=1e-3), (p, (node.logits[0] - logits1[p]).abs().max())


def test_the_published_layout_is_written(tmp_path, tokens):
    tr = trainer(tmp_path, tokens, "eagle3")
    tr.out_dir.mkdir(parents=True)
    tr.save()
    state = load_file(tr.out_dir / "model.safetensors")
    config = json.loads((tr.out_dir / "config.json").read_text())
    assert config["draft_vocab_size"] == 512 and config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert state["fc.weight"].shape == (384, 3 * 384) and state["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * 384
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool and int(state["t2d"].sum()) == 512
    assert not any(k.startswith("layers.") or "embed_tokens" in k for k in state)
    tr2 = trainer(tmp_path / "e2", tokens, "eagle")
    tr2.out_dir.mkdir(parents=True)
    tr2.save()
    state = load_file(tr2.out_dir / "model.safetensors")
    assert set(state) >= {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.gate_proj.weight"}
    assert "layers.0.input_layernorm.weight" not in state


def test_regenerated_windows_are_the_targets_own_continuations(tmp_path, tokens, monkeypatch):
    """--regenerate: each training window is a prompt cut from the text followed by what the target writes after it
    (greedy, through the serving engine: transformers' own greedy decoding of the checkpoint, past EOS), held-out
    windows too; batches are drawn from them and the draft vocabulary is counted on them; a run resumed in the same
    directory reads the same windows back, and a finished run leaves only the head there."""
    from transformers import AutoModelForCausalLM

    from splitspec.train import regenerate
    from splitspec.train.heads import hot_tokens

    tr = trainer(tmp_path, tokens, "eagle3", regenerate=2, regenerate_prompt_len=16, ttt_steps=2, seq_len=32)
    assert tr.windows.shape == (2, 33) and tr.held_out_windows.shape == (2, 33)
    reference = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    unlike_the_text = 0
    for text, windows in ((tokens[0][:20000], tr.windows), (tokens[1][:5000], tr.held_out_windows)):
        cuts = text.unfold(0, 16, 1)
        for window in windows.tolist():
            prompt, written = window[:16], window[16:]
            at = (cuts == torch.tensor(prompt)).all(1).nonzero().flatten().tolist()
            assert at, "the prompt is not a cut of the text"
            unlike_the_text += all(text[a + 16 : a + 33].tolist() != written for a in at)
            ids = list(prompt)
            with torch.no_grad():
                for _ in range(len(written)):
                    ids.append(int(reference(torch.tensor([ids])).logits[0, -1].argmax()))
            assert_greedy_match(written, ids[16:], reference, prompt, "regenerated window")
    assert unlike_the_text == 4  # what the target writes, not what the text went on with
    batch = tr.batch(5)
    assert all(any(torch.equal(row, w) for w in tr.windows) for row in batch)
    assert torch.equal(tr.hot.cpu(), hot_tokens(tr.windows, 4096, 512))

    def no_generation(*args, **kwargs):
        raise AssertionError("the windows were generated again")

    monkeypatch.setattr(regenerate, "regenerate", no_generation)
    again = trainer(tmp_path, tokens, "eagle3", regenerate=2, regenerate_prompt_len=16, ttt_steps=2, seq_len=32)
    assert torch.equal(again.windows, tr.windows) and torch.equal(again.held_out_windows, tr.held_out_windows)
    report = again.train()
    assert report["regenerated_windows"] == 2 and report["steps"] == 4
    assert sorted(p.name for p in again.out_dir.iterdir()) == ["config.json", "model.safetensors", "training.json"]


def train_cli(kind: str, out, *extra: str) -> list[str]:
    return [sys.executable, "-P", "-m", "splitspec", "train", kind, "--model-path", str(TARGET), "--data", "stdlib",
            "--out", str(out), "--device", "cpu", "--batch-size", "4", "--seq-len", "96", "--eval-windows", "8",
            "--save-dtype", "float32", *extra]


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_a_short_run_learns_and_reports_an_engine_accept_length(tmp_path, kind):
    extra = ["--draft-vocab-size", "1024", "--ttt-steps", "2"] if kind == "eagle3" else []
    result = lifeline.run(train_cli(kind, tmp_path / "head", "--steps", "40", "--eval-every", "20", "--accept-prompts", "4",
                                      "--accept-new-tokens", "24", *extra),
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "head" / "training.json").read_text())
    losses = [h["held_out_loss"] for h in report["history"]]
    assert losses[-1] < losses[0] and report["best_held_out_loss"] == min(losses)
    accept = report["held_out_accept"]
    assert accept["verify_steps"] > 0 and accept["fallbacks"] == 0 and accept["mean_accept_length"] >= 1.0
    print(f"{kind}: held-out loss {losses[0]:.3f} -> {losses[-1]:.3f}, accept length {accept['mean_accept_length']}")
    assert json.loads(result.stdout.strip().splitlines()[-1])["held_out_mean_accept_length"] == accept["mean_accept_length"]
    assert not (tmp_path / "head" / "train_state.pt").exists()


def test_an_interrupted_run_resumes_exactly(tmp_path):
    args = ["--steps", "12", "--eval-every", "6", "--save-every", "4", "--accept-prompts", "0", "--draft-vocab-size", "512",
            "--ttt-steps", "2", "--seed", "3"]
    straight = lifeline.run(train_cli("eagle3", tmp_path / "straight", *args), capture_output=True, text=True, timeout=900)
    assert straight.returncode == 0, straight.stderr[-2000:]
    process = lifeline.spawn(train_cli("eagle3", tmp_path / "resumed", *args), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    state = tmp_path / "resumed" / "train_state.pt"
    deadline = time.time() + 600
    while not state.exists() and process.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert state.exists(), "no checkpoint was written"
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    resumed = lifeline.run(train_cli("eagle3", tmp_path / "resumed", *args), capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0 and "resumed" in resumed.stderr
    a, b = (load_file(tmp_path / d / "model.safetensors") for d in ("straight", "resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
