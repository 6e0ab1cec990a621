"""Host work of drafted steps at a fixed budget, in process: the engine on a fixed batch, every step drafted at
BUDGET, timed unprofiled and then under cProfile (ms per step by function: own time, cumulative, calls). No
assertions.

    python -P benchmarks/drafted_host_profile.py STEPS BUDGET --device cuda --dtype bfloat16 \
        --speculative-algorithm EAGLE3 --speculative-num-steps 5 --speculative-eagle-topk 1 \
        --speculative-num-draft-tokens 6 --batch-size 16 --prompt-len 128
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
budget = int(sys.argv[2])
rest = sys.argv[3:]
bench_args = build_parser().parse_args(rest)
_resolve_models(bench_args)
model_dir = model_flags.resolve_model(bench_args)
batch = int(bench_args.batch_size)
if bench_args.cuda_graph_max_bs is None and not bench_args.disable_cuda_graph:
    bench_args.cuda_graph_max_bs = batch
runner = ModelRunner.load(
    model_flags.runtime_config(bench_args, model_dir, default_max_total_tokens=batch * (steps * 16 + 600))
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
engine = Engine(runner, drafter, spec, set(), engine_args.scheduler_config(bench_args), overlap_schedule=overlap)
engine.adaptive = None
engine._choose_budget = lambda continuing=False: budget
params = SamplingParams(temperature=0.0, max_new_tokens=steps * 15 + 60, ignore_eos=True)
for p in prompts:
    engine.add_request(p, params)
while any(not r.decoding for r in engine.running) or engine.waiting:
    engine.step()
for _ in range(10):
    engine.step()


def sync():
    if overlap:
        torch.cuda.synchronize()


sync()
plain_t = []
toks = 0
for _ in range(steps):
    b = time.perf_counter()
    ev = engine.step()
    plain_t.append(time.perf_counter() - b)
    toks += sum(len(e.new_token_ids) for e in ev)
sync()
print(
    f"unprofiled: median step {statistics.median(plain_t) * 1e3:.3f} ms, mean {statistics.mean(plain_t) * 1e3:.3f}, {toks / steps / batch:.2f} tokens/request/step"
)
prof = cProfile.Profile()
times = []
toks = 0
prof.enable()
for _ in range(steps):
    b = time.perf_counter()
    ev = engine.step()
    times.append(time.perf_counter() - b)
    toks += sum(len(e.new_token_ids) for e in ev)
prof.disable()
print(
    f"budget {budget} batch {batch}: median step {statistics.median(times) * 1e3:.2f} ms, {toks / steps / batch:.2f} tokens/request/step"
)
st = pstats.Stats(prof)
tot_torch = 0
rows = []
for k, v in st.stats.items():
    name = f"{'/'.join(k[0].split('/')[-2:])}:{k[1]}({k[2]})"
    if k[0] == "~" or "torch" in k[0]:
        tot_torch += v[2]
    rows.append((v[2], v[3], v[1], name, k[0]))
total = sum(r[0] for r in rows)
print(f"total profiled {total / steps * 1e3:.2f} ms/step; torch+builtins {tot_torch / steps * 1e3:.2f}")
print("by tottime (ms/step tottime, cumtime, calls/step)")
for r in sorted(rows, reverse=True)[:45]:
    print(f"{r[0] / steps * 1e3:8.3f} {r[1] / steps * 1e3:8.3f} {r[2] / steps:7.1f}  {r[3]}")
print("by cumtime, project functions")
for r in sorted([r for r in rows if "splitspec" in r[4] or "/main/" in r[4] or "/repo" in r[4]], key=lambda r: -r[1])[
    :45
]:
    print(f"{r[0] / steps * 1e3:8.3f} {r[1] / steps * 1e3:8.3f} {r[2] / steps:7.1f}  {r[3]}")
