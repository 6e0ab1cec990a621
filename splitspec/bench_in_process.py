"""`splitspec bench` in process: the target loaded once, plain decoding and then every point of the grid at
every batch size, driven through the engine (splitspec.bench says what a row holds)."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import json
import logging
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

from splitspec import engine_args, heap, model_flags, speculation
from splitspec.bench_measure import (Timeline, drafted_token_share, ints, latency_fields, make_prompts, prompts_for,
                                     round_prompts)
from splitspec.lifeline import spawn
from splitspec.step_log import StepLog

logger = logging.getLogger("splitspec.bench")


def drive(runner, drafter, spec, prompts: list[list[int]], batch_size: int, params: list, scheduler,
          policy=None, sync_phases: bool = True, overlap: bool = False) -> tuple[dict, list]:
    """Serve the prompts with at most batch_size running; (row fields, requests). policy: an adaptive policy to go on
    learning with (a server keeps one for its life), else the engine's own. sync_phases: on a GPU, wait for the device
    at every phase boundary so that step_ms splits the step by phase (a server does not; off, the phases are host time
    and only the step total is the device's). overlap: the overlap schedule (a server's on a GPU; not with sync_phases)."""
    from splitspec.device_profile import StepProfiler
    from splitspec.sync_debug import SyncCounter
    from splitspec.verifier_svc.engine import Engine, SpecConfig

    if not prompts:  # e.g. the warm-up of --warmup-requests 0
        return {}, []
    log = StepLog.from_env("in_process")  # SPLITSPEC_STEP_LOG
    profiler = StepProfiler(f"bs{batch_size}_{len(prompts)}x{params[0].max_new_tokens}_"
                            f"{getattr(getattr(drafter, 'drafter', None), 'name', 'spec') if drafter is not None else 'plain'}")
    engine = Engine(runner, drafter, spec or SpecConfig(), set(), scheduler, sync_timing=sync_phases,
                    overlap_schedule=overlap)
    engine.adaptive = engine.adaptive if policy is None else policy
    budgets: dict[int, int] = {}  # decode steps per tree budget
    waiting = list(range(len(prompts)))
    timelines = [Timeline() for _ in prompts]
    requests, index, phases = [None] * len(prompts), {}, {}
    decode_steps, decode_seconds = 0, 0.0
    syncs = SyncCounter.from_env(f"in_process_bs{batch_size}_{'spec' if drafter is not None else 'plain'}")  # SPLITSPEC_SYNC_DEBUG
    if syncs is not None:
        syncs.start()
    start = time.perf_counter()
    while waiting or engine.has_work:
        while waiting and len(index) < batch_size:
            i = waiting.pop(0)
            timelines[i].sent = time.perf_counter()
            requests[i] = engine.add_request(prompts[i], params[i])
            index[requests[i].request_id] = i
            if log is not None:
                log.arrived(timelines[i].sent, timelines[i].sent)
        if log is not None:
            log.begin()
        step_start = time.perf_counter()
        events = engine.step()
        now = time.perf_counter()
        report = engine.report
        if log is not None:
            log.step(step_start, now, report, len(engine.running), len(engine.waiting))
            log.published(now, len(events), sum(1 for e in events if e.new_token_ids and not timelines[index[e.request_id]].deliveries),
                          sum(1 for e in events if e.finish_reason is not None))
        if report.prefill_tokens == 0 and report.generated_tokens:
            decode_steps += 1
            decode_seconds += now - step_start
            for phase, seconds in report.seconds.items():
                phases[phase] = phases.get(phase, 0.0) + seconds
            if drafter is not None:
                budgets[report.budget] = budgets.get(report.budget, 0) + 1
            profiler.step()
            if syncs is not None:
                syncs.step()
        for event in events:
            i = index[event.request_id]
            if event.new_token_ids:
                timelines[i].deliveries.append((now, len(event.new_token_ids)))
            if event.finish_reason is not None:
                del index[event.request_id]
                if event.finish_reason == "error":
                    logger.error("request %d failed: %s", i, event.error)
    row = {**latency_fields(timelines, time.perf_counter() - start), "window_s": [round(start, 3), round(time.perf_counter(), 3)],
           "prompt_tokens_mean": round(sum(map(len, prompts)) / len(prompts), 1)}
    if syncs is not None:
        syncs.stop()
    if log is not None:
        log.point(batch_size, drafter is not None, start, time.perf_counter(), timelines)
        log.close()
    profiler.close()
    if decode_steps:
        step = {k: round(v / decode_steps * 1e3, 3) for k, v in phases.items()}
        step["total"] = round(decode_seconds / decode_steps * 1e3, 3)
        step["other"] = round(step["total"] - sum(v for k, v in step.items() if k != "total"), 3)
        row.update(decode_steps=decode_steps, step_ms=step, phases_synchronised=engine.sync_timing,
                   overlap_schedule=engine.overlap_schedule)
    if budgets:
        row["budgets"] = {str(k): v for k, v in sorted(budgets.items())}  # decode steps per tree budget
    return row, requests


class RemoteDrafter:
    """A drafter pool on loopback and one `splitspec drafter` process registered to it, drafting what the
    grid point's flags name (the replay included) on --drafter-device: the engine's DrafterClient."""

    def __init__(self, ns, settings, runner, max_total_tokens: int, max_batch: int):
        """ns: the grid point's flags (the drafter process gets them); settings: what they resolve to."""
        import socket

        from splitspec import draft_models
        from splitspec.runtime.tensor_plane import device_identity
        from splitspec.verifier_svc.drafter_pool import DrafterPool

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            address = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
        layers = settings.hidden_state_layers
        draft_models.capture_for(runner, layers)
        self.overlap, self.num_bets = settings.overlap, settings.num_bets
        self.device = ns.drafter_device or str(runner.device)
        self.pool = DrafterPool(address, settings.algorithm, runner.config.vocab_size, draft_model=settings.draft_model,
                                timeout=5.0, heartbeat_timeout=30.0, hidden_state_layers=layers, overlap=self.overlap,
                                num_bets=self.num_bets, device=device_identity(runner.device),
                                overlap_max_bs=settings.overlap_max_bs, tensor_device=runner.device,
                                ipc_buffer_bytes=0 if ns.drafter_plane == "frames" else 64 << 20)
        flags = ["--verifier-drafter-addr", address, "--drafter-name", "bench", "--log-level", "warning",
                 "--speculative-algorithm", ns.speculative_algorithm, "--device", self.device, "--dtype", ns.dtype,
                 "--page-size", str(ns.page_size),  # and a page per bet's fork
                 "--max-total-tokens", str(max_total_tokens + max_batch * (self.num_bets + 2) * ns.page_size),
                 "--cuda-graph-max-bs", str(max(8, max_batch * (1 + self.num_bets)))]  # bets draft in one batch
        if ns.speculative_algorithm != "NGRAM":
            flags += ["--model-path", str(runner.model_dir), "--load-format", ns.load_format or "auto"]
        for flag in ("speculative_draft_model_path", "speculative_draft_load_format", "speculative_num_steps",
                     "speculative_eagle_topk", "speculative_num_draft_tokens", "speculative_replay",
                     "speculative_replay_profile", "speculative_replay_seed", "speculative_replay_guess_rate",
                     "speculative_attention_mode"):
            value = getattr(ns, flag, None)
            if value is not None:
                flags += ["--" + flag.replace("_", "-"), str(value)]
        if getattr(ns, "speculative_draft_disable_cuda_graph", False) or ns.disable_cuda_graph:
            flags.append("--disable-cuda-graph")
        self.process = spawn([sys.executable, "-P", "-m", "splitspec", "drafter", *flags])
        self.stats = self.pool.stats
        self.needs_hidden_states = self.pool.needs_hidden_states
        deadline = time.monotonic() + 600
        while not self.pool.wait_for_drafters(1, 1.0):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the drafter process did not register (exit code {self.process.returncode})")
        logger.info("drafter process on %s registered (overlap %s, %d bets)", self.device, self.overlap, self.num_bets)

    def __getattr__(self, name):  # open, request, collect, release, accepted: the pool's
        if name == "pool":
            raise AttributeError(name)
        return getattr(self.pool, name)

    def fields(self) -> dict:
        counts = {k: self.pool.stats.extra.get(k, 0) for k in ("bet_hits", "bet_misses", "bets_late")}
        asks = sum(counts.values())
        drafter = next(iter(self.pool._drafters.values()), None)
        plane = "cuda-ipc" if drafter is not None and drafter.ipc_ready else "zmq-frames"
        return {"drafter_device": self.device, "tensor_plane": plane, "overlap": self.overlap, "num_bets": self.num_bets,
                "bets": {"hits": counts["bet_hits"], "misses": counts["bet_misses"], "late": counts["bets_late"],
                         "hit_rate": round(counts["bet_hits"] / asks, 4) if asks else None},
                # the drafter's own clock per DraftReply (trees) and per DraftBets (bets), in ms
                "drafter_reply_ms": self._mean_ms("reply"), "drafter_bets_ms": self._mean_ms("bet"),
                # from sending a DraftRequest to filing its DraftReply, on the verifier's clock
                "round_trip_ms": self._mean_ms("round_trip", "round_trips"),
                # where the round trip went, by wall clocks (one host): queued -> on the wire (the pool's I/O
                # thread) -> at the drafter -> its answer left -> filed by the pool; wake: filed -> the engine
                # thread running again
                "transport_ms": {
                    "reply": {leg: self._mean_ms(f"transport_reply_{leg}", "transport_reply_count")
                              for leg in ("queue", "out", "drafter", "in")},
                    "bets_in": self._mean_ms("transport_bets_in", "transport_bets_count"),
                    "wake": self._mean_ms("transport_wake", "transport_wakes")}}

    def _mean_ms(self, kind: str, count: str | None = None) -> float | None:
        extra = self.pool.stats.extra
        steps = extra.get(count or f"{kind}_steps", 0)
        return round(extra.get(f"{kind}_seconds", 0.0) / steps * 1e3, 3) if steps else None

    def close(self) -> None:
        self.process.kill()
        self.process.wait()
        self.pool.close()


