"""docs/flags.md is the parsers' current output; the benchmark script runs and reports JSON."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from splitspec import lifeline


REPO = Path(__file__).resolve().parent.parent


def test_flag_reference_is_current():
    from splitspec.flagdoc import render

    assert (REPO / "docs" / "flags.md").read_text() == render(), "regenerate: python -m splitspec.flagdoc > docs/flags.md"


def test_every_command_flag_has_help():
    from splitspec.cli import COMMANDS, load_command

    for name in COMMANDS:
        parser = load_command(name).build_parser()
        for action in parser._actions:
            assert action.help and action.help.strip(), f"splitspec {name} {action.option_strings}: no help"
        assert "--help" in parser.format_help()  # `--help` renders (a bare % in a help text breaks argparse's formatting)


def test_cli_lists_commands_and_refuses_unknown():
    ok = lifeline.run([sys.executable, "-P", "-m", "splitspec", "--help"], capture_output=True, text=True)
    assert ok.returncode == 0 and "generate" in ok.stdout
    bad = lifeline.run([sys.executable, "-P", "-m", "splitspec", "frobnicate"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown command 'frobnicate'" in bad.stderr


def test_a_service_answers_help_and_a_bad_flag_without_importing_torch():
    """`splitspec verifier|drafter|generate|train --help`, and a misspelt flag, parse before anything imports torch
    (it took ~3 s a `--help`): a service's flags come from its flags module (cli.FLAGS), the trainers' settings from
    train/configs.py; the usage is the parser's."""
    from splitspec.cli import FLAGS, load_command, load_flags

    probe = ("import sys\nfrom splitspec import cli\ntry:\n    cli.main(sys.argv[1:])\nexcept SystemExit as e:\n"
             "    print('exit', e.code, 'torch' in sys.modules, file=sys.stderr)")
    for argv in [[name] for name in FLAGS] + [["train", "eagle3"], ["train", "lm"]]:
        for extra, code in (["--help"], 0), (["--no-such-flag"], 2):
            ran = lifeline.run([sys.executable, "-P", "-c", probe, *argv, *extra], capture_output=True, text=True,
                               timeout=60)
            assert ran.stderr.strip().endswith(f"exit {code} False"), (argv, extra, ran.stderr[-2000:])
            assert f"usage: splitspec {' '.join(argv)}" in (ran.stdout if code == 0 else ran.stderr)
    for name in FLAGS:
        assert load_command(name).build_parser().format_help() == load_flags(name).build_parser().format_help()


def test_readme_main_command_runs():
    """The README's main command, as written there minus the set-up wrapper (the suite runs in it) and on
    a free port: `splitspec up` serves the demo models with no --model-path; the curl and the openai
    examples it prints, run as printed, get completions; Ctrl-C stops it."""
    import re
    import shlex

    from test_launcher import Up

    readme = (REPO / "README.md").read_text()
    block = readme.split("```bash\nbash scripts/run.sh up", 1)[1].split("```", 1)[0]
    flags = shlex.split(block.replace("\\\n", " "))
    assert "--model-path" not in flags and "--model" not in flags
    up = Up(*flags)
    try:
        up.wait_for_line(r"serving splitspec-demo at ")
        lines = up.lines[next(i for i, line in enumerate(up.lines) if "serving splitspec-demo at " in line):]
        curl = next(i for i, line in enumerate(lines) if line.strip().startswith("curl "))
        command = lines[curl].strip() + "\n" + lines[curl + 1].strip()  # printed on two lines, joined by a backslash
        answer = lifeline.run(["bash", "-c", command], capture_output=True, text=True, timeout=300)
        assert answer.returncode == 0, answer.stderr
        reply = json.loads(answer.stdout)
        assert reply["object"] == "chat.completion" and reply["choices"][0]["message"]["content"], reply
        assert reply["speculative"]["algorithm"] == "NGRAM", reply  # the demo speculates with NGRAM by default
        python = next(line.strip() for line in lines if line.strip().startswith("python -c "))
        code = shlex.split(python)[2]
        printed = lifeline.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        assert printed.returncode == 0 and printed.stdout.strip(), printed.stderr
        assert re.search(r"Ctrl-C stops everything", "\n".join(lines))
    finally:
        code = up.stop()
    assert code == 0 and up.lines[-1].endswith("all services stopped")


def test_readme_is_one_screen_and_every_relative_link_in_the_docs_resolves():
    """The README stays a page (what it is, the two commands, the API, links); the details live in docs/, and
    every relative link there and in the README points at a file that exists."""
    import re

    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    for name in ("lifecycle.md", "algorithms.md", "deploy.md", "performance.md", "flags.md"):
        assert f"](docs/{name}" in readme, name
    broken = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if not target.startswith(("http://", "https://")) and not (page.parent / target).exists():
                broken.append(f"{page.name}: {target}")
    assert not broken, broken


