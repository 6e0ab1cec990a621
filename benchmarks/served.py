"""What a user gets over HTTP next to what the engine makes, in one run on one machine.

    python -P benchmarks/served.py --out served.json --load "--batch-size 1,8 --prompt-len 128 --output-len 128" \
        -- --speculative-algorithm NGRAM --device cpu

Loads the model in a `splitspec bench` process (in process, waiting between rounds), starts `splitspec up` with
the model flags after `--` (plus --serve's) and measures both in rounds (--rounds): the in-process round, then the
served one with `splitspec bench --url` (streaming completions through the gateway, the verifier's gRPC stream and
the drafter processes), with the same model flags and the same load (--load: batch sizes, prompt and output
lengths; the same prompt token ids on both sides); stops up, and writes both reports and, for every point both
measured (batch size, plain or speculative), served tok/s over in process tok/s. --dummy-preset builds a
random-weight model of a published shape (e.g. llama-3.1-8b) with the demo tokenizer, so that the gateway can
tokenize for it (its vocabulary cut to the tokenizer's).

Targets no draft fits (a dummy 8B) are measured with simulated acceptance on both sides:

    python -P benchmarks/served.py --dummy-preset llama-3.1-8b --dummy-draft-preset eagle3-llama-3.1-8b \
        --simulate-acceptance accept-length:6 --out served.json -- --speculative-algorithm EAGLE3 \
        --speculative-num-steps 5 --speculative-eagle-topk 1 --speculative-num-draft-tokens 6 --speculative-adaptive off
"""

from __future__ import annotations

import argparse
import atexit
import functools
import json
import os
import queue
import resource
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from splitspec import lifeline
from splitspec.bench import build_parser, git_commit

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run with -P: this folder is not on the path by itself
from served_measure import (HostSpeed, cpu_report, descendants, loop_report, loop_totals,  # noqa: E402
                            process_cpu, ratios)

# The flags after `--` go to `splitspec up`; those `splitspec bench` also takes (the model, the engine, speculation:
# its parser's options) go to the in-process side too, but for the ones that shape the load or the run, which this
# script sets for both sides itself. (A fixed list of model flags once left --prompt-cuda-graph-max-tokens out: the
# in-process side of a served comparison ran without the prompt graphs the server had.)
BENCH_RUN_FLAGS = {"--batch-size", "--num-prompts", "--prompt-len", "--output-len", "--rounds", "--out", "--url",
                   "--first-round", "--pause-before-rounds", "--dataset", "--temperature", "--seed", "--warmup-requests",
                   "--no-phase-sync", "--simulate-acceptance", "--simulate-reference-out", "--api-key", "--help",
                   "--log-level", "--preset", "--draft-preset"}
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
                        help="Measure both sides N times, alternating: in-process round 0, served round 0, in-process round "
                        "1, ... (the in-process bench keeps its model loaded and waits between its rounds; the server stays "
                        "up), each round with its own prompts on both sides (a simulated acceptance's rounds repeat the "
                        "first's). A point's served_over_in_process is the median of its rounds' paired ratios, and each "
                        "side's speedup the median of its rounds' speculative over plain: a host whose speed drifts over "
                        "minutes (a lent VM's moved 2x) weighs on both sides of a pair alike.")
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
    atexit.register(shutil.rmtree, folder, True)
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


@functools.cache
def bench_model_flags() -> frozenset[str]:
    """The options of `splitspec bench`'s parser that describe the model and the engine (not the load or the run)."""
    return frozenset(name for name in build_parser()._option_string_actions if name.startswith("--")) - BENCH_RUN_FLAGS


def bench_flags(model_flags: list[str]) -> list[str]:
    """The model flags `splitspec bench` takes (its grid flags under their bench names)."""
    known = bench_model_flags()
    out, i = [], 0
    while i < len(model_flags):
        flag = model_flags[i].split("=", 1)[0]
        inline = "=" in model_flags[i]
        value = None if inline or i + 1 >= len(model_flags) or model_flags[i + 1].startswith("--") else model_flags[i + 1]
        if flag == "--speculative-algorithm" and (value or model_flags[i].split("=", 1)[-1]).lower() == "none":
            pass  # `up`'s plain serving; `splitspec bench` without an algorithm measures plain decoding only
        elif flag in known:
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


