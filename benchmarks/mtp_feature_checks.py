"""How much the MTP drafter's acceptance depends on what the verifier hands it; JSON out, no assertions.

    python benchmarks/mtp_feature_checks.py --out benchmarks/results/mtp_feature_checks_cpu.json

With the MiMo-layout demo targets the tests build (tests/draft_training.py: MTP layers trained here on the
demo target's greedy continuations), greedy, the first 8 code prompts, 24 new tokens, batch 8, in one
process on the CPU:
- readings: layers trained on the final normed state or on the state before the final norm, each fed
  either (SGLang's EAGLE worker hands NEXTN the normed state, its multi-layer worker the pre-norm one);
- alignment: NEXTN as built, and with every token paired with the state one position too early (an
  off-by-one), which is what the tests' accept-length floors are there to catch.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from draft_training import train_mimo_target  # noqa: E402
from test_speculative import PROMPTS, run  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from splitspec.demo import demo_model_dirs  # noqa: E402
from splitspec.drafter_svc.eagle import EagleDrafter  # noqa: E402
from splitspec.drafter_svc.multi_layer_mtp import MultiLayerMtpDrafter  # noqa: E402
from splitspec.runtime.runner import ModelRunner, RuntimeConfig  # noqa: E402
from splitspec.runtime.sampling_params import SamplingParams  # noqa: E402
from splitspec.verifier_svc.drafter_client import InProcessDrafterClient  # noqa: E402
from splitspec.verifier_svc.engine import SpecConfig  # noqa: E402


class OffByOne(EagleDrafter):
    """Pairs token t[p+1] with h[p-1] instead of h[p]."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.previous: dict[str, torch.Tensor] = {}

    def extend(self, request_id, tokens, hidden=None):
        last = self.previous.get(request_id, torch.zeros_like(hidden[:1]))
        self.previous[request_id] = hidden[-1:].clone()
        super().extend(request_id, tokens, torch.cat([last, hidden[:-1]]))


def accept_length(path: Path, make_drafter, num_draft_tokens: int, prenorm_feed: bool) -> float:
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dirs()["target"])
    prompts = [tokenizer.encode(p) for p in PROMPTS[:8]]
    params = [SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)] * 8
    target = ModelRunner.load(RuntimeConfig(model_path=str(path), dtype="float32", device="cpu", max_total_tokens=8192))
    head = ModelRunner.load(RuntimeConfig(model_path=str(path), dtype="float32", device="cpu", max_total_tokens=8192,
                                          family="mtp"))
    head.model.share_target(target.model.model.embed_tokens.weight, target.model.lm_head_weight)
    if prenorm_feed:
        target.set_capture_layers((target.config.num_hidden_layers,))
    out = run(target, prompts, params, InProcessDrafterClient(make_drafter(head)), SpecConfig(num_draft_tokens=num_draft_tokens))
    return round(1 + sum(o.stats.accepted_tokens for o in out) / sum(o.stats.verify_steps for o in out), 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp())
    nextn = train_mimo_target(tmp / "nextn", num_layers=1)
    multi = train_mimo_target(tmp / "multi", num_layers=2, prenorm=True)

    def tree(head):
        return EagleDrafter(head, topk=2, num_steps=3, num_draft_tokens=6)

    def chain(head):
        return MultiLayerMtpDrafter(head, 2)

    results = {
        "nextn_1_layer_trained_on_normed": {"fed_normed": accept_length(nextn, tree, 6, False),
                                            "fed_prenorm": accept_length(nextn, tree, 6, True)},
        "multi_2_layers_trained_on_prenorm": {"fed_prenorm": accept_length(multi, chain, 3, True),
                                              "fed_normed": accept_length(multi, chain, 3, False)},
        "nextn_off_by_one_pairing": accept_length(
            nextn, lambda head: OffByOne(head, topk=2, num_steps=3, num_draft_tokens=6), 6, False),
    }
    report = {"command": "python benchmarks/mtp_feature_checks.py --out " + str(args.out), "machine": platform.processor()
              or platform.machine(), "torch": torch.__version__, "shapes": {"nextn": "3 steps, top-2, 6 nodes",
                                                                          "multi": "2 steps, chain of 3"},
              "accept_length": results}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
