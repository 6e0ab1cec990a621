"""What the first drafted step after a run with drafting off costs (a probe's or a try's step), against the drafted
steps after it and the off-run's own steps: the engine in this process, a fixed batch decoding, the tree budget
forced per step (off for K steps, then drafted for D), as the load-adaptive policy switches it. JSON out, no
assertions.

    python -P benchmarks/probe_cost.py --off-steps 16,64,256 -- --device cuda --dtype bfloat16 \
        --speculative-algorithm EAGLE3 --batch-size 16

Each variant runs the same schedule: "held" (an EAGLE head holds the rows fed while drafting is off and catches them
up at the next draft, its eager rounds padded to a ladder size: ModelRunner.forward_padded) and "unbucketed" (the same
without the padding). Step times are wall times of engine.step() as a server's loop runs it (no device waits added;
the overlap schedule on where the bench would use it); the drafter's catch-up is timed apart, with its rows.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time


def _schedule(off_steps: list[int], drafted: int) -> list[int]:
    """Budgets per step: drafted steps first (warm), then for each K: K off steps and `drafted` drafted ones."""
    plan = [0] * drafted
    for k in off_steps:
        plan += [1] * k + [0] * drafted
    return plan


def _new_tokens(plan: list[int], budget: int) -> int:
    """At most what the schedule's steps can emit (a drafted step: its budget's nodes and a bonus), and a margin."""
    return sum(1 if b == 1 else budget + 1 for b in plan) + 16


def _drain_before(owner, attr: str, draining: dict) -> None:
    """owner.attr waits for the device before it runs while draining["on"], and prints how long that took: where in a
    step the device's queue holds work the host waits for."""
    import torch

    inner = getattr(owner, attr)

    def wrapped(*args, **kwargs):
        if draining["on"]:
            began = time.perf_counter()
            torch.cuda.synchronize()
            print(f"   drained before {type(owner).__name__}.{attr}: {(time.perf_counter() - began) * 1e6:.0f} us",
                  file=sys.stderr)
        return inner(*args, **kwargs)

    setattr(owner, attr, wrapped)