def spec_fields(requests, drafter) -> dict:
    steps = sum(r.stats.verify_steps for r in requests)
    accepted = sum(r.stats.accepted_tokens for r in requests)
    depth = max((len(r.stats.accepted_per_position) for r in requests), default=0)
    per_position = [sum(r.stats.accepted_per_position[d] for r in requests if d < len(r.stats.accepted_per_position))
                    for d in range(depth)]
    out = {"verify_steps": steps, "draft_tokens": sum(r.stats.draft_tokens for r in requests), "accepted_tokens": accepted,
           "accept_length": round(1 + accepted / steps, 4) if steps else None,
           "accepted_per_position": [round(c / steps, 4) for c in per_position] if steps else [],
           "fallbacks": sum(r.stats.fallbacks for r in requests),
           "drafter": {"trees": drafter.stats.trees, "empty": drafter.stats.empty, "faults": drafter.stats.faults}}
    inner = getattr(drafter, "drafter", None)
    if getattr(inner, "simulated", False):
        out["off_reference"] = inner.off_reference
    return out


def grid_points(args) -> list[argparse.Namespace]:
    """One namespace per distinct tree shape of the grid (invalid ones logged and skipped)."""
    from splitspec.speculation import FlagError

    points, seen = [], set()
    for steps, topk, tokens in itertools.product(ints(args.steps), ints(args.topk), ints(args.num_draft_tokens)):
        ns = copy.copy(args)
        if steps is not None or topk is not None or tokens is not None:
            ns.speculative_num_steps = steps if steps is not None else args.speculative_num_steps
            ns.speculative_eagle_topk = topk if topk is not None else args.speculative_eagle_topk
            ns.speculative_num_draft_tokens = tokens if tokens is not None else args.speculative_num_draft_tokens
        try:
            shape = tree_of(ns)
            if shape[2] > 1 + shape[0] * shape[1] + (shape[0] - 1) * shape[1] * (shape[1] - 1):
                raise FlagError(f"{shape[2]} tree nodes do not fit {shape[0]} steps of top-{shape[1]}")
        except (FlagError, ValueError) as exc:
            logger.warning("grid point steps=%s topk=%s tokens=%s skipped: %s", steps, topk, tokens, exc)
            continue
        if shape not in seen:
            seen.add(shape)
            points.append(ns)
    return points


