"""Host work of the engine's decode steps in process, by function (cProfile): the engine on a fixed batch of the bench's
prompts, the budget forced, no policy. No assertions.

    # every step drafted at BUDGET: timed unprofiled, then under cProfile (ms a step by function: own, cumulative, calls),
    # then under torch.profiler (the device's busy time a step; STEP_HOST_TRACE=PATH also writes five steps' timeline)
    python -P benchmarks/step_host_cost.py drafted STEPS BUDGET --device cuda --dtype bfloat16 \
        --speculative-algorithm EAGLE3 --speculative-num-steps 5 --speculative-eagle-topk 1 \
        --speculative-num-draft-tokens 6 --batch-size 16 --prompt-len 128
    # a speculating request's drafting-off step (budget 1: states captured, feeds every 16 tokens) against the same
    # requests opted out, and against plain decoding as `splitspec bench` runs its plain point (an engine without the
    # drafter, the target capturing no layers): three rounds each, interleaved, the third under cProfile, then the
    # functions by the difference in own and cumulative time a step (off against opted out)
    python -P benchmarks/step_host_cost.py off STEPS --device cuda --dtype bfloat16 --speculative-algorithm EAGLE3 \
        --batch-size 16 --prompt-len 128
    # the bench's own loop over PROMPTS prompts (its waves, its policy), plain against speculating, by function
    python -P benchmarks/step_host_cost.py bench PROMPTS --device cuda --dtype bfloat16 --speculative-algorithm EAGLE3 \
        --speculative-num-steps 5 --speculative-eagle-topk 1 --speculative-num-draft-tokens 6 \
        --speculative-adaptive on --batch-size 16 --prompt-len 128 --output-len 256
    # a request joining a running batch: --batch-size less one requests decoding at BUDGET (1: drafting off), then
    # COUNT times a prompt added, the step that prefills it (mixed or alone, as the scheduling flags say) and the next
    # timed, the newcomer aborted and two steps run; then the same under cProfile (ms an arrival by function), then
    # under torch.profiler (the device's busy time and kernels against the wall: host or device)
    python -P benchmarks/step_host_cost.py arrival COUNT BUDGET --device cuda --dtype bfloat16 \
        --speculative-algorithm EAGLE3 --batch-size 16 --prompt-len 128 [--disable-mixed-chunk]

STEP_HOST_OVERLAP=1 runs the overlap schedule on a CPU too (a GPU server's host path: its drafting-off runs overlapped,
the forwards synchronous); STEP_HOST_POLICY=1 keeps the load-adaptive policy choosing and observing every step (the
budget forced after each choice), so that its cost is in the steps: what a server's steps pay while the policy has not
settled, not a settled drafting-off run's quiet steps (policy_link.QuietRun), which `bench` times as a server runs them.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import statistics
import sys
import time


class Setup:
    """The target, an in-process drafter and the prompts, as `splitspec bench` makes them from its flags."""

    def __init__(self, flags: list[str], max_tokens_per_request: int):
        from splitspec import engine_args, model_flags, speculation
        from splitspec.bench import build_parser
        from splitspec.bench_in_process import _resolve_models
        from splitspec.bench_measure import make_prompts
        from splitspec.cli import _demo_target
        from splitspec.default_model import set_provider
        from splitspec.runtime.runner import ModelRunner

        set_provider(_demo_target)  # as the splitspec command: the demo target without --model-path
        self.args = build_parser().parse_args(flags)
        _resolve_models(self.args)
        model_dir = self.model_dir = model_flags.resolve_model(self.args)
        self.batch = int(self.args.batch_size)
        if self.args.cuda_graph_max_bs is None and not self.args.disable_cuda_graph:
            self.args.cuda_graph_max_bs = self.batch
        self.runner = ModelRunner.load(model_flags.runtime_config(
            self.args, model_dir, default_max_total_tokens=self.batch * max_tokens_per_request))
        settings = speculation.resolve(self.args, self.runner.config)
        self.prompts = make_prompts(self.args, None if self.args.preset else model_dir, self.runner.config.vocab_size,
                                    self.batch)
        kv = self.runner.kv_cache
        self.drafter, _ = engine_args.in_process_drafter(settings, max_total_tokens=kv.num_pages * kv.page_size,
                                                         target=self.runner)
        self.spec = speculation.spec_config(settings)
        # STEP_HOST_OVERLAP=1: the overlap schedule on a CPU too (a GPU server's host path, its forwards synchronous)
        self.cuda = self.runner.device.type == "cuda"
        self.overlap = self.cuda or os.environ.get("STEP_HOST_OVERLAP") == "1"
        self.layers = self.drafter_layers = self.runner.capture_layers
        if self.cuda:
            self.runner.capture_cuda_graphs(tree_nodes=(self.spec.num_draft_tokens,))

    def target_for(self, drafter: bool, tree_nodes: tuple[int, ...] | None = None) -> None:
        """The target's captured layers (and its graphs) for an engine with the drafter or without one."""
        layers = self.drafter_layers if drafter else ()
        if layers != self.layers:
            self.runner.set_capture_layers(layers)
            if self.cuda:
                self.runner.capture_cuda_graphs(tree_nodes=tree_nodes or (self.spec.num_draft_tokens,))
            self.layers = layers

    def engine(self, budget: int, new_tokens: int, speculate: bool = True, drafter: bool = True):
        """An engine at this budget with every prompt prefilled and ten decode steps run (drafter False: none, and
        the target's graphs without the layers a drafter captures)."""
        from splitspec import engine_args
        from splitspec.runtime.sampling_params import SamplingParams
        from splitspec.verifier_svc.engine import Engine

        self.target_for(drafter)
        engine = Engine(self.runner, self.drafter if drafter else None, self.spec, set(),
                        engine_args.scheduler_config(self.args), overlap_schedule=self.overlap)
        policy = engine.adaptive if os.environ.get("STEP_HOST_POLICY") == "1" else None
        engine.adaptive = policy
        if policy is None:
            engine._choose_budget = lambda continuing=False: budget
        else:  # STEP_HOST_POLICY=1: the load-adaptive policy chooses and observes as a server's does (its cost in the
            choose = engine._choose_budget  # steps), and the budget is forced after it

            def forced(continuing: bool = False) -> int:
                choose(continuing)
                policy.budget = policy._last_choice = budget  # as if chosen: a settled choice is reused as it would be
                return budget

            engine._choose_budget = forced
        params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
        for prompt in self.prompts:
            engine.add_request(prompt, params, speculate=speculate)
        while any(not r.decoding for r in engine.running) or engine.waiting:
            engine.step()
        for _ in range(10):
            engine.step()
        self.sync()
        return engine

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()


