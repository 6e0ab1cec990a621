"""FR-Spec token maps (REFERENCES §6): the published file format loads, bad maps are refused by name,
drafts only ever use the listed ids (STANDALONE and EAGLE), and output does not change."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from splitspec import lifeline
from splitspec.demo import demo_model_dirs
from splitspec.drafter_svc.eagle import EagleDrafter
from splitspec.drafter_svc.standalone import StandaloneDrafter
from splitspec.runtime.runner import ModelRunner, RuntimeConfig
from splitspec.runtime.token_map import TokenMapError, load_token_map

PROMPT = "import os\nimport sys\n\n\ndef main(argv=None):\n    parser = argparse.ArgumentParser("


def test_the_published_format_loads_and_bad_maps_are_refused(tmp_path):
    torch.save([5, 3, 9, 1], tmp_path / "freq.pt")  # FR-Spec: a Python list, most frequent first
    assert load_token_map(str(tmp_path / "freq.pt"), 10).tolist() == [5, 3, 9, 1]
    torch.save(torch.tensor([2, 4], dtype=torch.int32), tmp_path / "tensor.pt")
    assert load_token_map(str(tmp_path / "tensor.pt"), 10).dtype == torch.int64
    cases = {"oov.pt": ([1, 12], "outside the target's vocabulary"), "dup.pt": ([1, 1], "twice"),
             "empty.pt": ([], "empty"), "float.pt": (torch.tensor([1.0, 2.0]), "integer")}
    for name, (data, message) in cases.items():
        torch.save(data, tmp_path / name)
        with pytest.raises(TokenMapError, match=message):
            load_token_map(str(tmp_path / name), 10)
    with pytest.raises(FileNotFoundError, match="<org>/<repo>/<file>"):
        load_token_map(str(tmp_path / "missing.pt"), 10)


def hot_ids(vocab: int, keep: int = 600) -> torch.Tensor:
    """The first `keep` ids of a random order: about 15% of the demo vocabulary."""
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[:keep]


def test_standalone_drafts_only_listed_ids(tmp_path):
    from transformers import AutoTokenizer

    dirs = demo_model_dirs()
    tokenizer = AutoTokenizer.from_pretrained(dirs["target"])
    prompt = tokenizer.encode(PROMPT)
    draft = ModelRunner.load(RuntimeConfig(model_path=str(dirs["draft"]), dtype="float32", device="cpu", max_total_tokens=2048))
    hot = hot_ids(draft.config.vocab_size)
    draft.model.set_hot_tokens(hot)
    drafter = StandaloneDrafter(draft, topk=4, num_steps=3, num_draft_tokens=12, token_map=hot)
    drafter.open("r", prompt)
    tree = drafter.draft(["r"], [12])[0]
    assert tree.num_nodes == 12 and set(tree.tokens[1:]) <= set(hot.tolist())


def test_eagle_drafts_only_listed_ids(tmp_path):
    from test_eagle import eagle_head_dir

    target = ModelRunner.load(RuntimeConfig(model_path=str(demo_model_dirs()["target"]), dtype="float32", device="cpu",
                                            max_total_tokens=1024))
    head = ModelRunner.load(RuntimeConfig(model_path=eagle_head_dir(tmp_path), dtype="float32", device="cpu",
                                          max_total_tokens=1024, family="eagle"))
    hot = hot_ids(target.config.vocab_size)
    head.model.share_target(target.model.model.embed_tokens.weight, target.model.lm_head_weight[hot])
    drafter = EagleDrafter(head, topk=4, num_steps=3, num_draft_tokens=12, token_map=hot)
    drafter.open("r", [13])
    drafter.extend("r", [290, 350, 13], torch.randn(3, target.config.hidden_size))
    tree = drafter.draft(["r"], [12])[0]
    assert tree.num_nodes == 12 and tree.tokens[0] == 13 and set(tree.tokens[1:]) <= set(hot.tolist())


def test_generate_with_a_token_map_keeps_output_and_speculates(tmp_path):
    """The flag end to end: STANDALONE with a map of the tokens this code uses most, output unchanged."""
    from transformers import AutoTokenizer

    dirs = demo_model_dirs()
    tokenizer = AutoTokenizer.from_pretrained(dirs["target"])
    base = [sys.executable, "-P", "-m", "splitspec", "generate", "--prompt", PROMPT, "--max-new-tokens", "40",
            "--ignore-eos", "--json", "--log-level", "warning"]
    plain = lifeline.run(base, capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0, plain.stderr
    plain_ids = json.loads(plain.stdout)["output_ids"]
    frequent = sorted(set(tokenizer.encode(PROMPT) + plain_ids)) + list(range(0, 4096, 16))
    torch.save(list(dict.fromkeys(frequent)), tmp_path / "freq.pt")
    spec = lifeline.run(base + ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", str(dirs["draft"]),
                                  "--speculative-token-map", str(tmp_path / "freq.pt")], capture_output=True, text=True, timeout=300)
    assert spec.returncode == 0, spec.stderr
    row = json.loads(spec.stdout)
    assert row["output_ids"] == plain_ids
    assert row["speculative"]["accepted_tokens"] > 0 and row["speculative"]["fallbacks"] == 0
    torch.save([1, 99999], tmp_path / "bad.pt")
    bad = lifeline.run(base + ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", str(dirs["draft"]),
                                 "--speculative-token-map", str(tmp_path / "bad.pt")], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "outside the target's vocabulary" in bad.stderr
