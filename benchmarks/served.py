"""What a user gets over HTTP next to what the engine makes, in one run on one machine.

    python -P benchmarks/served.py --out served.json --load "--batch-size 1,8 --prompt-len 128 --output-len 128" \
        -- --speculative-algorithm NGRAM --device cpu

Starts `splitspec up` with the model flags after `--` (plus --serve's), measures it with
`splitspec bench --url` (streaming completions through the gateway, the verifier's gRPC stream and the
drafter processes), stops it, then runs `splitspec bench` in process with the same model flags and the same
load (--load: batch sizes, prompt and output lengths; the same prompt token ids on both sides), and writes
both reports and, for every point both measured (batch size, plain or speculative), served tok/s over in
process tok/s. --dummy-preset builds a random-weight model of a published shape (e.g. llama-3.1-8b) with the
demo tokenizer, so that the gateway can tokenize for it (its vocabulary cut to the tokenizer's).

Targets no draft fits (a dummy 8B) are measured with simulated acceptance on both sides:

    python -P benchmarks/served.py --dummy-preset llama-3.1-8b --dummy-draft-preset eagle3-llama-3.1-8b \
        --simulate-acceptance accept-length:6 --out served.json -- --speculative-algorithm EAGLE3 \
        --speculative-num-steps 5 --speculative-eagle-topk 1 --speculative-num-draft-tokens 6 --speculative-adaptive off
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from splitspec import lifeline
from splitspec.bench import git_commit

# Flags `splitspec bench` and `splitspec up` both take that describe the model; the rest of `--` goes to up only.
BENCH_MODEL_FLAGS = ("--model-path", "--load-format", "--dtype", "--device", "--speculative-algorithm",
                     "--speculative-draft-model-path", "--speculative-draft-load-format", "--speculative-num-steps",
                     "--speculative-eagle-topk", "--speculative-num-draft-tokens", "--attention-backend",
                     "--disable-cuda-graph", "--quantization", "--speculative-draft-model-revision",
                     "--max-running-requests", "--cuda-graph-max-bs", "--speculative-adaptive")
BENCH_GRID = {"--speculative-num-steps": "--steps", "--speculative-eagle-topk": "--topk",
              "--speculative-num-draft-tokens": "--num-draft-tokens"}


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--load", default="--batch-size 1,8 --prompt-len 128 --output-len 128",
                        help="`splitspec bench` flags of the load, for both sides (batch sizes, lengths, prompts).")
    parser.add_argument("--serve", action="append", default=[],
                        help="More `splitspec up` flags (e.g. --drafters 2); may be given several times.")
    parser.add_argument("--prefix-cache", default="off", choices=("off", "on"),
                        help="off (default): the served verifier runs with --disable-radix-cache, like the in-process "
                        "engine, which has none: the load sends its prompts again at every point (and its warm-up's), "
                        "which a cache would answer from memory on the served side only (plain requests; EAGLE's "
                        "recompute their prompts for the head). on: the server's default.")
    parser.add_argument("--dummy-preset", default=None,
                        help="A random-weight target of this shape (splitspec.model_shapes) with the demo tokenizer.")
    parser.add_argument("--dummy-draft-preset", default=None,
                        help="With --dummy-preset: a random-weight draft head of this shape (e.g. eagle3-llama-3.1-8b) for "
                        "the dummy target (its vocabulary cut to the same tokenizer's).")
    parser.add_argument("--simulate-acceptance", default=None, metavar="PROFILE",
                        help="Simulated speculation (the rows say so): the in-process side runs first with `splitspec bench "
                        "--simulate-acceptance PROFILE` and records plain decoding's outputs, the served side replays them "
                        "(`up --speculative-replay`), drafts accepted per PROFILE on both sides; a dummy target loads as "
                        "--load-format dummy-decisive on both.")
    parser.add_argument("--rounds", type=int, default=1,
                        help="The served side's `splitspec bench --url --rounds`: plain and speculative alternate N times at "
                        "each batch size, and served_speedup is the median of the rounds' paired ratios (the host's "
                        "drift weighs on both alike). The in-process side runs each point once. Not with "
                        "--simulate-acceptance (each round sends new prompts, which the replayed reference lacks).")
    parser.add_argument("--port", type=int, default=31000, help="The gateway's port (up takes the next four too).")
    parser.add_argument("--timeout", type=float, default=900, help="Seconds for each of the three steps.")
    parser.add_argument("--log-level", default="warning", help="The services' log level (their logs go to OUT.log).")
    parser.add_argument("--out", required=True, help="The JSON report.")
    if "--" in argv:
        at = argv.index("--")
        return parser.parse_args(argv[:at]), argv[at + 1:]
    return parser.parse_args(argv), []


def dummy_with_demo_tokenizer(preset: str) -> Path:
    """The preset's config (vocabulary cut to the demo tokenizer's; an EAGLE head's draft vocabulary too) beside
    the demo target's tokenizer files."""
    from splitspec.demo import demo_model_dirs
    from splitspec.model_shapes import PRESETS

    target = demo_model_dirs()["target"]
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    folder = Path(tempfile.mkdtemp(prefix=f"splitspec-served-{preset}-"))
    config = {**PRESETS[preset], "vocab_size": vocab}
    if "draft_vocab_size" in config:
        config["draft_vocab_size"] = min(config["draft_vocab_size"], vocab)
    for key in ("bos_token_id", "eos_token_id"):
        config[key] = json.loads((target / "config.json").read_text()).get(key)
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (target / name).is_file():
            shutil.copy(target / name, folder / name)
    return folder


