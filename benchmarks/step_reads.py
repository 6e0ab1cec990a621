"""How many times a decode step reads a tensor back to the host (`.tolist()` / `.item()`: on a GPU, each waits for the
device), with 16 requests asking for logprobs or with a penalty, plain and with NGRAM trees, on this machine's CPU
(the quick preset: a tiny random model). Counted, not timed: the same on any machine. No assertions.

    python -P benchmarks/step_reads.py
    # against another commit's code: PYTHONPATH=$(bash OTHER/scripts/import_tree.sh /tmp/other-tree) python -P benchmarks/step_reads.py
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_host_cost import Setup  # noqa: E402

STEPS = 20
LOADS = (("no logprobs, no penalty", {}), ("logprobs 5", {"logprobs": 5}), ("frequency penalty", {"frequency_penalty": 0.5}))


def main() -> None:
    from splitspec import engine_args
    from splitspec.runtime.sampling_params import SamplingParams
    from splitspec.verifier_svc.engine import Engine
    from splitspec.verifier_svc.step_types import SpecConfig

    setup = Setup(["--preset", "quick", "--device", "cpu", "--speculative-algorithm", "NGRAM", "--num-draft-tokens", "8",
                   "--batch-size", "16", "--prompt-len", "64"], 900)
    reads = collections.Counter()
    tolist, item = torch.Tensor.tolist, torch.Tensor.item

    def counted(read):
        def wrapper(self):
            reads["n"] += 1
            return read(self)
        return wrapper

    for drafter, label in ((setup.drafter, "NGRAM trees of 8"), (None, "plain decoding")):
        for name, extra in LOADS:
            engine = Engine(setup.runner, drafter, setup.spec if drafter else SpecConfig(), set(),
                            engine_args.scheduler_config(setup.args))
            engine.adaptive = None
            for prompt in setup.prompts:
                engine.add_request(prompt, SamplingParams(temperature=0.0, max_new_tokens=200, ignore_eos=True, **extra))
            while any(not r.decoding for r in engine.running):
                engine.step()
            for _ in range(3):
                engine.step()
            torch.Tensor.tolist, torch.Tensor.item = counted(tolist), counted(item)
            reads.clear()
            try:
                for _ in range(STEPS):
                    engine.step()
            finally:
                torch.Tensor.tolist, torch.Tensor.item = tolist, item
            print(f"{label}, 16 requests, {name}: {reads['n'] / STEPS:.1f} tensor reads a step", flush=True)
            for request in list(engine.running):
                engine.abort(request)
    setup.drafter.close()


if __name__ == "__main__":
    main()