def timed(engine, steps: int, profile: cProfile.Profile | None = None) -> tuple[list[float], int]:
    """Each step's wall time, and the tokens the steps made."""
    times, tokens = [], 0
    if profile is not None:
        profile.enable()
    for _ in range(steps):
        began = time.perf_counter()
        events = engine.step()
        times.append(time.perf_counter() - began)
        tokens += sum(len(e.new_token_ids) for e in events)
    if profile is not None:
        profile.disable()
    return times, tokens


def name(key: tuple) -> str:
    return f"{'/'.join(key[0].split('/')[-2:])}:{key[1]}({key[2]})"


def print_profile(profile: cProfile.Profile, per: int, unit: str, top: int) -> list[tuple]:
    """The top functions by own time, then the project's by cumulative time, in ms (and calls) per `unit` over `per`
    of them; the rows (tottime, cumtime, calls, name, file) for more sums."""
    rows = [(v[2], v[3], v[1], name(k), k[0]) for k, v in pstats.Stats(profile).stats.items()]
    print(f"by tottime (ms/{unit} tottime, cumtime, calls/{unit})")
    for r in sorted(rows, reverse=True)[:top]:
        print(f"{r[0] / per * 1e3:8.3f} {r[1] / per * 1e3:8.3f} {r[2] / per:7.1f}  {r[3]}")
    print("by cumtime, project functions")
    for r in sorted([r for r in rows if "splitspec" in r[4] or "_svc/" in r[4]], key=lambda r: -r[1])[:top]:
        print(f"{r[0] / per * 1e3:8.3f} {r[1] / per * 1e3:8.3f} {r[2] / per:7.1f}  {r[3]}")
    return rows