def bench_flags(model_flags: list[str]) -> list[str]:
    """The model flags `splitspec bench` takes (its grid flags under their bench names)."""
    out, i = [], 0
    while i < len(model_flags):
        flag = model_flags[i].split("=", 1)[0]
        inline = "=" in model_flags[i]
        value = None if inline or i + 1 >= len(model_flags) or model_flags[i + 1].startswith("--") else model_flags[i + 1]
        if flag == "--speculative-algorithm" and (value or model_flags[i].split("=", 1)[-1]).lower() == "none":
            pass  # `up`'s plain serving; `splitspec bench` without an algorithm measures plain decoding only
        elif flag in BENCH_MODEL_FLAGS:
            name = BENCH_GRID.get(flag, flag)
            out += [f"{name}={model_flags[i].split('=', 1)[1]}"] if inline else [name, *([value] if value else [])]
        i += 1 if inline or value is None else 2
    return out


def server_adaptive(model_flags: list[str]) -> list[str]:
    """`splitspec bench` runs fixed trees unless told; the server's --speculative-adaptive defaults to auto (on where
    the target runs on a GPU). The in-process side gets the server's resolved setting, so that both sides run the same
    policy: [] where the flags name it or nothing speculates."""
    names = [f.split("=", 1)[0] for f in model_flags]
    speculates = "--speculative-algorithm" in [f.split("=", 1)[0] for f in bench_flags(model_flags)]  # not `none`
    if "--speculative-adaptive" in names or not speculates:
        return []
    from splitspec.speculation import adaptive_enabled

    device = model_flags[names.index("--device") + 1] if "--device" in model_flags else "auto"
    on = adaptive_enabled("auto", device)
    return ["--speculative-adaptive", "on" if on else "off"]


