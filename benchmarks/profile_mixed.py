"""Where a mixed step's time goes (a prompt chunk prefilled alongside decoding requests: the step every arrival
costs a busy server), on the demo target: its wall time split into building the batch, planning attention, the
model's layers and the logits, with the GPU's busy time (torch.profiler) beside it, the same step replaying piecewise CUDA graphs
(runtime.piecewise_graph), the Triton kernels against
their torch twins, a decode-only step of the same batch (eager and from its CUDA graph) for scale, and the host's
hottest functions (cProfile) with the piecewise graphs. JSON out, no assertions:

    python benchmarks/profile_mixed.py --decoding 15 --prompt-len 128 --out profile_mixed.json
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch

from splitspec.demo import demo_model_dirs
from splitspec.kernels import ops
from splitspec.runtime.batch import SequenceInput
from splitspec.runtime.kv_cache import BlockTable
from splitspec.runtime.runner import ModelRunner, RuntimeConfig


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=None, help="The target (default: the demo target).")
    parser.add_argument("--decoding", type=int, default=15, help="Requests decoding one token each in the step.")
    parser.add_argument("--prompt-len", type=int, default=128, help="Tokens of the prompt chunk prefilled in the step.")
    parser.add_argument("--steps", type=int, default=30, help="Timed steps per variant.")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None, help="Write the JSON here as well as to stdout.")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    model_path = args.model_path or str(demo_model_dirs()["target"])
    runner = ModelRunner.load(RuntimeConfig(model_path=model_path, device=args.device,
                                            max_total_tokens=(args.decoding + 2) * (args.prompt_len + 8 * args.steps + 64),
                                            piecewise_cuda_graph_max_tokens=512 if cuda else 0))
    decoding = [BlockTable() for _ in range(args.decoding)]
    runner.forward(runner.batch([SequenceInput(t, list(range(3, 3 + args.prompt_len))) for t in decoding]))
    if cuda:
        runner.capture_cuda_graphs()

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def sequences(prefill: BlockTable | None):
        seqs = [SequenceInput(prefill, list(range(5, 5 + args.prompt_len)))] if prefill is not None else []
        return seqs + [SequenceInput(t, [7]) for t in decoding]

    parts = collections.defaultdict(float)

    @torch.inference_mode()
    def step(mixed: bool, graphs: bool = False, split: bool = False, pieces: bool = False):
        prefill = BlockTable() if mixed else None
        saved, saved_pieces = runner.cuda_graph_max_bs, runner.piecewise
        runner.cuda_graph_max_bs = saved if graphs else 0
        runner.piecewise = saved_pieces if pieces else None
        t0 = time.perf_counter()
        batch = runner.batch(sequences(prefill))
        if split:
            sync()
            t1 = time.perf_counter()
            plan = runner.backend.plan(batch.attention)
            sync()
            t2 = time.perf_counter()
            runner.model.rotary_emb.reserve(int(batch.attention.positions.max()) + 1, runner.device)
            hidden, _ = runner.model(batch.input_ids, batch.positions, runner.backend, plan, ())
            sync()
            t3 = time.perf_counter()
            runner.model.logits(hidden[batch.logits_indices])
            sync()
            t4 = time.perf_counter()
            for name, a, b in (("batch", t0, t1), ("plan", t1, t2), ("layers", t2, t3), ("logits", t3, t4)):
                parts[name] += 1000 * (b - a)
        else:
            runner.forward(batch)
        runner.cuda_graph_max_bs, runner.piecewise = saved, saved_pieces
        for t in decoding:
            runner.kv_cache.set_length(t, t.num_tokens + 1)
        if prefill is not None:
            runner.kv_cache.release(prefill)

    def wall(**kw) -> float:
        for _ in range(3):
            step(**kw)
        sync()
        start = time.perf_counter()
        for _ in range(args.steps):
            step(**kw)
        sync()
        return round(1000 * (time.perf_counter() - start) / args.steps, 4)

    report: dict = {
        "benchmark": f"a mixed step on {Path(model_path).name}: one {args.prompt_len}-token prompt "
                     f"chunk + {args.decoding} decoding requests, eagerly and from piecewise CUDA graphs",
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
        "attention_backend": runner.backend.name,
    }
    report["wall_ms"] = {"mixed": wall(mixed=True), "mixed_piecewise_graphs": wall(mixed=True, pieces=True) if cuda else None,
                         "decode_eager": wall(mixed=False),
                         "decode_graph": wall(mixed=False, graphs=True)}
    with ops.twins():
        report["wall_ms"]["mixed_torch_twins"] = wall(mixed=True)
    parts.clear()
    wall(mixed=True, split=True)
    report["mixed_parts_ms"] = {k: round(v / (args.steps + 3), 4) for k, v in parts.items()}
    if cuda:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                step(mixed=True)
            sync()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof_pieces:
            for _ in range(args.steps):
                step(mixed=True, pieces=True)
            sync()
        report["mixed_piecewise_gpu_busy_ms"] = round(sum(e.device_time for e in prof_pieces.events()
                                                          if e.device_type == torch.autograd.DeviceType.CUDA) / 1000 / args.steps, 4)
        kernels = collections.defaultdict(lambda: [0.0, 0])
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                kernels[event.name][0] += event.device_time / 1000
                kernels[event.name][1] += 1
        rows = sorted(({"kernel": n[:120], "ms_per_step": round(ms / args.steps, 4), "calls_per_step": c / args.steps}
                       for n, (ms, c) in kernels.items()), key=lambda r: -r["ms_per_step"])
        report["mixed_gpu_busy_ms"] = round(sum(r["ms_per_step"] for r in rows), 4)
        report["mixed_kernels_per_step"] = sum(r["calls_per_step"] for r in rows)
        report["mixed_kernels"] = rows[:25]
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.steps):
        step(mixed=True, pieces=cuda)
    sync()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(30)
    report["host_tottime_top"] = [line for line in text.getvalue().splitlines() if line.strip()][-32:]
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(40)
    report["host_cumulative_top"] = [line for line in text.getvalue().splitlines() if line.strip()][-42:]
    out = json.dumps(report, indent=2)
    print(out)
    if args.out:
        Path(args.out).write_text(out + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
