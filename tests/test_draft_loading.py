"""Model drafters from the flags, end to end: EAGLE3 through real processes keeps greedy output with drafts
accepted; SGLang's draft-loading flags are honoured (load format, revision, quantization, MoE
backends, the EAGLE3 token map); and a draft that does not fit its target fails at start with a message
naming the problem (vocabulary, tokenizer, d2t)."""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys

import pytest
import torch
from draft_training import train_eagle3_head
from test_eagle3_head import write_head
from test_mtp import EAGLE3_FLOOR, split_lossless

from splitspec import lifeline
from splitspec import engine_args
from splitspec.demo import demo_model_dirs
from splitspec.draft_models import build_drafter
from splitspec.speculation import resolve
from splitspec.runtime.config import ConfigError
from splitspec.runtime.loader import CheckpointError


@pytest.fixture(scope="module")
def trained_eagle3(tmp_path_factory):
    return train_eagle3_head(tmp_path_factory.mktemp("eagle3") / "head")


def test_eagle3_over_tcp_is_lossless_and_speculates(trained_eagle3):
    """The verifier captures the inputs of target layers 2, 4, 5 and ships them (3 x 384 wide) to a
    `splitspec drafter` EAGLE3 process; its drafts over a 1024-id draft vocabulary map back through d2t."""
    split_lossless(demo_model_dirs()["target"], ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
                                                 str(trained_eagle3), "--speculative-num-steps", "3",
                                                 "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "6"],
                   "eagle3", min_accept_length=EAGLE3_FLOOR)


