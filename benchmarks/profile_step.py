"""Where a decode step's GPU time goes: CUDA kernel time per kernel name over --steps eager decode steps
of a dummy --preset model (torch.profiler), and the step's wall time with CUDA graphs for comparison.
JSON out, no assertions:

    python benchmarks/profile_step.py --preset llama-3.1-8b --out benchmarks/results/profile_8b_h100.json

kernel_ms_per_step sums the kernels' own durations: the GPU's busy time. A graph replay's wall time
above it is time the GPU idles between kernels (launch gaps); the eager wall time above it is host work.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch

from splitspec.model_shapes import dummy_model_dir
from splitspec.runtime.batch import SequenceInput
from splitspec.runtime.kv_cache import BlockTable
from splitspec.runtime.runner import ModelRunner, RuntimeConfig


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-3.1-8b", help="benchmarks/decode.py preset shape.")
    parser.add_argument("--batch-size", type=int, default=1, help="Requests decoding together.")
    parser.add_argument("--prompt-len", type=int, default=128, help="Tokens in each request's cache.")
    parser.add_argument("--steps", type=int, default=20, help="Profiled steps.")
    parser.add_argument("--out", default=None, help="Write the JSON here as well as to stdout.")
    args = parser.parse_args()
    runner = ModelRunner.load(RuntimeConfig(model_path=str(dummy_model_dir(args.preset)), load_format="dummy", dtype="bfloat16", device="cuda",
                                            max_total_tokens=args.batch_size * (args.prompt_len + 4 * args.steps + 64)))
    tables = [BlockTable() for _ in range(args.batch_size)]
    runner.forward(runner.batch([SequenceInput(t, list(range(3, 3 + args.prompt_len))) for t in tables]))
    for t in tables:
        runner.kv_cache.set_length(t, args.prompt_len)

    def step(graphs: bool):
        saved = runner.cuda_graph_max_bs
        runner.cuda_graph_max_bs = saved if graphs else 0
        out = runner.forward(runner.batch([SequenceInput(t, [7]) for t in tables]))
        runner.cuda_graph_max_bs = saved
        for t in tables:
            runner.kv_cache.set_length(t, t.num_tokens + 1)
        return out

    def wall(graphs: bool) -> float:
        for _ in range(5):
            step(graphs)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.steps):
            step(graphs)
        torch.cuda.synchronize()
        return 1000 * (time.perf_counter() - start) / args.steps

    runner.capture_cuda_graphs()
    graph_ms, eager_ms = wall(True), wall(False)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step(False)
        torch.cuda.synchronize()
    kernels = collections.defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name][0] += event.device_time / 1000  # us -> ms
            kernels[event.name][1] += 1
    rows = sorted(({"kernel": name[:160], "ms_per_step": round(ms / args.steps, 4), "calls_per_step": n / args.steps}
                   for name, (ms, n) in kernels.items()), key=lambda r: -r["ms_per_step"])
    report = {
        "benchmark": f"decode step of a dummy {args.preset} in bf16, batch {args.batch_size}, {args.prompt_len} cached tokens",
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "attention_backend": runner.backend.name,
        "wall_ms_per_step": {"cuda_graph": round(graph_ms, 4), "eager": round(eager_ms, 4)},
        "kernel_ms_per_step": round(sum(r["ms_per_step"] for r in rows), 4),
        "kernels_per_step": sum(r["calls_per_step"] for r in rows),
        "kernels": rows[:40],
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
