"""Where a drafted step's small tensor ops come from: the engine of benchmarks/step_host_cost.py (`drafted`: a fixed
batch of the bench's prompts, every step drafted at BUDGET) run STEPS steps with torch's tensor methods and factory
functions wrapped, each call counted by its call site (the last three frames in the product's code). On a GPU the
captured graphs' own ops never reach Python, so what is counted is each step's work outside them: the copies, the
launches and the host tensors that bound a small batch's step (the fifteenth session's profile counted 38 launches and
19 host-to-device copies a device-fed step, not where from). Counted, not timed. No assertions.

    python -P benchmarks/step_op_sites.py STEPS BUDGET --device cuda --dtype bfloat16 --speculative-algorithm EAGLE3 \
        --speculative-num-steps 5 --speculative-eagle-topk 1 --speculative-num-draft-tokens 6 --batch-size 1 \
        --prompt-len 128
    # the device-fed step: SPLITSPEC_DEVICE_FED=1 python -P benchmarks/step_op_sites.py ...

Prints the calls a step by (op, call site), most first.
"""

from __future__ import annotations

import collections
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import step_host_cost  # noqa: E402  (this folder's: the same engine and prompts)

TENSOR_METHODS = ("copy_", "to", "index_select", "argmax", "cumsum", "__getitem__", "__setitem__", "view", "fill_",
                  "zero_", "sum", "max", "clamp", "gather", "scatter_", "long", "int", "tolist", "item", "add",
                  "__add__", "__sub__", "reshape", "contiguous", "clone")
FACTORIES = ("empty", "tensor", "arange", "frombuffer", "cat", "stack", "zeros", "full", "where")
PRODUCT = ("splitspec", "verifier_svc", "drafter_svc", "kernels")


def site() -> str:
    frames = [f for f in traceback.extract_stack()[:-2] if any(p in f.filename for p in PRODUCT)]
    return " < ".join(f"{'/'.join(f.filename.split('/')[-2:])}:{f.lineno}:{f.name}" for f in reversed(frames[-3:]))


def counted(counts: collections.Counter, owner, names: tuple[str, ...], prefix: str) -> dict:
    """owner's functions `names` wrapped to count their call sites; the originals, to put back."""
    originals = {}
    for name in names:
        original = originals[name] = getattr(owner, name)

        def wrapper(*args, _name=prefix + name, _original=original, **kwargs):
            counts[(_name, site())] += 1
            return _original(*args, **kwargs)

        setattr(owner, name, wrapper)
    return originals


def main(steps: int, budget: int, flags: list[str]) -> None:
    setup = step_host_cost.Setup(flags, steps * 21 + 600)
    room = setup.runner.context_length - max(len(p) for p in setup.prompts) - budget
    engine = setup.engine(budget, min((steps + 10) * min(budget, 20) + 60, room))
    step_host_cost.timed(engine, 20)  # warm: graphs captured, the draft loop's and the catch-up's first launches
    counts: collections.Counter = collections.Counter()
    methods = counted(counts, torch.Tensor, TENSOR_METHODS, "")
    factories = counted(counts, torch, FACTORIES, "torch.")
    try:
        step_host_cost.timed(engine, steps)
    finally:
        for name, original in methods.items():
            setattr(torch.Tensor, name, original)
        for name, original in factories.items():
            setattr(torch, name, original)
    print(f"{sum(counts.values()) / steps:.1f} counted calls a step over {steps} steps")
    for (name, where), n in counts.most_common(80):
        print(f"{n / steps:6.2f}  {name:16s} {where}")


if __name__ == "__main__":
    if len(sys.argv) < 4:
        raise SystemExit(__doc__)
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
