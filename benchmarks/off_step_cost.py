"""What a speculating request's drafting-off step costs against an opted-out plain step, in process: the same
engine and batch, budget forced to 1 (speculate=True: feeds and captured states as the policy's off-runs have them)
or every request opted out (speculate=False); three rounds each, interleaved, the third under cProfile, then the
functions by the difference in own and cumulative time per step. No assertions.

    python -P benchmarks/off_step_cost.py STEPS --device cuda --dtype bfloat16 --speculative-algorithm EAGLE3 \
        --batch-size 16 --prompt-len 128
"""

import cProfile, pstats, sys, time, statistics

from splitspec import model_flags, speculation, engine_args
from splitspec.bench import build_parser
from splitspec.cli import _demo_target
from splitspec.default_model import set_provider
from splitspec.bench_in_process import _resolve_models
from splitspec.bench_measure import make_prompts
from splitspec.runtime.runner import ModelRunner
from splitspec.runtime.sampling_params import SamplingParams
from splitspec.verifier_svc.engine import Engine
import torch

set_provider(_demo_target)
steps = int(sys.argv[1])
rest = sys.argv[2:]
bench_args = build_parser().parse_args(rest)
_resolve_models(bench_args)
model_dir = model_flags.resolve_model(bench_args)
batch = int(bench_args.batch_size)
if bench_args.cuda_graph_max_bs is None and not bench_args.disable_cuda_graph:
    bench_args.cuda_graph_max_bs = batch
runner = ModelRunner.load(
    model_flags.runtime_config(bench_args, model_dir, default_max_total_tokens=batch * (steps * 2 + 900))
)
settings = speculation.resolve(bench_args, runner.config)
prompts = make_prompts(bench_args, None if bench_args.preset else model_dir, runner.config.vocab_size, batch)
drafter, spec = engine_args.in_process_drafter(
    settings, max_total_tokens=runner.kv_cache.num_pages * runner.kv_cache.page_size, target=runner
)
spec = speculation.spec_config(settings)
overlap = runner.device.type == "cuda"
if overlap:
    runner.capture_cuda_graphs(tree_nodes=(spec.num_draft_tokens,))


def run(speculate, prof):
    engine = Engine(runner, drafter, spec, set(), engine_args.scheduler_config(bench_args), overlap_schedule=overlap)
    engine.adaptive = None
    engine._choose_budget = lambda continuing=False: 1
    params = SamplingParams(temperature=0.0, max_new_tokens=steps + 50, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params, speculate=speculate)
    while any(not r.decoding for r in engine.running) or engine.waiting:
        engine.step()
    for _ in range(10):
        engine.step()
    if overlap:
        torch.cuda.synchronize()
    times = []
    if prof:
        prof.enable()
    t0 = time.perf_counter()
    for _ in range(steps):
        b = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - b)
    if overlap:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    if prof:
        prof.disable()
    for r in list(engine.running):
        engine.abort(r)
    return wall, times


stats = {}
for rep in range(3):
    for speculate in (True, False):
        prof = cProfile.Profile() if rep == 2 else None
        wall, times = run(speculate, prof)
        print(
            f"speculate={speculate}: {steps} steps {wall * 1e3 / steps:.3f} ms/step wall, median {statistics.median(times) * 1e3:.3f}",
            flush=True,
        )
        if rep == 2:
            stats[speculate] = pstats.Stats(prof).stats
drafter.close()
a, b = stats[True], stats[False]
rows = []
for k, v in a.items():
    w = b.get(k, (0, 0, 0, 0, None))
    rows.append((v[2] - w[2], v[3] - w[3], v[1], w[1], "/".join(k[0].split("/")[-2:]) + f":{k[1]}({k[2]})"))
print("speculating-off minus opted-out, ms/step: tottime, cumtime; calls/step each")
for r in sorted(rows, key=lambda r: -r[0])[:30]:
    print(f"{r[0] / steps * 1e3:8.4f} {r[1] / steps * 1e3:8.4f} {r[2] / steps:7.1f} {r[3] / steps:7.1f} {r[4]}")
print("by cumtime difference")
for r in sorted(rows, key=lambda r: -r[1])[:30]:
    print(f"{r[0] / steps * 1e3:8.4f} {r[1] / steps * 1e3:8.4f} {r[2] / steps:7.1f} {r[3] / steps:7.1f} {r[4]}")