def tree_of(ns) -> tuple[int, int, int]:
    """(num_steps, topk, num_draft_tokens) the flags resolve to; NGRAM: (tokens - 1, 1, tokens) (its budget)."""
    from splitspec.speculation import resolve

    return resolve(ns).tree


def _resolve_models(args) -> None:
    """Presets become dummy model directories; the demo target gets its demo draft, as `splitspec up` does; the
    simulated acceptance's conditions are checked."""
    from splitspec.model_shapes import dummy_model_dir

    if args.preset:
        args.model_path, args.load_format = str(dummy_model_dir(args.preset)), "dummy"
    if args.draft_preset:
        args.speculative_draft_model_path = str(dummy_model_dir(args.draft_preset))
        args.speculative_draft_load_format = "dummy"
    if args.simulate_acceptance and not args.speculative_algorithm:
        raise ValueError("--simulate-acceptance needs a --speculative-algorithm whose drafter pays the draft cost")
    if args.simulate_acceptance and args.temperature > 0:
        raise ValueError("--simulate-acceptance replays greedy outputs: use --temperature 0")
    if args.simulate_acceptance and args.load_format == "dummy":  # greedy outputs that hold between batch shapes
        args.load_format = "dummy-decisive"
    if args.model_path is None and args.speculative_algorithm in ("STANDALONE", "EAGLE", "EAGLE3") \
            and not args.speculative_draft_model_path:  # the demo target: its demo draft, as `splitspec up` does
        from splitspec.demo import demo_model_dirs

        kind = {"STANDALONE": "draft", "EAGLE": "eagle", "EAGLE3": "eagle3"}[args.speculative_algorithm]
        args.speculative_draft_model_path = str(demo_model_dirs(heads=kind != "draft")[kind])