def drafted(steps: int, budget: int, flags: list[str]) -> None:
    setup = Setup(flags, steps * 21 + 600)
    engine = None

    def fresh():
        """An engine of its own for each of the three runs below, its requests' new tokens within the model's context
        (a run of budget-12 NGRAM steps at ~5 tokens a step took one request past 2048 positions when the three shared
        an engine: past what the graphs' page tables are sized for, which a server's gateway refuses up front)."""
        nonlocal engine
        if engine is not None:  # its pages back to the pool first
            for request in list(engine.running) + list(engine.waiting):
                engine.abort(request)
        room = setup.runner.context_length - max(len(p) for p in setup.prompts) - budget
        engine = setup.engine(budget, min((steps + 10) * min(budget, 20) + 60, room))  # ten warm-up steps first
        return engine

    times, tokens = timed(fresh(), steps)
    setup.sync()
    print(f"unprofiled: median step {statistics.median(times) * 1e3:.3f} ms, mean {statistics.mean(times) * 1e3:.3f}, "
          f"{tokens / steps / setup.batch:.2f} tokens/request/step")
    head = getattr(getattr(setup.drafter, "drafter", None), "runner", None)  # a head's own runner, if it has one
    for backend in {setup.runner.backend, *([head.backend] if head is not None else [])}:
        # FlashInfer's graph plans: lean (flashinfer_replan), of them reused, its own
        if hasattr(backend, "lean_plans"):
            print(f"graph plans of {type(backend).__name__}: lean {backend.lean_plans}, reused {backend.reused_plans}, "
                  f"FlashInfer's own {backend.full_plans}; lean by kind: "
                  + ", ".join(f"{kind}/{name}/{'planned' if planned else 'reused'} {n}"
                              for (kind, name, planned), n in sorted(backend.lean_plans_by_kind.items())))
    profile = cProfile.Profile()
    times, tokens = timed(fresh(), steps, profile)
    print(f"budget {budget} batch {setup.batch}: median step {statistics.median(times) * 1e3:.2f} ms, "
          f"{tokens / steps / setup.batch:.2f} tokens/request/step")
    rows = print_profile(profile, steps, "step", 45)
    torch_time = sum(r[0] for r in rows if r[4] == "~" or "torch" in r[4])
    print(f"total profiled {sum(r[0] for r in rows) / steps * 1e3:.2f} ms/step; torch+builtins {torch_time / steps * 1e3:.2f}")

    def step(_profile=None) -> float:
        began = time.perf_counter()
        engine.step()
        return time.perf_counter() - began

    fresh()
    torch_profile(step, steps, "drafted steps")
    if os.environ.get("STEP_HOST_TRACE"):  # a few steps' timeline, host and device, for chrome://tracing or Perfetto
        torch_profile(step, 5, "drafted steps (traced)", trace=os.environ["STEP_HOST_TRACE"])
    setup.drafter.close()


