"""The speculative flags resolve once, into a frozen Speculation (splitspec.speculation): the rules are functions
of the flags that these tests call directly, and what the verifier, a drafter process and the benches build
takes the result."""

from __future__ import annotations

import dataclasses

import pytest

from splitspec import speculation
from splitspec.cli import load_command
from splitspec.demo import demo_model_dirs
from splitspec.verifier_svc.step_types import SpecConfig


def verifier_flags(*argv: str):
    target = str(demo_model_dirs()["target"])
    return load_command("verifier").build_parser().parse_args(["--device", "cpu", "--model-path", target, *argv])


def drafter_flags(*argv: str):
    target = str(demo_model_dirs()["target"])
    return load_command("drafter").build_parser().parse_args(["--device", "cpu", "--model-path", target, *argv])


def test_no_algorithm_is_no_speculation():
    assert speculation.resolve(verifier_flags()) is None
    assert speculation.spec_config(None) == SpecConfig()
    # none, as `splitspec up` takes it, is the same on the verifier and the bench; a drafter has to draft something
    for spelling in ("none", "None", "NONE"):
        assert verifier_flags("--speculative-algorithm", spelling).speculative_algorithm is None
        assert speculation.resolve(verifier_flags("--speculative-algorithm", spelling)) is None
    assert load_command("bench").build_parser().parse_args(["--speculative-algorithm", "none"]).speculative_algorithm is None
    with pytest.raises(SystemExit):
        drafter_flags("--speculative-algorithm", "none")
    with pytest.raises(SystemExit):
        verifier_flags("--speculative-algorithm", "bogus")


def test_ngram_resolves_without_any_checkpoint():
    s = speculation.resolve(verifier_flags("--speculative-algorithm", "NGRAM", "--speculative-ngram-max-match-window-size", "10"))
    assert (s.kind, s.num_draft_tokens, s.tree, s.topk) == ("ngram", 10, (9, 1, 10), 0)
    assert s.hidden_state_layers == () and s.draft is None and s.draft_model == "" and s.ngram.max_match_window_size == 10
    assert s.num_bets == speculation.NGRAM_BETS and not s.adaptive  # auto: on only where the target runs on a GPU
    assert speculation.spec_config(s) == SpecConfig(num_draft_tokens=10, num_steps=9, topk=0, adaptive=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.num_draft_tokens = 4


def test_a_model_drafter_resolves_its_tree_layers_bets_and_policy_once():
    head = demo_model_dirs(heads=True)["eagle3"]
    flags = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(head), "--speculative-num-steps", "3",
             "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "6", "--speculative-adaptive", "on",
             "--speculative-accept-threshold-single", "0.5"]
    s = speculation.resolve(verifier_flags(*flags))
    assert (s.kind, s.tree, s.num_bets, s.draft_model) == ("eagle3", (3, 2, 6), 4, str(head))
    assert s.hidden_state_layers == (2, 4, 5)  # the demo head's config names the target layers it reads
    config = speculation.spec_config(s)
    assert (config.num_draft_tokens, config.num_steps, config.topk, config.adaptive, config.accept_threshold_single) == \
        (6, 3, 2, True, 0.5)
    # the drafter process's flags (no acceptance rules) resolve to the same tree and layers
    d = speculation.resolve(drafter_flags(*flags[:10]))
    assert (d.tree, d.hidden_state_layers, d.draft.device) == ((3, 2, 6), (2, 4, 5), "cpu")
    # SGLang's automatic tree for a Llama target (all three flags unset) and the chain rule for topk 1
    auto = speculation.resolve(verifier_flags("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(head)))
    assert auto.tree == (5, 4, 8) and auto.num_bets == 6
    chain = speculation.resolve(verifier_flags("--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path",
                                               "org/draft", "--speculative-num-steps", "4", "--speculative-eagle-topk", "1",
                                               "--speculative-num-draft-tokens", "2"))
    assert chain.tree == (4, 1, 5)


def test_a_verifier_with_remote_drafters_needs_no_draft_files(monkeypatch):
    """Resolving names the draft checkpoint; only building a drafter resolves it (a hub download)."""
    seen = []
    monkeypatch.setattr(speculation, "_resolve", lambda path, revision, flag="--model-path": seen.append(path))
    s = speculation.resolve(verifier_flags("--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path",
                                           "org/missing-draft", "--speculative-num-steps", "3", "--speculative-eagle-topk",
                                           "1", "--speculative-num-draft-tokens", "4"))
    assert seen == [] and s.draft_model == "org/missing-draft" and s.checkpoints.draft_model_path == "org/missing-draft"


def test_bad_combinations_are_refused_with_the_fix():
    with pytest.raises(speculation.FlagError, match="STANDALONE needs --speculative-draft-model-path"):
        speculation.resolve(verifier_flags("--speculative-algorithm", "STANDALONE"))
    with pytest.raises(speculation.FlagError, match="--speculative-num-bets -1: must be >= 0"):
        speculation.resolve(verifier_flags("--speculative-algorithm", "NGRAM", "--speculative-num-bets", "-1"))
    with pytest.raises(speculation.FlagError, match="or none of them for the automatic choice"):
        speculation.resolve(verifier_flags("--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "x",
                                           "--speculative-num-steps", "2"))


def test_overlap_and_adaptive_defaults():
    assert speculation.overlap_mode(None, {}) == "auto"
    assert speculation.overlap_mode(None, {"SGLANG_ENABLE_SPEC_V2": "true"}) == "on"
    assert speculation.overlap_mode(None, {"SGLANG_ENABLE_SPEC_V2": "0"}) == "off"
    assert speculation.overlap_mode("off", {"SGLANG_ENABLE_SPEC_V2": "1"}) == "off"  # the flag wins
    assert speculation.adaptive_enabled("auto", "cpu") is False and speculation.adaptive_enabled("auto", "cuda:0") is True
    assert speculation.adaptive_enabled("on", "cpu") is True and speculation.adaptive_enabled("off", "cuda") is False