def dump_and_kill(process: subprocess.Popen, what: str, timeout: float, log) -> None:
    """A stuck bench process: its threads' stacks and its tasks into the log (cli's SIGUSR1, SIGUSR2), then it goes."""
    print(f"{what} timed out after {timeout} s: its stacks and tasks follow", file=log, flush=True)
    for sig in (signal.SIGUSR1, signal.SIGUSR2):
        process.send_signal(sig)
        time.sleep(1)
    time.sleep(1)
    process.kill()
    process.wait()


def bench(argv: list[str], out: Path, timeout: float, log, env: dict[str, str] | None = None) -> dict:
    command = [sys.executable, "-P", "-m", "splitspec", "bench", "--log-level", "info", *argv, "--out", str(out)]
    print("$ " + shlex.join(command[2:]), file=log, flush=True)
    client = lifeline.spawn(command, stdout=subprocess.DEVNULL, stderr=log, env=env)
    try:
        code = client.wait(timeout=timeout)
    except subprocess.TimeoutExpired:  # the client's own stacks first, then (serve_rounds) the services'
        dump_and_kill(client, "the bench client", timeout, log)
        raise
    if code != 0:
        raise RuntimeError(f"splitspec bench exited with {code} (see the log)")
    return json.loads(out.read_text())


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