def _spec_row(args, ns, row: dict, requests, drafter, plain: dict, plain_outputs: list, batch_size: int, adaptive: bool,
              reference, profile) -> dict:
    """A speculative point's row: its grid point, its measurements, its speedup over plain decoding at that batch
    size and how many outputs equal plain decoding's; logged."""
    steps, topk, tokens = tree_of(ns)
    row = {"batch_size": batch_size, "speculative": ns.speculative_algorithm, "steps": steps,
           "topk": topk, "num_draft_tokens": tokens, "adaptive": adaptive, "simulated": bool(reference),
           "drafter_transport": args.drafter_transport, **row, **spec_fields(requests, drafter)}
    if isinstance(drafter, RemoteDrafter):
        row.update(drafter.fields())
    if reference is not None:
        row["profile"] = profile
    row["speedup"] = round(row["output_tok_s"] / plain["output_tok_s"], 3) if plain["output_tok_s"] else None
    row["drafted_token_share"] = drafted_token_share(row["verify_steps"], row["accepted_tokens"], row["output_tokens"])
    row["outputs_equal_plain"] = sum(r.output_ids == p for r, p in zip(requests, plain_outputs))
    logger.info("batch %d %s steps %d topk %d tokens %d%s: accept length %s, %s tok/s (x%s)%s%s",
                batch_size, ns.speculative_algorithm, steps, topk, tokens, " adaptive" if adaptive else "",
                row["accept_length"], row["output_tok_s"], row["speedup"],
                f" budgets {row.get('budgets')}" if adaptive else "",
                f" SIMULATED ({profile})" if reference else "")
    return row


def _report(args, runner, model_dir, rows: list[dict]) -> dict:
    """The JSON report: the machine, the models, the CUDA graphs and torch.compile, and every row."""
    import torch

    from splitspec.runtime.loader import DECISIVE

    cuda = runner.device.type == "cuda"
    return {"device": torch.cuda.get_device_name(runner.device) if cuda else f"cpu ({platform.processor() or platform.machine()})",
            "torch": torch.__version__, "dtype": str(runner.dtype).replace("torch.", ""),
            "attention_backend": runner.backend.name,
            "cuda_graphs": {"batch_sizes": runner.graphs.sizes, "tree_sizes": runner.graphs.tree_sizes}
            if runner.graphs else None,
            "model": (f"dummy {args.preset} (random weights)" if args.preset else str(model_dir))
            + (f"; {DECISIVE}" if args.load_format == "dummy-decisive" else ""),
            "draft": (f"dummy {args.draft_preset} (random weights)" if args.draft_preset
                      else args.speculative_draft_model_path),
            "simulated": bool(args.simulate_acceptance),
            "torch_compile": None if runner.compiled is None else {
                "mode": runner.compiled.mode, "max_bs": runner.compiled.max_bs,
                "target_compile_seconds": round(runner.compiled.total_compile_seconds, 1),
                "target_shapes": {str(k[0]): round(v, 1) for k, v in runner.compiled.compile_seconds.items()}},
            "rows": rows}