def test_decode_benchmark_reports_json(tmp_path):
    out = tmp_path / "bench.json"
    result = lifeline.run([sys.executable, str(REPO / "benchmarks" / "decode.py"), "--quick", "--batch-sizes", "1,3",
                             "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["model"]["weights"] == "dummy (random)"
    assert [row["batch_size"] for row in report["results"]] == [1, 3]
    for row in report["results"]:
        assert row["decode_s"] > 0 and math.isfinite(row["decode_tok_s"]) and row["decode_tok_s"] > 0
        assert len(row["runs"]) == 1 and row["new_tokens"] == 6


def test_speculative_benchmark_reports_json(tmp_path):
    out = tmp_path / "spec.json"
    result = lifeline.run([sys.executable, str(REPO / "benchmarks" / "speculative_cpu.py"), "--num-prompts", "2",
                             "--new-tokens", "12", "--batch-sizes", "1,2", "--transports", "inprocess,zmq", "--out", str(out)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    rows = json.loads(out.read_text())["results"]
    assert [(r["batch_size"], r["speculative"], r["drafter"]) for r in rows] == [
        (1, None, None), (1, "NGRAM", "inprocess"), (1, "NGRAM", "zmq"), (2, None, None), (2, "NGRAM", "inprocess"), (2, "NGRAM", "zmq")]
    for row in rows:
        if row["speculative"]:
            assert row["outputs_equal_plain"] == 2 and row["fallbacks"] == 0 and row["draft_tokens"] > 0


def test_trace_gaps_attributes_the_devices_idle_time_to_the_host_phase(tmp_path):
    """benchmarks/trace_gaps.py on a Chrome trace of torch.profiler's shape: three steps (engine.verify opens each),
    device busy 4 ms of each 10; the 6 ms idle falls 1 in engine.verify (before its kernel starts), 2 in engine.accept
    and 3 in draft.catch_up (2 of them with no op running: Python). A trace written by hand: what the tool must read
    back out of it is known exactly."""
    import gzip

    events = []

    def x(cat, name, ts, dur, tid=1):
        events.append({"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid})

    for k in range(4):
        t = k * 10_000.0
        x("user_annotation", "engine.verify", t, 1_000)
        x("kernel", "gemm", t + 1_000, 4_000, tid=7)  # the device: 1..5 ms of each step
        x("user_annotation", "engine.accept", t + 5_000, 2_000)
        x("user_annotation", "engine.draft", t + 7_000, 3_000)
        x("user_annotation", "draft.catch_up", t + 7_000, 3_000)
        x("cpu_op", "aten::copy_", t + 7_000, 1_000)
        x("kernel", "tiny", t + 10_000 - 1, 1, tid=7)  # the next step's first device work follows right after
    x("kernel", "gemm", 40_000.0 + 1_000, 4_000, tid=7)
    trace = tmp_path / "t.trace.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": [*events, {"ph": "M", "name": "process_name"}]}, f)
    result = lifeline.run([sys.executable, str(REPO / "benchmarks" / "trace_gaps.py"), "--json", str(trace)],
                          capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["steps"] == 2 and math.isclose(report["median_step_ms"], 10.0)
    assert math.isclose(report["device_busy_ms"], 4.001, abs_tol=1e-3)
    assert math.isclose(report["device_idle_ms"], 5.999, abs_tol=1e-3)
    phases = report["idle_by_phase_ms"]
    assert math.isclose(phases["engine.verify"], 1.0, abs_tol=0.01)
    assert math.isclose(phases["engine.accept"], 2.0, abs_tol=0.01)
    assert math.isclose(phases["draft.catch_up"], 3.0, abs_tol=0.01)
    ops = report["idle_by_phase_and_op_ms"]
    assert math.isclose(ops["draft.catch_up | aten::copy_"], 1.0, abs_tol=0.35)
    assert math.isclose(ops["draft.catch_up | <python>"], 2.0, abs_tol=0.35)


def test_trace_rounds_splits_a_served_trace_into_points_and_prices_an_arrival(tmp_path):
    """benchmarks/trace_rounds.py on a hand-written trace of a plain point (4 prompts prefilled, 10 plain steps of 1 ms at
    batch 4) and a speculative one (prefill, 5 drafted steps of 2 ms making 12 tokens each, a request leaving and its
    successor mixed in a 3 ms step, a 1 ms step after it, a tail of 2 drafted steps at batch 1): tokens a ms 71/17
    against 40/11 over every step, 67/14 against 40/10 at the full batch, one arrival of 3 + 1 ms, mixed."""

    def step(speculating=0, plain=0, budget=1, forward=0, seconds=0.001, accepts=()):
        return {"kind": "observe", "budget": budget, "speculating": speculating, "plain": plain,
                "forward_tokens": forward, "verify_seconds": 0.0, "spec_seconds": 0.0, "base_seconds": seconds,
                "accepts": [list(a) for a in accepts]}

    trace = [step(forward=512)] + [step(plain=4) for _ in range(10)]
    trace += [step(forward=512)] + [step(4, budget=4, forward=16, seconds=0.002, accepts=[(3, 2)] * 4)] * 5
    trace += [step(3, forward=3 + 128, seconds=0.003), step(4, forward=4)]
    trace += [step(1, budget=4, forward=4, accepts=[(3, 1)])] * 2
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in trace))
    result = lifeline.run([sys.executable, str(REPO / "benchmarks" / "trace_rounds.py"), "--skip", "0", "--json",
                           str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert [p["kind"] for p in report["points"]] == ["plain", "spec"]
    parts = report["points"][1]["parts"]
    assert {name: (p["steps"], p["tokens"]) for name, p in parts.items()} == {
        "prompt": (1, 0), "drafted full": (5, 60), "mixed": (1, 3), "off full": (1, 4), "drafted <8": (2, 4)}
    assert math.isclose(report["ratio_every_step"][0], (71 / 17) / (40 / 11))
    assert math.isclose(report["ratio_full_batch"][0], (67 / 14) / (40 / 10))
    assert report["arrivals"]["count"] == 1 and report["arrivals"]["mixed"] == 1
    assert math.isclose(report["arrivals"]["both_ms"], 4.0)