class InProcess:
    """`splitspec bench` in process as one process for every round (--pause-before-rounds): it loads the model once and
    runs each round when told, so that its rounds interleave with the served ones."""

    def __init__(self, argv: list[str], out: Path, log, env: dict[str, str] | None, timeout: float):
        self.out, self.log, self.timeout = out, log, timeout
        command = [sys.executable, "-P", "-m", "splitspec", "bench", "--log-level", "info", *argv, "--pause-before-rounds",
                   "--out", str(out)]
        print("$ " + shlex.join(command[2:]), file=log, flush=True)
        self.process = lifeline.spawn(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env,
                                      text=True)
        self.said: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, name="in-process-stdout", daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:  # `round K ready` lines, then the report (also written to --out)
            if line.startswith("round ") and line.rstrip().endswith(" ready"):
                self.said.put(line.strip())
        self.said.put("")  # exited

    def wait(self) -> None:
        """Until it waits for its next round (its model loaded, or the last round done) or, after its last round, has
        exited with its report written."""
        try:
            line = self.said.get(timeout=self.timeout)
        except queue.Empty:
            dump_and_kill(self.process, "the in-process bench", self.timeout, self.log)
            raise subprocess.TimeoutExpired("splitspec bench", self.timeout) from None
        if not line and self.process.wait() != 0:
            raise RuntimeError(f"the in-process splitspec bench exited with {self.process.returncode} (see the log)")

    def run_round(self) -> None:
        self.process.stdin.write("\n")
        self.process.stdin.flush()
        self.wait()

    def report(self) -> dict:
        self.process.wait(timeout=self.timeout)
        return json.loads(self.out.read_text())

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def serve_rounds(args, model_flags: list[str], model_path: str, load: list[str], work: Path, log, replay: Path | None,
                 inside: InProcess) -> dict:
    """`splitspec up` measured by `splitspec bench --url` (after an untimed warm-up), round after round, each served
    round right after the in-process side's round of the same prompts (simulated: the first in-process round ran
    before, to record the reference); up stopped after."""
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
        # shapes) is neither in the served figures nor in the engine-loop means below; on prompts no round sends (a
        # drafter that learns from what it served, NGRAM's trie, would otherwise know the first round's answers'
        # beginnings), except simulated, whose rounds all send the reference's
        bench(["--url", url, "--model-path", model_path, *load, "--output-len", "16",
               "--first-round", str(0 if replay is not None else args.rounds)], work / "warmup.json", args.timeout, log)
        before, pids = loop_totals(metrics_url), descendants(up.pid)
        spent, wall, reports = {}, 0.0, []
        for r in range(args.rounds):
            if replay is None or r:
                inside.run_round()
            cpu_before, started = process_cpu(pids), time.perf_counter()
            client_before = resource.getrusage(resource.RUSAGE_CHILDREN)  # the load's client: the child waited for
            reports.append(bench(["--url", url, "--model-path", model_path, *load,
                                  "--first-round", str(0 if replay is not None else r)], work / f"served_{r}.json",
                                 args.timeout, log))
            wall += time.perf_counter() - started
            client = resource.getrusage(resource.RUSAGE_CHILDREN)
            spent[-1] = ("bench_client", spent.get(-1, ("", 0.0))[1] + client.ru_utime + client.ru_stime
                         - client_before.ru_utime - client_before.ru_stime)
            for pid, (name, seconds) in process_cpu(pids).items():  # the services' CPU in the served rounds only
                spent[pid] = (name, spent.get(pid, (name, 0.0))[1] + seconds - cpu_before.get(pid, (name, seconds))[1])
        served = {**reports[0], "rounds": args.rounds,
                  "rows": [{**row, "round": r} if args.rounds > 1 else row for r, report in enumerate(reports)
                           for row in report["rows"]]}
        requests = sum(row.get("requests", 0) for row in served["rows"])
        served["process_cpu"] = cpu_report({}, spent, wall, requests)  # is one process the queue?
        served["engine_loop"] = loop_report(before, loop_totals(metrics_url))  # the served verifier's steps
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
    commit = git_commit()  # the code that runs: a commit made while it runs is not it
    if args.rounds < 1:
        raise SystemExit("--rounds: at least 1")
    out = Path(args.out)
    work = Path(tempfile.mkdtemp(prefix="splitspec-served-"))  # each side's reports, merged into --out
    atexit.register(shutil.rmtree, work, True)
    model_flags = model_flags_of(args, model_flags)
    if "--model-path" in model_flags:
        model_path = model_flags[model_flags.index("--model-path") + 1]
    else:  # up and bench both serve the demo target (and its demo draft); bench --url tokenizes with its tokenizer
        from splitspec.demo import demo_model_dirs

        model_path = str(demo_model_dirs()["target"])
    load = shlex.split(args.load)
    log = open(out.with_suffix(".log"), "w")
    # the engine as the server runs it: no device synchronisation at every phase boundary
    in_process_argv = [*bench_flags(model_flags), *server_adaptive(model_flags), "--no-phase-sync", *load,
                       "--rounds", str(args.rounds)]
    replay = None
    if args.simulate_acceptance:  # its plain outputs are the reference the server replays
        replay = work / "reference.jsonl"
        in_process_argv += ["--simulate-acceptance", args.simulate_acceptance, "--simulate-reference-out", str(replay)]
    with HostSpeed() as speed:
        inside = InProcess(in_process_argv, work / "in_process.json", log, traced("in_process"), args.timeout)
        try:
            inside.wait()  # loaded first: a server on the same GPU sizes its KV cache from the memory left
            if replay is not None:
                inside.run_round()  # round 0 records the reference before the server starts
            served = serve_rounds(args, model_flags, model_path, load, work, log, replay, inside)
            in_process = inside.report()
        finally:
            inside.close()
    for side in (served, in_process):  # each row's host speed while it ran; each side's over its rows
        speed.mark_rows(side)
        side["host_speed"] = speed.report([row["window_s"] for row in side["rows"] if row.get("window_s")])
    report = {"benchmark": "served vs in process", "command": "python -P benchmarks/served.py " + shlex.join(argv),
              "commit": commit, "device": in_process.get("device"), "model_flags": model_flags, "load": load,
              "simulated": args.simulate_acceptance, "rounds": args.rounds,
              "points": ratios(served, in_process), "served_engine_loop": served.get("engine_loop"),
              # a fixed plain-Python loop's time on this machine while each side ran (HostSpeed): compare ratios of
              # host-bound points only where the two are alike
              "host_speed": {"served": served.get("host_speed"), "in_process": in_process.get("host_speed")},
              # each service's CPU over the served rounds, and the load's client's (bench_client: its start included)
              "served_process_cpu": served.get("process_cpu"),
              "served": served, "in_process": in_process}
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"served engine loop: {report['served_engine_loop']}")
    print(f"host speed (plain-Python loop, us): {report['host_speed']}")
    print(f"served services' and client's CPU over the timed rounds: {report['served_process_cpu']}")
    for point in report["points"]:
        print(f"batch {point['batch_size']:>3} {point['speculative'] or 'plain':<8} served {point['served_tok_s']:>9} "
              f"in process {point['in_process_tok_s']:>9} tok/s  served/in process {point['served_over_in_process']}"
              + (f" (rounds {[r['ratio'] for r in point['rounds']]})" if point.get("rounds") else "")
              + (f"  accept length served {point['served_accept_length']} in process {point['in_process_accept_length']}"
                 f"  drafted token share served {point['served_drafted_token_share']} in process "
                 f"{point['in_process_drafted_token_share']}" if point["speculative"] else "")
              + f"  host us served {point['host_us']['served']} in process {point['host_us']['in_process']}"
              + f"  client CPU share {point['served_client_cpu_share']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