def _plain(args, runner, loads: dict, scheduler, sync: bool, overlap: bool) -> tuple[dict, dict]:
    """Plain decoding at every batch size: (batch size -> its row, batch size -> every request's output ids)."""
    plain_rows, plain_outputs = {}, {}
    for batch_size, (prompts, params, warm) in loads.items():
        drive(runner, None, None, prompts[: args.warmup_requests], batch_size, warm, scheduler, sync_phases=sync,
              overlap=overlap)
        plain_rows[batch_size], requests = drive(runner, None, None, prompts, batch_size, params, scheduler,
                                                 sync_phases=sync, overlap=overlap)
        plain_outputs[batch_size] = [r.output_ids for r in requests]
        logger.info("batch %d plain: %s tok/s, %s tok/s per request", batch_size, plain_rows[batch_size]["output_tok_s"],
                    plain_rows[batch_size]["per_request_tok_s"])
    return plain_rows, plain_outputs


def _reference(args, loads: dict, plain_outputs: dict):
    """Simulated acceptance: plain decoding's outputs (at every batch size: bf16 may differ between them) in a
    temporary JSONL file the replay drafter reads (a copy at --simulate-reference-out, for a server's)."""
    reference = tempfile.NamedTemporaryFile("w", suffix=".jsonl", prefix="splitspec-replay-", delete=False)
    for batch_size, (prompts, _, _) in loads.items():
        for prompt, output in zip(prompts, plain_outputs[batch_size]):
            reference.write(json.dumps({"prompt_ids": prompt, "output_ids": output}) + "\n")
    reference.close()
    if args.simulate_reference_out:  # for a server's --speculative-replay (benchmarks/served.py)
        shutil.copyfile(reference.name, args.simulate_reference_out)
    return reference


def run_in_process(args) -> dict:

    from splitspec.runtime.runner import ModelRunner

    _resolve_models(args)
    model_dir = model_flags.resolve_model(args)
    batch_sizes = [int(b) for b in args.batch_size.split(",")]
    sync = not args.no_phase_sync
    if args.cuda_graph_max_bs is None and not args.disable_cuda_graph:  # target and draft head: no larger graphs
        args.cuda_graph_max_bs = max(batch_sizes)
    points = grid_points(args) if args.speculative_algorithm else []
    if args.speculative_algorithm and not points:
        raise ValueError("no valid point in the grid")
    max_tree = max((tree_of(p)[2] for p in points), default=1)
    counts = {b: args.num_prompts or max(4, 2 * b) for b in batch_sizes}
    per_request = args.prompt_len + args.output_len + max_tree + 2 * args.page_size
    runner = ModelRunner.load(model_flags.runtime_config(args, model_dir,
                                                          default_max_total_tokens=max(batch_sizes) * per_request))
    engine_args.check_context([args.prompt_len], args.output_len, runner.context_length, "--output-len")
    overlap = runner.device.type == "cuda" and not args.disable_overlap_schedule  # as the served verifier's
    heap.freeze("bench")  # as the served verifier does: the same garbage collection on both sides
    # each round its own prompts, as --url's rounds; a simulated acceptance's rounds repeat the first's (its reference)
    distinct = 1 if args.simulate_acceptance else args.first_round + args.rounds
    prompts_all = make_prompts(args, None if args.preset else model_dir, runner.config.vocab_size,
                               prompts_for(counts, distinct))
    scheduler = engine_args.scheduler_config(args)
    rows, reference = [], None
    try:
        for r in range(args.rounds):
            if args.pause_before_rounds:
                _wait_for_round(r)
            at = 0 if args.simulate_acceptance else args.first_round + r
            loads = _loads(args, round_prompts(prompts_all, counts, at))
            # plain decoding at every batch size first, then each grid point at every batch size: the target's graphs
            # are captured once per point (a drafter may change what the target's forward returns)
            plain_rows, plain_outputs = _plain(args, runner, loads, scheduler, sync, overlap)
            round_rows = [{"batch_size": b, "speculative": None, **row} for b, row in plain_rows.items()]
            if args.simulate_acceptance and reference is None:
                reference = _reference(args, loads, plain_outputs)
            round_rows += _spec_points(args, runner, points, loads, scheduler, sync, overlap, plain_rows, plain_outputs,
                                       reference, max(batch_sizes) * (per_request + 64))
            rows += [{**row, "round": r} for row in round_rows] if args.rounds > 1 else round_rows
    finally:
        if reference is not None:
            Path(reference.name).unlink()
    return {**_report(args, runner, model_dir, rows), "rounds": args.rounds}