def _variant(name: str, args, bench_args, runner, settings, prompts, off_steps: list[int], profile=None,
             torch_profile: bool = False, step_profile: bool = False) -> dict:
    """profile: a cProfile.Profile to run the drafter's catch-ups under (or None); torch_profile: the catch-ups of
    backlogs under torch's profiler, a table each on stderr; step_profile: each first drafted step's kernels."""
    import torch

    from splitspec import engine_args, speculation
    from splitspec.runtime.sampling_params import SamplingParams
    from splitspec.verifier_svc.engine import Engine

    drafter, spec = engine_args.in_process_drafter(settings, max_total_tokens=runner.kv_cache.num_pages
                                                   * runner.kv_cache.page_size, target=runner)
    head = drafter.drafter
    head.runner.pad_eager = name != "unbucketed" and runner.device.type == "cuda"
    spec = speculation.spec_config(settings)
    runner.capture_cuda_graphs(tree_nodes=(spec.num_draft_tokens,))
    overlap = runner.device.type == "cuda"
    engine = Engine(runner, drafter, spec, set(), engine_args.scheduler_config(bench_args), overlap_schedule=overlap)
    engine.adaptive = None
    plan = _schedule(off_steps, args.drafted_steps)
    step = {"i": 0}

    def choose(continuing: bool = False) -> int:
        i = step["i"]
        return 1 if i + 1 < len(plan) and plan[i + 1] == 1 else spec.num_draft_tokens  # asked at step i for i + 1

    engine._choose_budget = choose
    catch_ups = []
    original = head._catch_up

    def timed_catch_up(states):
        rows = sum(len(s.pending_tokens) for s in states)
        if profile is not None:
            profile.enable()
        traced = torch_profile and rows > 2 * len(states) * spec.num_draft_tokens  # a backlog's, not a drafted step's
        tracer = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) if traced else None
        cats, cat = [], torch.cat
        if tracer is not None:
            tracer.__enter__()

            def timed_cat(tensors, *a, **k):  # which joins are slow: their inputs
                t0 = time.perf_counter()
                result = cat(tensors, *a, **k)
                cats.append((time.perf_counter() - t0, [(tuple(t.shape), str(t.device), str(t.dtype), t.is_contiguous(),
                                                          t.storage_offset()) for t in tensors][:4], len(tensors)))
                return result

            torch.cat = timed_cat
            if runner.device.type == "cuda":  # what the device still has queued when the catch-up starts
                t0 = time.perf_counter()
                torch.cuda.synchronize()
                print(f"   the device's queue drained in {(time.perf_counter() - t0) * 1e6:.0f} us", file=sys.stderr)
        began = time.perf_counter()
        try:
            out = original(states)
        finally:
            torch.cat = cat
        for seconds, inputs, count in sorted(cats, key=lambda c: -c[0])[:6]:
            print(f"   cat {seconds * 1e6:.0f} us of {count} tensors: {inputs}", file=sys.stderr)
        catch_ups.append((step["i"], rows, time.perf_counter() - began))
        if tracer is not None:
            tracer.__exit__(None, None, None)
            print(f"== {name}: a catch-up of {rows} rows, {catch_ups[-1][2] * 1e3:.2f} ms", file=sys.stderr)
            print(tracer.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=25),
                  file=sys.stderr)
        if profile is not None:
            profile.disable()
        return out

    head._catch_up = timed_catch_up
    params = SamplingParams(temperature=0.0, max_new_tokens=_new_tokens(plan, spec.num_draft_tokens), ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    while any(not r.decoding for r in engine.running) or engine.waiting:  # prefill all, then count steps
        engine.step()
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    times, budgets, tokens = [], [], []
    firsts = {i + 1 for i in range(len(plan) - 1) if plan[i] == 1 and plan[i + 1] == 0}  # first drafted steps
    draining = {"on": False}
    if args.drain_points and runner.device.type == "cuda":
        for owner, attr in [(engine, "_step_in_flight"), (engine, "_retire"), (engine, "_schedule"), (engine, "_draft"),
                            (drafter, "request"), (head, "extend"), (head, "launch"), (head, "_catch_up"),
                            (engine, "_forward_and_accept")]:
            _drain_before(owner, attr, draining)
    for i in range(len(plan)):
        step["i"] = i
        if torch_profile and i in firsts and runner.device.type == "cuda":
            t0 = time.perf_counter()
            torch.cuda.synchronize()
            print(f"   before the step: the device's queue drained in {(time.perf_counter() - t0) * 1e6:.0f} us",
                  file=sys.stderr)
        kernels = None
        if step_profile and i in firsts and runner.device.type == "cuda":  # the device's work in that step, by kernel
            kernels = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                         torch.profiler.ProfilerActivity.CUDA])
            kernels.__enter__()
        draining["on"] = i in firsts
        began = time.perf_counter()
        events = engine.step()
        times.append(time.perf_counter() - began)
        if draining["on"]:
            print(f"   (step {i}: {times[-1] * 1e3:.2f} ms with the waits)", file=sys.stderr)
            draining["on"] = False
        if kernels is not None:
            torch.cuda.synchronize()
            kernels.__exit__(None, None, None)
            print(f"== {name}: the first drafted step {i}, by device time", file=sys.stderr)
            print(kernels.key_averages().table(sort_by="device_time_total", row_limit=14), file=sys.stderr)
        budgets.append(engine.report.budget)
        tokens.append(sum(len(e.new_token_ids) for e in events))
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    for r in list(engine.running):
        engine.abort(r)
    drafter.close()
    out, at = {}, args.drafted_steps
    for k in off_steps:
        off = times[at : at + k]
        drafted = times[at + k : at + k + args.drafted_steps]
        caught = [(rows, s) for i, rows, s in catch_ups if at <= i < at + k + 1]
        out[str(k)] = {
            "off_step_ms_median": round(statistics.median(off) * 1e3, 3),
            "off_steps_ms_total": round(sum(off) * 1e3, 2),
            "first_drafted_ms": round(drafted[0] * 1e3, 3),
            "then_drafted_ms_median": round(statistics.median(drafted[2:]) * 1e3, 3),
            "tokens_off": sum(tokens[at : at + k]), "tokens_drafted": sum(tokens[at + k : at + k + args.drafted_steps]),
            "catch_ups_through_first_drafted": [{"rows": rows, "ms": round(s * 1e3, 3)} for rows, s in caught],
        }
        at += k + args.drafted_steps
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--off-steps", default="16,64,256", help="Comma-separated off-run lengths, each followed by "
                        "--drafted-steps drafted steps.")
    parser.add_argument("--drafted-steps", type=int, default=8)
    parser.add_argument("--variants", default="unbucketed,held")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=None)
    parser.add_argument("--torch-profile", action="store_true", help="The first drafted steps' catch-ups under torch's "
                        "profiler: operators and CUDA runtime calls by own host time, per variant, on stderr.")
    parser.add_argument("--step-profile", action="store_true", help="Each first drafted step under torch's profiler "
                        "with the device's activity: its kernels by device time, on stderr.")
    parser.add_argument("--drain-points", action="store_true", help="In each first drafted step, wait for the device "
                        "before each of the engine's and the drafter's parts and print how long that took (on stderr).")
    parser.add_argument("--cprofile", action="store_true", help="The catch-ups under cProfile: their callees by own and "
                        "cumulative time, per variant, on stderr (slows them: for proportions).")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then `splitspec bench` flags (model, device, "
                        "--speculative-*, --batch-size as the batch, --prompt-len).")
    args = parser.parse_args()
    from splitspec import model_flags, speculation
    from splitspec.bench import build_parser
    from splitspec.cli import _demo_target
    from splitspec.default_model import set_provider
    from splitspec.bench_in_process import _resolve_models
    from splitspec.bench_measure import make_prompts
    from splitspec.runtime.runner import ModelRunner

    set_provider(_demo_target)  # as the splitspec command: the demo target without --model-path
    rest = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    bench_args = build_parser().parse_args(rest)
    _resolve_models(bench_args)
    model_dir = model_flags.resolve_model(bench_args)
    batch = int(bench_args.batch_size.split(",")[0])
    off_steps = [int(k) for k in args.off_steps.split(",")]
    plan = _schedule(off_steps, args.drafted_steps)
    total = bench_args.prompt_len + _new_tokens(plan, 16) + 256  # the largest budget SGLang picks
    if bench_args.cuda_graph_max_bs is None and not bench_args.disable_cuda_graph:
        bench_args.cuda_graph_max_bs = batch
    runner = ModelRunner.load(model_flags.runtime_config(bench_args, model_dir, default_max_total_tokens=batch * total))
    settings = speculation.resolve(bench_args, runner.config)
    prompts = make_prompts(bench_args, None if bench_args.preset else model_dir, runner.config.vocab_size, batch)
    result = {"benchmark": "probe cost", "command": " ".join(["python -P benchmarks/probe_cost.py", *sys.argv[1:]]),
              "commit": os.environ.get("SPLITSPEC_COMMIT"),  # as scripts/gpu_bench.sh names it (a copy has no .git)
              "batch_size": batch, "variants": {}}
    try:
        import torch

        result["device"] = torch.cuda.get_device_name() if runner.device.type == "cuda" else "cpu"
    except Exception:  # noqa: BLE001 - a label only
        result["device"] = str(runner.device)
    for repeat in range(args.repeats):
        for name in args.variants.split(","):
            profile = cProfile.Profile() if args.cprofile else None
            result["variants"].setdefault(name, []).append(
                _variant(name, args, bench_args, runner, settings, prompts, off_steps, profile,
                         args.torch_profile, args.step_profile))
            print(name, repeat, json.dumps(result["variants"][name][-1]), flush=True)
            if profile is not None:
                for order in ("tottime", "cumulative"):
                    print(f"== {name} {repeat}: catch-ups by {order}", file=sys.stderr)
                    pstats.Stats(profile, stream=sys.stderr).sort_stats(order).print_stats(30)
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