def descendants(pid: int) -> list[int]:
    """Every process below pid (Linux /proc; `up` starts each service in a session of its own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], list(children.get(pid, []))
    while todo:
        out.append(todo.pop())
        todo += children.get(out[-1], [])
    return out


def service_name(argv: list[str]) -> str:
    """A service's name from its command line: `python -m splitspec gateway ...` -> gateway, `python -m
    splitspec.verifier_svc.front_process ...` -> front_process."""
    if "-m" in argv[:-1]:
        module = argv[argv.index("-m") + 1]
        rest = argv[argv.index("-m") + 2:]
        return rest[0] if module == "splitspec" and rest else module.rsplit(".", 1)[-1]
    return Path(argv[0]).name if argv else "?"


def process_cpu(pids: list[int]) -> dict[int, tuple[str, float]]:
    """{pid: (service name, CPU seconds so far: user + system)} of these processes (Linux /proc)."""
    ticks, out = os.sysconf("SC_CLK_TCK"), {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            argv = [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
        except OSError:
            continue
        out[pid] = (service_name(argv), (int(fields[11]) + int(fields[12])) / ticks)
    return out


def cpu_report(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], wall: float,
               requests: int) -> dict:
    """Each service's CPU over the timed served run, summed over its processes: seconds, the share of the run's wall
    time (near 1.0 per process: that process was the queue) and per request."""
    out: dict[str, dict] = {}
    for pid, (name, seconds) in after.items():
        entry = out.setdefault(name, {"processes": 0, "cpu_s": 0.0})
        entry["processes"] += 1
        entry["cpu_s"] += seconds - before.get(pid, (name, 0.0))[1]
    for entry in out.values():
        entry["cpu_s"] = round(entry["cpu_s"], 2)
        entry["share_of_wall"] = round(entry["cpu_s"] / wall, 3) if wall else None
        entry["per_request_ms"] = round(1e3 * entry["cpu_s"] / requests, 3) if requests else None
    return out


def wait_ready(url: str, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"splitspec up exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"splitspec up not ready after {timeout} s")


def free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def traced(side: str) -> dict[str, str] | None:
    """The environment of one side's processes: with SPLITSPEC_ADAPTIVE_TRACE=PREFIX, each side's adaptive
    policy writes PREFIX.<side>.jsonl (verifier_svc.adaptive), not both into one file; else None (inherited)."""
    from splitspec.verifier_svc.adaptive_estimates import TRACE_ENV

    prefix = os.environ.get(TRACE_ENV)
    return {**os.environ, TRACE_ENV: f"{prefix}.{side}.jsonl"} if prefix else None


def bench(argv: list[str], out: Path, timeout: float, log, env: dict[str, str] | None = None) -> dict:
    command = [sys.executable, "-P", "-m", "splitspec", "bench", "--log-level", "info", *argv, "--out", str(out)]
    print("$ " + shlex.join(command[2:]), file=log, flush=True)
    client = lifeline.spawn(command, stdout=subprocess.DEVNULL, stderr=log, env=env)
    try:
        code = client.wait(timeout=timeout)
    except subprocess.TimeoutExpired:  # the client's own stacks and tasks first (cli's SIGUSR1, SIGUSR2), then the services'
        print(f"the bench client timed out after {timeout} s: its stacks and tasks follow", file=log, flush=True)
        client.send_signal(signal.SIGUSR1)
        time.sleep(1)
        client.send_signal(signal.SIGUSR2)
        time.sleep(2)
        client.kill()
        client.wait()
        raise
    if code != 0:
        raise RuntimeError(f"splitspec bench exited with {code} (see the log)")
    return json.loads(out.read_text())


class HostSpeed:
    """The machine's CPU speed while a side runs: a thread of this (otherwise waiting) process times a fixed
    plain-Python loop (splitspec.step_log.calibration_us) every `period` seconds. On a lent VM it moved by 2x within a
    minute, between runs and within one (docs/performance.md, 2026-12-02), so a host-bound point's served/in-process
    ratio compares CPUs as much as code unless both sides' speeds are alike; the report carries both."""

    def __init__(self, period: float = 0.1):
        import threading

        self.period, self.samples, self.times, self.stop = period, [], [], threading.Event()
        self.thread = threading.Thread(target=self._run, name="host-speed", daemon=True)

    def _run(self) -> None:
        from splitspec.step_log import calibration_us

        while not self.stop.wait(self.period):
            self.samples.append(calibration_us())
            self.times.append(time.perf_counter())

    def __enter__(self) -> "HostSpeed":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()

    def during(self, windows: list[list[float]] | None) -> float | None:
        """The median sample taken within a bench row's windows (its rounds' windows_s, else its window_s;
        perf_counter is the system's monotonic clock, the same in the bench's process as in this one); None without
        samples there."""
        import statistics

        inside = [us for us, at in zip(self.samples, self.times)
                  if any(w[0] <= at <= w[1] for w in windows or [])]
        return round(statistics.median(inside), 1) if inside else None

    def mark_rows(self, report: dict) -> None:
        """Each row of a bench report gets host_us: the machine's speed while that point ran."""
        for row in report.get("rows", []):
            row["host_us"] = self.during(row.get("windows_s") or ([row["window_s"]] if row.get("window_s") else None))

    def report(self) -> dict:
        import statistics

        if not self.samples:
            return {"samples": 0}
        q = statistics.quantiles(self.samples, n=10) if len(self.samples) > 1 else [self.samples[0]] * 9
        return {"samples": len(self.samples), "median_us": round(statistics.median(self.samples), 1),
                "p10_us": round(q[0], 1), "p90_us": round(q[-1], 1)}


def loop_totals(metrics_url: str) -> dict[str, float]:
    """The verifier's engine-loop and step-phase histograms' sums and counts, by part and phase."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in ("splitspec:engine_loop_seconds", "splitspec:step_phase_seconds"):
            continue
        for sample in family.samples:
            if sample.name.endswith(("_sum", "_count")):
                key = f"{sample.labels.get('part') or sample.labels.get('phase')}{sample.name[sample.name.rindex('_'):]}"
                totals[key] = totals.get(key, 0.0) + sample.value
    return totals


def loop_report(before: dict[str, float], after: dict[str, float]) -> dict:
    """Per busy loop iteration (one engine step) over the served bench: mean ms of each part and phase."""
    steps = after.get("step_count", 0.0) - before.get("step_count", 0.0)
    names = sorted({k.rsplit("_", 1)[0] for k in after if k.endswith("_sum")})
    return {"steps": int(steps), "mean_ms": {name: round((after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0))
                                                          / steps * 1e3, 4) if steps else None for name in names}}


def ratios(served: dict, in_process: dict) -> list[dict]:
    def key(row: dict) -> tuple[int, bool]:
        return row["batch_size"], row["speculative"] is not None

    inside = {}
    speedups = {row["batch_size"]: row.get("speedup") for row in served["rows"] if row["speculative"] is not None}
    for row in in_process["rows"]:  # the first grid point's rows (served runs the server's one tree)
        inside.setdefault(key(row), row)
    out = []
    for row in served["rows"]:
        twin = inside.get(key(row))
        if twin is None:
            continue
        out.append({"batch_size": row["batch_size"], "speculative": row["speculative"],
                    "served_tok_s": row["output_tok_s"], "in_process_tok_s": twin["output_tok_s"],
                    "served_over_in_process": round(row["output_tok_s"] / twin["output_tok_s"], 3)
                    if twin["output_tok_s"] else None,
                    "served_accept_length": row.get("accept_length"), "in_process_accept_length": twin.get("accept_length"),
                    "served_errors": len(row.get("errors") or []),
                    # the host's speed during each side's point (HostSpeed, median us of its loop; lower is faster)
                    "host_us": {"served": row.get("host_us"), "in_process": twin.get("host_us")}})
    for row in out:  # speculation's gain as each side sees it
        plain = next((r for r in out if r["batch_size"] == row["batch_size"] and r["speculative"] is None), None)
        if row["speculative"] is not None and plain is not None:
            # the served bench's own (with --rounds, the median of its rounds' paired ratios)
            row["served_speedup"] = speedups.get(row["batch_size"]) or (
                round(row["served_tok_s"] / plain["served_tok_s"], 3) if plain["served_tok_s"] else None)
            row["in_process_speedup"] = (round(row["in_process_tok_s"] / plain["in_process_tok_s"], 3)
                                         if plain["in_process_tok_s"] else None)
    return out


def model_flags_of(args, model_flags: list[str]) -> list[str]:
    """The flags after `--`, with the dummy target (and head) --dummy-preset / --dummy-draft-preset build; a
    simulated run's dummy target loads decisive."""
    if args.dummy_draft_preset and not args.dummy_preset:
        raise SystemExit("--dummy-draft-preset needs --dummy-preset (a head for the dummy target)")
    if args.dummy_preset:
        model_flags = ["--model-path", str(dummy_with_demo_tokenizer(args.dummy_preset)), "--load-format", "dummy",
                       *model_flags]
    if args.dummy_draft_preset:
        model_flags += ["--speculative-draft-model-path", str(dummy_with_demo_tokenizer(args.dummy_draft_preset)),
                        "--speculative-draft-load-format", "dummy"]
    if args.simulate_acceptance:
        if "--speculative-algorithm" not in model_flags:
            raise SystemExit("--simulate-acceptance needs a --speculative-algorithm whose drafter pays the draft cost")
        model_flags = ["dummy-decisive" if flag == "dummy" and i and model_flags[i - 1] == "--load-format" else flag
                       for i, flag in enumerate(model_flags)]
    return model_flags


def serve_and_bench(args, model_flags: list[str], model_path: str, load: list[str], work: Path, log,
                    replay: Path | None) -> dict:
    """`splitspec up` measured by `splitspec bench --url` (after an untimed warm-up); up stopped after."""
    if not free(args.port):
        raise SystemExit(f"port {args.port} is taken")
    simulated = (["--speculative-replay", str(replay), "--speculative-replay-profile", args.simulate_acceptance]
                 if replay is not None else [])
    up_command = [sys.executable, "-P", "-m", "splitspec", "up", "--port", str(args.port), "--log-level", args.log_level,
                  *(flag for serve in args.serve for flag in shlex.split(serve)), *model_flags, *simulated,
                  *(["--disable-radix-cache"] if args.prefix_cache == "off" else [])]
    print("$ " + shlex.join(up_command[2:]), file=log, flush=True)
    up = lifeline.spawn(up_command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=traced("served"))
    url = f"http://127.0.0.1:{args.port}"
    try:
        wait_ready(url, up, args.timeout)
        metrics_url = f"http://127.0.0.1:{args.port + 2}/metrics"  # the verifier's (up: the gateway's port + 2)
        # untimed: the same points with short outputs, so that one-time work (FlashInfer's JIT, the first
        # shapes) is neither in the served figures nor in the engine-loop means below
        bench(["--url", url, "--model-path", model_path, *load, "--output-len", "16"], work / "warmup.json", args.timeout,
              log)
        before, pids = loop_totals(metrics_url), descendants(up.pid)
        cpu_before, started = process_cpu(pids), time.perf_counter()
        with HostSpeed() as speed:
            served = bench(["--url", url, "--model-path", model_path, *load, "--rounds", str(args.rounds)],
                           work / "served.json", args.timeout, log)
        wall, requests = time.perf_counter() - started, sum(row.get("requests", 0) for row in served.get("rows", []))
        served["process_cpu"] = cpu_report(cpu_before, process_cpu(pids), wall, requests)  # is one process the queue?
        served["engine_loop"] = loop_report(before, loop_totals(metrics_url))  # the served verifier's steps
        served["host_speed"] = speed.report()
        speed.mark_rows(served)
        return served
    except subprocess.TimeoutExpired:  # stuck: every service prints its threads' stacks (cli's SIGUSR1) to the log
        print(f"served bench timed out after {args.timeout} s: the services' stacks follow", file=log, flush=True)
        for pid in descendants(up.pid):  # threads (faulthandler), then the event loops' tasks
            for sig in (signal.SIGUSR1, signal.SIGUSR2):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        time.sleep(3)
        raise
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=120)
        except subprocess.TimeoutExpired:
            up.kill()


def main(argv: list[str]) -> int:
    args, model_flags = parse_args(argv)
    if args.rounds > 1 and args.simulate_acceptance:
        # each served round sends its own prompts, and the replayed reference holds the in-process side's only
        raise SystemExit("--rounds > 1 with --simulate-acceptance: the later rounds' prompts have no recorded outputs "
                         "to replay (their drafts would be rejected); measure simulated points with --rounds 1")
    out = Path(args.out)
    work = Path(tempfile.mkdtemp(prefix="splitspec-served-"))
    model_flags = model_flags_of(args, model_flags)
    if "--model-path" in model_flags:
        model_path = model_flags[model_flags.index("--model-path") + 1]
    else:  # up and bench both serve the demo target (and its demo draft); bench --url tokenizes with its tokenizer
        from splitspec.demo import demo_model_dirs

        model_path = str(demo_model_dirs()["target"])
    load = shlex.split(args.load)
    log = open(out.with_suffix(".log"), "w")
    # the engine as the server runs it: no device synchronisation at every phase boundary
    in_process_argv = [*bench_flags(model_flags), *server_adaptive(model_flags), "--no-phase-sync", *load]
    replay = None
    speed = HostSpeed()
    if args.simulate_acceptance:  # in process first: its plain outputs are the reference the server replays
        replay = work / "reference.jsonl"
        in_process_argv += ["--simulate-acceptance", args.simulate_acceptance, "--simulate-reference-out", str(replay)]
        with speed:
            in_process = bench(in_process_argv, work / "in_process.json", args.timeout, log, traced("in_process"))
        served = serve_and_bench(args, model_flags, model_path, load, work, log, replay)
    else:
        served = serve_and_bench(args, model_flags, model_path, load, work, log, None)
        with speed:
            in_process = bench(in_process_argv, work / "in_process.json", args.timeout, log, traced("in_process"))
    in_process["host_speed"] = speed.report()  # the whole in-process run (its model load included)
    speed.mark_rows(in_process)
    report = {"benchmark": "served vs in process", "command": "python -P benchmarks/served.py " + shlex.join(argv),
              "commit": git_commit(), "device": in_process.get("device"), "model_flags": model_flags, "load": load,
              "simulated": args.simulate_acceptance,
              "points": ratios(served, in_process), "served_engine_loop": served.get("engine_loop"),
              # a fixed plain-Python loop's time on this machine while each side ran (HostSpeed): compare ratios of
              # host-bound points only where the two are alike
              "host_speed": {"served": served.get("host_speed"), "in_process": in_process.get("host_speed")},
              "served_process_cpu": served.get("process_cpu"),
              "served": served, "in_process": in_process}
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"served engine loop: {report['served_engine_loop']}")
    print(f"host speed (plain-Python loop, us): {report['host_speed']}")
    print(f"served services' CPU over the timed run: {report['served_process_cpu']}")
    for point in report["points"]:
        print(f"batch {point['batch_size']:>3} {point['speculative'] or 'plain':<8} served {point['served_tok_s']:>9} "
              f"in process {point['in_process_tok_s']:>9} tok/s  served/in process {point['served_over_in_process']}"
              + (f"  accept length served {point['served_accept_length']} in process {point['in_process_accept_length']}"
                 if point["speculative"] else "")
              + f"  host us served {point['host_us']['served']} in process {point['host_us']['in_process']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