def _wait_for_round(r: int) -> None:
    """--pause-before-rounds: say so on stdout, then wait for a line on stdin (benchmarks/served.py's go)."""
    print(f"round {r} ready", flush=True)
    logger.info("round %d: waiting for a line on stdin", r)
    if not sys.stdin.readline():
        raise RuntimeError(f"stdin closed before round {r}")


def _loads(args, prompts: dict[int, list]) -> dict:
    """batch size -> (its prompts, their sampling params, the warm-up's params)."""
    from splitspec.runtime.sampling_params import SamplingParams

    return {b: (p, [SamplingParams(temperature=args.temperature, seed=i, max_new_tokens=args.output_len, ignore_eos=True)
                    for i in range(len(p))],
                [SamplingParams(temperature=args.temperature, seed=0, max_new_tokens=8, ignore_eos=True)]
                * args.warmup_requests) for b, p in prompts.items()}


def _spec_points(args, runner, points, loads: dict, scheduler, sync: bool, overlap: bool, plain_rows: dict,
                 plain_outputs: dict, reference, draft_tokens: int) -> list[dict]:
    """Every grid point (under every simulated profile, fixed and/or adaptive) at every batch size: their rows."""
    from splitspec.verifier_svc.adaptive import adaptive_policy, verify_tree_sizes

    profiles = [p.strip() for p in args.simulate_acceptance.split(";") if p.strip()] if args.simulate_acceptance else [None]
    series = {"off": [False], "on": [True], "both": [False, True]}[args.speculative_adaptive or "off"]
    batch_max = max(loads)
    rows = []
    for point, profile in itertools.product(points, profiles):
        ns = copy.copy(point)
        if reference is not None:
            ns.speculative_replay, ns.speculative_replay_profile = reference.name, profile
        settings = speculation.resolve(ns, runner.config)
        drafter = (RemoteDrafter(ns, settings, runner, draft_tokens, batch_max) if args.drafter_transport == "zmq"
                   else engine_args.in_process_drafter(settings, max_total_tokens=draft_tokens, target=runner)[0])
        try:
            for adaptive in series:
                ns.speculative_adaptive = "on" if adaptive else "off"
                spec = speculation.spec_config(dataclasses.replace(settings, adaptive=adaptive))
                policy = adaptive_policy(spec)  # one for the whole load sweep, as a server keeps one
                runner.capture_cuda_graphs(tree_nodes=verify_tree_sizes(spec))
                for batch_size, (prompts, params, warm) in loads.items():
                    drive(runner, drafter, spec, prompts[: args.warmup_requests], batch_size, warm, scheduler, policy,
                          sync_phases=sync, overlap=overlap)
                    drafter.stats.__init__()
                    row, requests = drive(runner, drafter, spec, prompts, batch_size, params, scheduler, policy,
                                          sync_phases=sync, overlap=overlap)
                    rows.append(_spec_row(args, ns, row, requests, drafter, plain_rows[batch_size],
                                          plain_outputs[batch_size], batch_size, adaptive, reference, profile))
        finally:
            runner.set_capture_layers(())
            drafter.close()
        del drafter
    return rows


# against a deployment --------------------------------------------------------------------------------