def flags(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    engine_args.add_speculative_args(parser, side="drafter")
    for flag, default in (("--model-path", None), ("--dtype", "float32"), ("--device", "cpu"), ("--page-size", 16),
                          ("--max-total-tokens", 1024), ("--attention-backend", "torch")):
        parser.add_argument(flag, default=default, type=type(default) if default is not None else None)
    return parser.parse_args(list(argv))


def eagle3_flags(head, *extra: str) -> argparse.Namespace:
    return flags("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(head),
                 "--model-path", str(demo_model_dirs()["target"]), *extra)


def demo_shaped_head(tmp_path, edit=None, config_edit=None, fmt="bin"):
    """A random EAGLE-3 head shaped for the demo target (hidden 384, vocab 4096), draft vocab 512."""
    import test_eagle3_head as th

    target = json.loads((demo_model_dirs()["target"] / "config.json").read_text())
    saved = (th.H, th.HEADS, th.KV_HEADS, th.VOCAB)
    th.H, th.HEADS, th.KV_HEADS, th.VOCAB = (target["hidden_size"], target["num_attention_heads"],
                                             target["num_key_value_heads"], target["vocab_size"])
    try:
        config, state = th.head_config(draft_vocab=512), th.head_state(seed=2, draft_vocab=512)
    finally:
        th.H, th.HEADS, th.KV_HEADS, th.VOCAB = saved
    config["head_dim"] = target["head_dim"]
    if edit:
        edit(state)
    if config_edit:
        config_edit(config)
    return write_head(tmp_path / "head", config, state, fmt)


def test_eagle3_ignores_the_token_map_with_a_warning(tmp_path, caplog):
    head = demo_shaped_head(tmp_path)
    token_map = tmp_path / "map.pt"
    torch.save(list(range(100)), token_map)
    with caplog.at_level(logging.WARNING):
        drafter = build_drafter(resolve(eagle3_flags(head, "--speculative-token-map", str(token_map))))
    assert f"--speculative-token-map {token_map} ignored: an EAGLE-3 head maps its own draft vocabulary (d2t)" in caplog.text
    assert len(drafter.token_map) == 512 and drafter.hidden_state_layers == (2, 4, 5) and drafter.name == "EAGLE3"


def test_a_draft_with_a_shorter_context_than_its_target_is_sized_for_the_targets(tmp_path):
    """EAGLE heads often name a context of 2048 whatever their target's. A draft follows its target's sequences, so its
    CUDA graphs (the RoPE cache they read, their page tables) are made for the target's context (2048 for the demo)."""
    head = demo_shaped_head(tmp_path, config_edit=lambda config: config.update(max_position_embeddings=512))
    drafter = build_drafter(resolve(eagle3_flags(head)))
    assert drafter.runner.config.max_position_embeddings == 512 and drafter.runner.context_length == 2048


def test_draft_load_format_and_revision(tmp_path, caplog):
    head = demo_shaped_head(tmp_path)  # pytorch_model.bin only
    assert build_drafter(resolve(eagle3_flags(head, "--speculative-draft-load-format", "pt"))).runner.config.hidden_size == 384
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors weights found \(found: config\.json, pytorch_model\.bin\)"):
        build_drafter(resolve(eagle3_flags(head, "--speculative-draft-load-format", "safetensors")))
    safetensors_head = demo_shaped_head(tmp_path / "st", fmt="safetensors")
    with pytest.raises(CheckpointError, match=r"--load-format pt needs pytorch_model\.bin \(or its index\), none found"):
        build_drafter(resolve(eagle3_flags(safetensors_head, "--speculative-draft-load-format", "pt")))
    dummy = build_drafter(resolve(eagle3_flags(head, "--speculative-draft-load-format", "dummy")))  # random weights, identity d2t
    assert torch.equal(dummy.token_map, torch.arange(512))
    with caplog.at_level(logging.INFO):
        build_drafter(resolve(eagle3_flags(head, "--speculative-moe-runner-backend", "triton", "--speculative-moe-a2a-backend", "deepep",
                                   "--speculative-draft-model-quantization", "unquant")))
    assert "--speculative-moe-runner-backend triton: the draft has no MoE layers, nothing to do" in caplog.text
    assert "--speculative-moe-a2a-backend deepep: the draft has no MoE layers, nothing to do" in caplog.text
    from splitspec.runtime.fp8 import Fp8Linear  # fp8: the head's linear layers quantized (tests/test_fp8.py)

    assert isinstance(build_drafter(resolve(eagle3_flags(head, "--speculative-draft-model-quantization", "fp8"))).runner.model.fc, Fp8Linear)
    with pytest.raises(SystemExit):
        eagle3_flags(head, "--speculative-moe-runner-backend", "nonsense")


def test_a_hub_draft_defaults_to_revision_main(tmp_path, monkeypatch):
    """A hub id as the draft path resolves at revision main unless one is given (SGLang's default)."""
    from splitspec import speculation

    seen = []
    monkeypatch.setattr(speculation, "_resolve", lambda path, revision, flag: seen.append((path, revision)) or tmp_path)
    for extra in ((), ("--speculative-draft-model-revision", "v2")):
        args = flags("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "org/head", *extra)
        speculation.checkpoints_of(args).draft_dir()
    assert seen == [("org/head", "main"), ("org/head", "v2")]


def test_a_draft_vocabulary_that_is_not_the_targets_is_refused(tmp_path):
    head = demo_shaped_head(tmp_path, config_edit=lambda c: c.update(vocab_size=4000),
                            edit=lambda s: s.update(t2d=torch.zeros(4000, dtype=torch.bool)))
    with pytest.raises(ConfigError, match=rf"the draft's vocabulary \(4000 tokens, vocab_size in {head}/config\.json\) does not "
                                          r"match the target's \(4096\); a draft must use the target's tokenizer"):
        build_drafter(resolve(eagle3_flags(head)))


def test_a_standalone_draft_with_another_tokenizer_is_refused(tmp_path):
    """Same vocabulary size, different tokens: the ids would mean different things."""
    draft = tmp_path / "draft"
    shutil.copytree(demo_model_dirs()["draft"], draft)
    tokenizer = json.loads((draft / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[300:302]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (draft / "tokenizer.json").write_text(json.dumps(tokenizer))
    args = flags("--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", str(draft),
                 "--model-path", str(demo_model_dirs()["target"]))
    with pytest.raises(ConfigError, match=rf"the draft's tokenizer \({draft}/tokenizer\.json\) does not match the target's "
                                          r"\(.*/tokenizer\.json\): 2 tokens differ, e\.g\. .* is id \d+ in the draft and \d+ in the target"):
        build_drafter(resolve(args))


def test_d2t_out_of_range_or_repeated_is_refused(tmp_path):
    def out_of_range(state):
        state["d2t"][7] = 5000

    head = demo_shaped_head(tmp_path / "a", edit=out_of_range)
    with pytest.raises(CheckpointError, match=rf"{head}: d2t maps draft id 7 to target id \d+, outside the target's vocabulary "
                                              r"of 4096 \(1 draft ids out of range\)"):
        build_drafter(resolve(eagle3_flags(head)))

    def repeated(state):
        used = state["d2t"] + torch.arange(512)
        state["d2t"][9] = used[8] - 9  # draft ids 8 and 9 -> the same target id

    head = demo_shaped_head(tmp_path / "b", edit=repeated)
    with pytest.raises(CheckpointError, match=r"d2t maps draft ids 8 and 9 to the same target id \d+"):
        build_drafter(resolve(eagle3_flags(head)))


def test_cli_names_the_problem_without_a_traceback(tmp_path):
    head = demo_shaped_head(tmp_path, edit=lambda s: s.pop("norm.weight"))
    result = lifeline.run([sys.executable, "-P", "-m", "splitspec", "drafter", "--speculative-algorithm", "EAGLE3",
                             "--speculative-draft-model-path", str(head), "--dtype", "float32", "--device", "cpu",
                             "--model-path", str(demo_model_dirs()["target"])],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "missing tensors: norm.weight" in result.stderr and "Traceback" not in result.stderr
    result = lifeline.run([sys.executable, "-P", "-m", "splitspec", "generate", "--prompt", "x", "--speculative-algorithm",
                             "NEXTN", "--max-new-tokens", "2"], capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "LlamaForCausalLM declares no MTP layers" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("algorithm", ["EAGLE3", "NEXTN-multi"])
def test_generate_in_one_process(algorithm, trained_eagle3, tmp_path_factory):
    """`splitspec generate --json` with the drafter in the verifier's process: the same ids as plain, drafts
    accepted, no fallback (EAGLE3 captures layers in-process; multi-layer MTP from a MiMo target)."""
    from draft_training import train_mimo_target

    if algorithm == "EAGLE3":
        model, spec = demo_model_dirs()["target"], ["--speculative-algorithm", "EAGLE3",
                                                    "--speculative-draft-model-path", str(trained_eagle3)]
    else:
        model = train_mimo_target(tmp_path_factory.mktemp("mimo") / "multi", num_layers=2, prenorm=True)
        spec = ["--speculative-algorithm", "NEXTN", "--enable-multi-layer-eagle"]
    base = [sys.executable, "-P", "-m", "splitspec", "generate", "--model-path", str(model), "--dtype", "float32",
            "--device", "cpu", "--prompt", "def read_lines(filename):\n", "--max-new-tokens", "40", "--ignore-eos", "--json"]
    plain = lifeline.run(base, capture_output=True, text=True, timeout=600)
    spec_run = lifeline.run(base + spec, capture_output=True, text=True, timeout=600)
    assert plain.returncode == 0 and spec_run.returncode == 0, spec_run.stderr
    plain_row, spec_row = json.loads(plain.stdout), json.loads(spec_run.stdout)
    from helpers import assert_greedy_match, hf_model

    prompt = plain_row["prompt_ids"]
    assert_greedy_match(spec_row["output_ids"], plain_row["output_ids"], hf_model(demo_model_dirs()["target"]), prompt,
                        f"generate {algorithm}")
    report = spec_row["speculative"]
    assert report["accepted_tokens"] > 0 and report["draft_tokens"] > 0 and report["fallbacks"] == 0, report


def test_an_eagle3_head_for_another_target_width_is_refused(tmp_path):
    """target_hidden_size says what fc expects; a head trained on a wider target cannot read these states."""
    def wider(config):
        config["target_hidden_size"] = 512

    head = demo_shaped_head(tmp_path, config_edit=wider, edit=lambda s: s.update({"fc.weight": torch.zeros(384, 1536)}))
    with pytest.raises(ConfigError, match=rf"{head}: the EAGLE-3 head's fc takes 1536 features, the target sends 1152 "
                                          r"\(3 captured layers \[2, 4, 5\] x hidden size 384\)"):
        build_drafter(resolve(eagle3_flags(head)))


def test_eagle3_head_without_its_own_lm_head_uses_the_targets(tmp_path):
    """No draft_vocab_size and no lm_head in the checkpoint: the target's head is used (as SGLang does)."""
    def drop(state):
        state.pop("lm_head.weight"), state.pop("d2t"), state.pop("t2d")

    head = demo_shaped_head(tmp_path, edit=drop, config_edit=lambda c: c.pop("draft_vocab_size"))
    drafter = build_drafter(resolve(eagle3_flags(head)))
    target_head = torch.load(head / "pytorch_model.bin")  # nothing of the target's in it
    assert "lm_head.weight" not in target_head and drafter.token_map is None
    from splitspec.runtime.loader import read_embed_and_head

    _, want = read_embed_and_head(demo_model_dirs()["target"], torch.float32, torch.device("cpu"))
    assert torch.equal(drafter.runner.model.lm_head.weight, want)


def test_drafter_process_needs_the_targets_path(tmp_path):
    result = lifeline.run([sys.executable, "-P", "-m", "splitspec", "drafter", "--speculative-algorithm", "NEXTN"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "--speculative-algorithm EAGLE needs the target's --model-path" in result.stderr
    result = lifeline.run([sys.executable, "-P", "-m", "splitspec", "drafter", "--speculative-algorithm", "EAGLE3",
                             "--model-path", str(demo_model_dirs()["target"]), "--speculative-draft-model-path",
                             str(tmp_path / "nothing-here")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"--speculative-draft-model-path '{tmp_path / 'nothing-here'}': no such directory" in result.stderr


def test_a_draft_beside_its_target_mirrors_the_targets_cache_within_the_memory_left():
    """A model drafter in the verifier's process (up --drafters 0) on a GPU, no --max-total-tokens: its cache holds as
    many tokens as the target's when they fit in what the target's --mem-fraction-static left less half the headroom;
    fewer when they do not (a warning); too little memory is a ConfigError naming the flags (it was the same
    fraction-of-total rule as the target's, which left nothing once the target had taken its share)."""
    from splitspec.runtime.runner import tokens_beside_target

    gib = 2**30
    # an 8B target with an EAGLE-3 head on a 140 GiB card: 861k tokens of 4 KiB are 3.3 GiB of the 21 GiB left
    assert tokens_beside_target(861_472, free=21 * gib, total=140 * gib, fraction=0.85, per_token=4096) == 861_472
    # 21 GiB free less 10.5 kept: 10.5 GiB / 32 KiB per token (a standalone draft of 16 layers)
    assert 344_060 <= tokens_beside_target(861_472, free=21 * gib, total=140 * gib, fraction=0.85, per_token=32768) <= 344_064
    with pytest.raises(ConfigError, match="lower --mem-fraction-static or set --max-total-tokens"):
        tokens_beside_target(861_472, free=10 * gib, total=140 * gib, fraction=0.85, per_token=4096)