def off(steps: int, flags: list[str]) -> None:
    setup = Setup(flags, steps * 2 + 900)
    stats = {}
    variants = {"drafting off": (True, True), "opted out": (False, True), "no drafter": (False, False)}
    for round_ in range(3):
        for label, (speculate, drafter) in variants.items():
            engine = setup.engine(1, steps + 50, speculate, drafter)
            profile = cProfile.Profile() if round_ == 2 else None
            began = time.perf_counter()
            times, _ = timed(engine, steps, profile)
            setup.sync()
            wall = time.perf_counter() - began
            print(f"{label}: {steps} steps {wall * 1e3 / steps:.3f} ms/step wall, "
                  f"median {statistics.median(times) * 1e3:.3f}", flush=True)
            if profile is not None:
                stats[label] = pstats.Stats(profile).stats
            for request in list(engine.running):
                engine.abort(request)
    setup.drafter.close()
    for against in ("opted out", "no drafter"):
        rows = []
        for key in stats["drafting off"].keys() | stats[against].keys():
            v = stats["drafting off"].get(key, (0, 0, 0, 0, None))
            w = stats[against].get(key, (0, 0, 0, 0, None))
            rows.append((v[2] - w[2], v[3] - w[3], v[1], w[1], name(key)))
        for title, column in ((f"speculating-off minus {against}, ms/step: tottime, cumtime; calls/step each", 0),
                              ("by cumtime difference", 1)):
            print(title)
            for r in sorted(rows, key=lambda r: -r[column])[:30]:
                print(f"{r[0] / steps * 1e3:8.4f} {r[1] / steps * 1e3:8.4f} {r[2] / steps:7.1f} {r[3] / steps:7.1f} {r[4]}")


def bench(prompts: int, flags: list[str]) -> None:
    """The bench's own loop (bench_in_process.drive, as `splitspec bench` runs a point: its waves, its policy, the
    overlap schedule) over PROMPTS prompts at --batch-size, plain (no drafter, no captured layers) against the
    speculating engine (adaptive as the flags say), three rounds interleaved, the third under cProfile; then the
    functions by the difference a decode step (speculating minus plain). STEP_HOST_ROUNDS=N: N rounds, none profiled."""
    from splitspec import engine_args
    from splitspec.bench_in_process import drive
    from splitspec.bench_measure import make_prompts
    from splitspec.runtime.sampling_params import SamplingParams
    from splitspec.verifier_svc.adaptive import adaptive_policy, verify_tree_sizes

    from splitspec.bench import build_parser

    parsed = build_parser().parse_args(flags)
    setup = Setup(flags, parsed.prompt_len + parsed.output_len + 64)
    args = setup.args
    texts = make_prompts(args, None if args.preset else setup.model_dir, setup.runner.config.vocab_size, prompts)
    params = [SamplingParams(temperature=0.0, seed=i, max_new_tokens=args.output_len, ignore_eos=True)
              for i in range(len(texts))]
    scheduler = engine_args.scheduler_config(args)
    policy = adaptive_policy(setup.spec)
    trees = verify_tree_sizes(setup.spec)
    stats, rounds = {}, int(os.environ.get("STEP_HOST_ROUNDS", "0"))  # N: N rounds unprofiled, no cProfile
    for round_ in range(rounds or 3):
        for label, speculating in (("plain", False), ("speculating", True)):
            setup.target_for(speculating, trees)
            profile = cProfile.Profile() if round_ == 2 and not rounds else None
            if profile is not None:
                profile.enable()
            row, _ = drive(setup.runner, setup.drafter if speculating else None, setup.spec if speculating else None,
                           texts, setup.batch, params, scheduler, policy if speculating else None, sync_phases=False,
                           overlap=setup.overlap)
            if profile is not None:
                profile.disable()
                stats[label] = (pstats.Stats(profile).stats, row["decode_steps"])
            print(f"{label}{' (cProfile)' if profile else ''}: {row['output_tok_s']} tok/s, {row['decode_steps']} decode "
                  f"steps, step_ms {row['step_ms']}, budgets {row.get('budgets')}, tpot {row['tpot_ms']} ms", flush=True)
    setup.drafter.close()
    if not stats:
        return
    rows = []
    (spec_stats, spec_steps), (plain_stats, plain_steps) = stats["speculating"], stats["plain"]
    for key in spec_stats.keys() | plain_stats.keys():
        v, w = spec_stats.get(key, (0, 0, 0, 0, None)), plain_stats.get(key, (0, 0, 0, 0, None))
        rows.append((v[2] / spec_steps - w[2] / plain_steps, v[3] / spec_steps - w[3] / plain_steps,
                     v[1] / spec_steps, w[1] / plain_steps, name(key)))
    for title, column in (("speculating minus plain, ms a decode step: tottime, cumtime; calls a step each", 0),
                          ("by cumtime difference", 1)):
        print(title)
        for r in sorted(rows, key=lambda r: -r[column])[:35]:
            print(f"{r[0] * 1e3:8.4f} {r[1] * 1e3:8.4f} {r[2]:7.1f} {r[3]:7.1f} {r[4]}")


def arrival(count: int, budget: int, flags: list[str]) -> None:
    from splitspec.runtime.sampling_params import SamplingParams

    setup = Setup(flags, count * 8 + 900)
    engine = setup.engine(budget, count * 6 + 400)
    engine.abort(engine.running[-1])  # a slot for the newcomer
    params = SamplingParams(temperature=0.0, max_new_tokens=64, ignore_eos=True)

    def arrive(profile: cProfile.Profile | None) -> tuple[float, float, bool]:
        newcomer = engine.add_request(setup.prompts[-1], params)
        if profile is not None:
            profile.enable()
        began = time.perf_counter()
        engine.step()
        mixed = engine.report.forward_tokens > engine.report.prefill_tokens > 0
        prompt_step = time.perf_counter()
        engine.step()
        ended = time.perf_counter()
        if profile is not None:
            profile.disable()
        engine.abort(newcomer)
        for _ in range(2):
            engine.step()
        setup.sync()
        return prompt_step - began, ended - prompt_step, mixed

    decode, _ = timed(engine, 20)
    for label, profile in (("unprofiled", None), ("cProfile", cProfile.Profile())):
        runs = [arrive(profile) for _ in range(count)]
        print(f"{label}: {count} arrivals into {setup.batch - 1} decoding at budget {budget}, {sum(r[2] for r in runs)} "
              f"mixed: median prompt step {statistics.median(r[0] for r in runs) * 1e3:.3f} ms, the next "
              f"{statistics.median(r[1] for r in runs) * 1e3:.3f}, both {statistics.median(r[0] + r[1] for r in runs) * 1e3:.3f}"
              f" (a decode step before them {statistics.median(decode) * 1e3:.3f})", flush=True)
    print_profile(profile, count, "arrival", 40)
    # arrive() also aborts the newcomer and runs two steps after it: the device's count and time are over all four
    torch_profile(lambda profile: sum(arrive(profile)[:2]), count, "arrivals (prompt step + next; four steps each)")
    setup.drafter.close()


def torch_profile(run, count: int, what: str, trace: str | None = None) -> None:
    """count runs (run(None): its wall seconds) under torch.profiler: the device's busy time against the wall, the
    kernels launched, the ops by host time and by device time: whether a run's milliseconds are the host's (Python,
    launches) or the device's."""
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    walls = []
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(count):
            walls.append(run(None))
    if trace:
        profiler.export_chrome_trace(trace)
    events = profiler.key_averages()
    device_key = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    on_device = [e for e in profiler.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_us = sum(e.time_range.elapsed_us() for e in on_device)
    print(f"torch.profiler: {count} {what}, median {statistics.median(walls) * 1e3:.3f} ms wall (profiled); on the "
          f"device {len(on_device) / count:.0f} kernels and copies a run, busy {busy_us / 1e3 / count:.3f} ms of them")
    print("by self host time")
    print(events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
    if len(activities) > 1:
        print("by device time")
        print(events.table(sort_by=device_key, row_limit=20, max_name_column_width=60))


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("drafted", "off", "arrival", "bench"):
        raise SystemExit(__doc__)
    if sys.argv[1] == "drafted":
        drafted(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])
    elif sys.argv[1] == "bench":
        bench(int(sys.argv[2]), sys.argv[3:])
    elif sys.argv[1] == "arrival":
        arrival(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])
    else:
        off(int(sys.argv[2]), sys.argv[3:])
