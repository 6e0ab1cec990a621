"""`splitspec bench` and the replay drafter: the grid in process with a real drafter, simulated acceptance on a
dummy target with a dummy EAGLE-3 head drafting for real, and a running deployment measured over HTTP with
its drafter process replaying over ZeroMQ."""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

import pytest

from splitspec import lifeline

REPO = Path(__file__).resolve().parents[1]
from splitspec.drafter_svc.replay import ReplayDrafter, load_references, parse_profile
from splitspec.runtime.tree import depths, validate_parents


def bench(*flags: str, timeout: float = 600, env: dict | None = None) -> dict:
    result = lifeline.run([sys.executable, "-P", "-m", "splitspec", "bench", "--log-level", "warning", *flags],
                            capture_output=True, text=True, timeout=timeout, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


class _Free:
    """A drafter that proposes nothing and costs nothing (the replay's inner drafter in unit tests)."""

    name, needs_hidden_states = "NONE", False

    def open(self, *a):
        pass

    def extend(self, *a):
        pass

    def release(self, *a):
        pass

    def draft(self, ids, budgets):
        return [None] * len(ids)


def test_profiles_parse_and_bad_ones_are_refused():
    rates = parse_profile("accept-length:4", 5)
    assert len(rates) == 5 and abs(1 + sum(rates) - 4) < 1e-9 and rates == sorted(rates, reverse=True)
    assert parse_profile("0.9,0.5", 4) == [0.9, 0.5, 0.0, 0.0]
    for bad, match in (("accept-length:7", "num_steps"), ("0.5,0.9", "not increase"), ("1.5", r"\[0, 1\]"),
                       ("accept-length:x", "accept-length"), ("a,b", "comma")):
        with pytest.raises(ValueError, match=match):
            parse_profile(bad, 5)


@pytest.mark.parametrize("profile,steps,topk,nodes", [("accept-length:4", 5, 4, 12), ("0.9,0.7,0.4,0.2", 4, 1, 5),
                                                      ("accept-length:2.5", 3, 2, 6)])
def test_replayed_trees_follow_the_profile_under_greedy_acceptance(profile, steps, topk, nodes):
    vocab = 1000
    rng = random.Random(1)
    reference = [rng.randrange(vocab) for _ in range(6000)]
    rates = parse_profile(profile, steps)
    drafter = ReplayDrafter(_Free(), [reference], rates, vocab, steps, topk, nodes)
    drafter.open("r", reference[:10])
    n, accepted, verify_steps = 10, [0] * steps, 0
    while n < 5900:
        (tree,) = drafter.draft(["r"], [nodes])
        validate_parents(tree.parents)
        assert tree.num_nodes == nodes and tree.tokens[0] == reference[n - 1] and max(depths(tree.parents)) == steps
        children = {}
        for i, parent in enumerate(tree.parents):
            children.setdefault(parent, []).append(i)
        assert all(len(c) <= topk for p, c in children.items() if p >= 0) and len(children[0]) <= topk
        node, k = 0, 0  # greedy verification against the reference (the target's own continuation)
        while True:
            match = [i for i in children.get(node, []) if tree.tokens[i] == reference[n + k]]
            assert len(match) <= 1  # siblings never repeat the reference's token
            if not match:
                break
            node, accepted[k], k = match[0], accepted[k] + 1, k + 1
        drafter.extend("r", reference[n : n + k + 1])
        n, verify_steps = n + k + 1, verify_steps + 1
    measured = [a / verify_steps for a in accepted]
    assert all(abs(m - r) < 0.02 for m, r in zip(measured, rates)), (measured, rates)
    assert drafter.off_reference == 0
    # a sequence that leaves its reference gets rejected drafts, counted
    drafter.extend("r", [(reference[n] + 1) % vocab])
    (tree,) = drafter.draft(["r"], [nodes])
    assert tree.num_nodes == nodes and drafter.off_reference == 1


def test_references_must_be_generate_json(tmp_path):
    good = tmp_path / "ref.jsonl"
    good.write_text(json.dumps({"prompt_ids": [1, 2], "output_ids": [3], "text": "x"}) + "\n\n")
    assert load_references(good) == [[1, 2, 3]]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "hi"}\n')
    with pytest.raises(ValueError, match="line 1: expected a JSON object with prompt_ids and output_ids"):
        load_references(bad)


def test_grid_in_process_with_a_real_eagle3_head():
    """steps x topk x tokens with the demo EAGLE-3 head: one row per distinct tree, every output equal to plain
    decoding, speculation happened at every point, phases timed."""
    report = bench("--speculative-algorithm", "EAGLE3", "--batch-size", "1,2", "--steps", "2,3", "--topk", "1,2",
                   "--num-draft-tokens", "4", "--num-prompts", "2", "--prompt-len", "24", "--output-len", "24",
                   "--warmup-requests", "1")
    rows = report["rows"]
    plain = [r for r in rows if r["speculative"] is None]
    spec = [r for r in rows if r["speculative"] == "EAGLE3"]
    assert [r["batch_size"] for r in plain] == [1, 2]
    # topk 1 makes a chain of steps + 1 nodes: (2,1,3), (2,2,4), (3,1,4), (3,2,4)
    shapes = sorted({(r["steps"], r["topk"], r["num_draft_tokens"]) for r in spec})
    assert shapes == [(2, 1, 3), (2, 2, 4), (3, 1, 4), (3, 2, 4)] and len(spec) == 8
    for row in rows:
        assert row["completed"] == row["requests"] == 2 and row["output_tokens"] == 48
        assert row["output_tok_s"] > 0 and row["ttft_ms"]["p50"] > 0 and row["itl_ms"]["mean"] > 0
        assert row["step_ms"]["total"] >= row["step_ms"]["verify"] > 0
    for row in spec:
        assert row["outputs_equal_plain"] == 2 and row["simulated"] is False
        assert row["verify_steps"] > 0 and row["accepted_tokens"] > 0 and row["accept_length"] > 1
        # every step after the prompt's drafted (no policy): nearly all of the 48 tokens (a last step's drafts accepted
        # past max_tokens count too: capped at 1)
        assert 0.5 < row["drafted_token_share"] == min(round((row["verify_steps"] + row["accepted_tokens"]) / 48, 4), 1.0)
        assert row["fallbacks"] == 0 and row["drafter"]["faults"] == 0 and row["step_ms"]["draft"] > 0
        assert len(row["accepted_per_position"]) <= row["steps"] and row["speedup"] > 0


def test_in_process_without_a_warm_up():
    """--warmup-requests 0: no warm-up load (it crashed on the empty load's parameters), the points measured as asked."""
    report = bench("--speculative-algorithm", "NGRAM", "--batch-size", "1", "--num-prompts", "1", "--prompt-len", "16",
                   "--output-len", "8", "--warmup-requests", "0")
    assert [(r["speculative"], r["completed"], r["output_tokens"]) for r in report["rows"]] == [(None, 1, 8), ("NGRAM", 1, 8)]


def test_simulated_acceptance_on_a_dummy_target_with_a_dummy_eagle3_head(tmp_path):
    """--preset/--draft-preset: random-weight target and head; the head drafts for real (its time is in
    step_ms.draft), the replay proposes plain decoding's own continuation at accept length 3. The presets' model
    directories go with the run."""
    out = tmp_path / "sim.json"
    temp = tmp_path / "tmp"
    temp.mkdir()
    report = bench("--preset", "quick", "--draft-preset", "eagle3-quick", "--speculative-algorithm", "EAGLE3",
                   "--simulate-acceptance", "accept-length:3", "--steps", "4", "--topk", "2", "--num-draft-tokens", "8",
                   "--batch-size", "1,3", "--num-prompts", "3", "--prompt-len", "16", "--output-len", "96",
                   "--out", str(out), env={**os.environ, "TMPDIR": str(temp)})
    assert json.loads(out.read_text()) == report
    assert not [p.name for p in temp.iterdir() if p.name.startswith("splitspec-")]
    assert report["simulated"] is True and report["model"].startswith("dummy quick (random weights); dummy weights made decisive")
    assert report["draft"] == "dummy eagle3-quick (random weights)"
    spec = [r for r in report["rows"] if r["speculative"]]
    assert len(spec) == 2
    for row in spec:
        assert row["simulated"] is True and row["profile"] == "accept-length:3"
        assert row["outputs_equal_plain"] == 3 and row["off_reference"] == 0 and row["fallbacks"] == 0
        assert abs(row["accept_length"] - 3) < 0.35, row["accept_length"]
        assert row["step_ms"]["draft"] > 0 and row["drafter"]["trees"] == row["verify_steps"]


def test_batch_sweep_with_two_profiles_fixed_and_adaptive_and_its_plot(tmp_path):
    """The sweep (issue 15): several batch sizes, two acceptance profiles (';'-separated), every point with its
    fixed tree and then load-adaptive; every row lossless, fixed rows verify their tree at every decode step,
    adaptive rows say which budgets they used; plot_sweep turns the JSON into a PNG and a summary."""
    out = tmp_path / "sweep.json"
    report = bench("--preset", "quick", "--draft-preset", "eagle3-quick", "--speculative-algorithm", "EAGLE3",
                   "--simulate-acceptance", "accept-length:3;0.9,0.6,0.3", "--steps", "3", "--topk", "1",
                   "--num-draft-tokens", "4", "--speculative-adaptive", "both", "--batch-size", "1,4",
                   "--num-prompts", "4", "--prompt-len", "16", "--output-len", "40", "--out", str(out))
    spec = [r for r in report["rows"] if r["speculative"]]
    assert len(spec) == 8 and len(report["rows"]) == 10
    assert {(r["profile"], r["adaptive"], r["batch_size"]) for r in spec} == {
        (p, a, b) for p in ("accept-length:3", "0.9,0.6,0.3") for a in (False, True) for b in (1, 4)}
    for row in spec:
        assert row["outputs_equal_plain"] == 4 and row["fallbacks"] == 0, row
        assert row["budgets"] and set(row["budgets"]) <= {"1", "2", "3", "4"}
        if not row["adaptive"]:
            assert set(row["budgets"]) == {"4"} and row["accepted_tokens"] > 0
    png, summary = tmp_path / "sweep.png", tmp_path / "summary.json"
    result = lifeline.run([sys.executable, "benchmarks/plot_sweep.py", str(out), "--png", str(png), "--summary",
                             str(summary)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    profiles = json.loads(summary.read_text())["profiles"]
    assert set(profiles) == {"accept-length:3", "0.9,0.6,0.3"}
    for series in profiles.values():
        assert set(series) == {"plain", "fixed steps 3 topk 1 tokens 4", "adaptive (up to steps 3 topk 1 tokens 4)"}
        fixed = series["fixed steps 3 topk 1 tokens 4"]
        assert set(fixed["speedup"]) == {"1", "4"} and fixed["min_speedup"] == min(fixed["speedup"].values())


def test_bench_refuses_what_it_cannot_measure():
    result = lifeline.run([sys.executable, "-P", "-m", "splitspec", "bench", "--preset", "quick",
                             "--simulate-acceptance", "accept-length:2"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--simulate-acceptance needs a --speculative-algorithm" in result.stderr
    result = lifeline.run([sys.executable, "-P", "-m", "splitspec", "bench", "--url", "ftp://x"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "expected http(s)://host:port" in result.stderr
    result = lifeline.run([sys.executable, "-P", "-m", "splitspec", "bench", "--preset", "quick", "--rounds", "0"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--rounds 0 --first-round 0: at least 1 round" in result.stderr
    result = lifeline.run([sys.executable, "-P", "-m", "splitspec", "bench", "--batch-size", "1", "--prompt-len", "128",
                           "--output-len", "2000"], capture_output=True, text=True, timeout=120)  # the demo target: 2048
    assert result.returncode == 2 and "maximum context length is 2048 tokens; the longest prompt has 128 tokens and " \
        "--output-len asks for 2000 more" in result.stderr, result.stderr
    result = lifeline.run([sys.executable, "-P", "-m", "splitspec", "bench", "--url", "http://127.0.0.1:9",
                           "--pause-before-rounds"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--pause-before-rounds is for the in-process bench" in result.stderr
    # nothing listens on port 9: at once with no wait, after the wait with one
    result = lifeline.run([sys.executable, "-P", "-m", "splitspec", "bench", "--url", "http://127.0.0.1:9",
                           "--ready-check-timeout-sec", "0"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Connection refused" in result.stderr, result.stderr
    result = lifeline.run([sys.executable, "-P", "-m", "splitspec", "bench", "--url", "http://127.0.0.1:9",
                           "--ready-check-timeout-sec", "2"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "http://127.0.0.1:9 was not ready after 2 s (--ready-check-timeout-sec)" \
        in result.stderr, result.stderr


def test_bench_against_a_deployment_whose_drafter_replays(tmp_path):
    """`splitspec up` with a drafter process replaying the target's recorded outputs over ZeroMQ, measured by
    `splitspec bench --url` (started first: it waits for the deployment) with 1 and 2 concurrent streaming clients:
    every request completes, plain requests (opted out) and speculative ones are both measured, and the accept length
    follows the profile. Two rounds (--rounds 2): plain and speculative alternate in time, each round sends its own
    prompts, each row pools its rounds, and the speedup is the median of the paired rounds' ratios."""
    from test_launcher import Up, free_port_block

    rng = random.Random(3)
    # 4 prompts for each round and batch size, of 10, 11 (round 0: batch 1, 2), 12 and 13 tokens (round 1): the dataset's
    # next prompts, not the same again
    prompts = [[rng.randrange(4, 4000) for _ in range(10 + i // 4)] for i in range(16)]
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts))
    reference = tmp_path / "reference.jsonl"
    ids = [flag for p in prompts for flag in ("--input-ids", ",".join(map(str, p)))]
    generated = lifeline.run([sys.executable, "-P", "-m", "splitspec", "generate", *ids, "--max-new-tokens", "40",
                                "--ignore-eos", "--json", "--log-level", "warning"], capture_output=True, text=True,
                               timeout=300)
    assert generated.returncode == 0, generated.stderr
    reference.write_text(generated.stdout)
    # the bench first, the deployment once the bench says it waits for it (--ready-check-timeout-sec): started together,
    # either may be first on a loaded machine
    port = free_port_block(4)
    url = f"http://127.0.0.1:{port}"
    out, err = tmp_path / "bench.json", tmp_path / "bench.log"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        bench = lifeline.spawn([sys.executable, "-P", "-m", "splitspec", "bench", "--log-level", "info", "--url", url,
                                "--batch-size", "1,2", "--num-prompts", "4", "--output-len", "40", "--dataset",
                                str(dataset), "--warmup-requests", "0", "--rounds", "2", "--ready-check-timeout-sec",
                                "300"], stdout=stdout, stderr=stderr, text=True)
    up = None
    try:
        deadline = time.time() + 120
        while f"waiting up to 300 s for {url} to be ready" not in err.read_text():
            assert bench.poll() is None and time.time() < deadline, err.read_text()[-3000:]
            time.sleep(0.2)
        # a client of a deployment: its flags, prompts and measuring import no torch (~3 CPU-s, ~190 MB)
        assert "libtorch" not in Path(f"/proc/{bench.pid}/maps").read_text(), "splitspec bench --url imported torch"
        up = Up("--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "5", "--speculative-replay",
                str(reference), "--speculative-replay-profile", "accept-length:3", "--log-level", "warning", port=port)
        assert bench.wait(timeout=900) == 0, err.read_text()[-3000:]
        report = json.loads(out.read_text())
    finally:
        bench.kill()
        if up is not None:
            up.stop()
    assert report["model"] == "splitspec-demo" and report["rounds"] == 2
    rows = report["rows"]
    assert [(r["batch_size"], r["speculative"]) for r in rows] == [(1, None), (1, "NGRAM"), (2, None), (2, "NGRAM")]
    for row in rows:  # 4 requests a round, two rounds pooled
        assert row["errors"] == [] and row["requests"] == 8 and row["completed"] == 8 and row["output_tokens"] == 320
        assert row["prompt_tokens_mean"] == 10 + row["batch_size"] and row["ttft_ms"]["p50"] > 0 and row["tpot_ms"] > 0
        assert len(row["rounds_tok_s"]) == 2 and all(x > 0 for x in row["rounds_tok_s"])
        wall = sum(b - a for a, b in row["windows_s"])
        assert abs(row["output_tok_s"] - 320 / wall) < 0.02 * row["output_tok_s"], (row["output_tok_s"], wall)
    for plain, spec in zip(rows[0::2], rows[1::2]):
        # alternating: plain round 1, speculative round 1, plain round 2, speculative round 2
        p1, p2 = plain["windows_s"]
        s1, s2 = spec["windows_s"]
        assert p1[1] <= s1[0] and s1[1] <= p2[0] and p2[1] <= s2[0], (plain["windows_s"], spec["windows_s"])
        assert abs(spec["accept_length"] - 3) < 0.4, spec["accept_length"]
        pairs = sorted(s / p for s, p in zip(spec["rounds_tok_s"], plain["rounds_tok_s"]))
        assert abs(spec["speedup"] - (pairs[0] + pairs[1]) / 2) < 2e-3, (spec["speedup"], pairs)


def test_served_against_in_process_in_one_command(tmp_path):
    """benchmarks/served.py: the model loaded in process and `splitspec up` measured by `splitspec bench --url`, in two
    rounds (--rounds 2): in-process round 0, served round 0, in-process round 1, served round 1, each round with its
    own prompts on both sides (the served warm-up with prompts neither sends); the report pairs every point (plain and
    NGRAM) with its served/in-process ratio, the median of its rounds' ratios, and both sides speculated. With
    SPLITSPEC_STEP_LOG, the served verifier, the bench's client and the in-process bench write their step timelines,
    and benchmarks/step_timeline.py accounts for every measured request on both sides."""
    from test_launcher import free_port_block

    rng = random.Random(5)
    # two prompts a round: round 0's of 30 tokens, round 1's of 32, the served warm-up's (round 2) of 34
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt_ids": [rng.randrange(4, 4000) for _ in range(30 + 2 * (i // 2))]}) + "\n"
                               for i in range(6)))
    out = tmp_path / "served.json"
    port = free_port_block(4)
    result = lifeline.run([sys.executable, "-P", "benchmarks/served.py", "--out", str(out), "--port", str(port),
                           "--rounds", "2", "--load", f"--batch-size 2 --prompt-len 40 --output-len 12 --num-prompts 2 "
                           f"--warmup-requests 1 --dataset {dataset}",
                           "--", "--speculative-algorithm", "NGRAM", "--device", "cpu"],
                          capture_output=True, text=True, timeout=600, cwd=str(REPO),
                          env={**os.environ, "SPLITSPEC_STEP_LOG": str(tmp_path / "steps")})
    log = (tmp_path / "served.log").read_text() if (tmp_path / "served.log").exists() else ""
    assert result.returncode == 0, result.stderr[-3000:] + log[-3000:]
    report = json.loads(out.read_text())
    assert report["rounds"] == 2
    points = {(p["batch_size"], p["speculative"]): p for p in report["points"]}
    assert set(points) == {(2, None), (2, "NGRAM")}, report["points"]
    rows = {side: {(r["round"], r["speculative"] is not None): r for r in report[side]["rows"]}
            for side in ("served", "in_process")}
    assert all(set(rows[side]) == {(0, False), (0, True), (1, False), (1, True)} for side in rows), rows
    for (r, _), row in rows["served"].items():  # each round its own prompts, the same on both sides
        assert row["prompt_tokens_mean"] == 30 + 2 * r == rows["in_process"][(r, _)]["prompt_tokens_mean"], row
    # alternating: each in-process round just before the served round of the same prompts
    spans = {(side, r): (min(rows[side][(r, s)]["window_s"][0] for s in (False, True)),
                         max(rows[side][(r, s)]["window_s"][1] for s in (False, True))) for side in rows for r in (0, 1)}
    order = [("in_process", 0), ("served", 0), ("in_process", 1), ("served", 1)]
    assert all(spans[a][1] <= spans[b][0] for a, b in zip(order, order[1:])), spans
    for (batch, algorithm), point in points.items():
        spec = algorithm is not None
        assert point["served_errors"] == 0 and point["served_tok_s"] > 0 and point["in_process_tok_s"] > 0
        ratios = [rows["served"][(r, spec)]["output_tok_s"] / rows["in_process"][(r, spec)]["output_tok_s"] for r in (0, 1)]
        assert [x["ratio"] for x in point["rounds"]] == [round(x, 3) for x in ratios], point
        assert abs(point["served_over_in_process"] - sum(ratios) / 2) < 2e-3, point  # the median of two
        # each side's host speed while the point ran (None where no sample fell in a point this short)
        assert set(point["host_us"]) == {"served", "in_process"}, point
        assert all(us is None or us > 0 for us in point["host_us"].values()), point
    for side in rows:  # speculation's gain on each side: the median of its rounds' speculative over plain
        gains = [rows[side][(r, True)]["output_tok_s"] / rows[side][(r, False)]["output_tok_s"] for r in (0, 1)]
        assert abs(points[(2, "NGRAM")][f"{side}_speedup"] - sum(gains) / 2) < 2e-3, (side, gains)
    for side in ("served", "in_process"):
        for row in report[side]["rows"]:
            began, ended = row["window_s"]
            assert 0 < ended - began and abs((ended - began) - row["wall_s"]) < 0.5, row
    for row in report["served"]["rows"]:  # the load's client's own CPU over each point, its start apart
        assert row["client_cpu"]["ms_per_request"] > 0 and 0 <= row["client_cpu"]["share_of_wall"] <= 1.1, row
    assert all(0 <= p["served_client_cpu_share"] <= 1.1 for p in report["points"]), report["points"]
    assert points[(2, "NGRAM")]["served_accept_length"] > 1 and points[(2, "NGRAM")]["in_process_accept_length"] > 1
    for side in ("served", "in_process"):  # some of the tokens came from drafted steps, and no more than all
        assert 0 < points[(2, "NGRAM")][f"{side}_drafted_token_share"] <= 1, points[(2, "NGRAM")]
    assert report["served"]["url"] == f"http://127.0.0.1:{port}" and "served.py" in report["command"]
    loop = report["served_engine_loop"]  # the served verifier's loop, from its /metrics around the served bench
    assert loop["steps"] > 0 and loop["mean_ms"]["step"] > 0 and loop["mean_ms"]["verify"] > 0, loop
    assert {"intake", "metrics", "publish", "schedule", "draft", "accept", "commit"} <= set(loop["mean_ms"]), loop
    cpu = report["served_process_cpu"]  # each of up's services, its CPU over the timed served run (from /proc)
    assert {"gateway", "verifier", "front_process", "bench_client"} <= set(cpu), cpu  # and the load's client's
    assert cpu["verifier"]["cpu_s"] > 0 and cpu["gateway"]["per_request_ms"] is not None, cpu  # (/proc counts 10 ms ticks)
    assert cpu["bench_client"]["cpu_s"] > 0.1 and cpu["bench_client"]["processes"] == 1, cpu  # a Python process's start alone
    assert all(0 <= entry["share_of_wall"] <= entry["processes"] * os.cpu_count() + 0.1 for entry in cpu.values()), cpu

    names = sorted(p.name.split(".")[1] for p in tmp_path.glob("steps.*.jsonl"))
    assert set(names) == {"client", "gateway", "front", "verifier", "in_process"}, names
    timeline = lifeline.run([sys.executable, "benchmarks/step_timeline.py", "--json", *map(str, tmp_path.glob("steps.*.jsonl"))],
                            capture_output=True, text=True, timeout=60, cwd=str(REPO))
    assert timeline.returncode == 0, timeline.stderr
    rows = [json.loads(line) for line in timeline.stdout.splitlines()]
    measured = [r for r in rows if r["requests"] == 2 and r["batch_size"] == 2]  # the warm-ups: 1 request, or 16 tokens
    for side in ("served", "in_process"):
        for speculative in (False, True):
            row = next(r for r in measured if r["side"] == side and r["speculative"] == speculative)
            legs = row["ttft_legs_ms"]  # every request arrived, got its first token published and seen, in the window
            assert legs is not None, row
            assert min(legs.values()) >= 0 and abs(sum(legs.values()) - row["ttft_ms"]) < 0.01, row
            assert sum(k["count"] for k in row["steps"].values()) > 0 and row["steps"]["decode"]["count"] > 0, row
            if side == "in_process":
                assert legs["in"] == legs["out"] == 0.0, row  # sent is admitted, published is seen: one clock read each
            else:  # the way in, point by point, in the order every submission passes them
                hops = row["in_hops_ms"]
                assert list(hops) == ["gateway_handler", "gateway_submitted", "front_received"], row
                assert 0 <= hops["gateway_handler"] <= hops["gateway_submitted"] <= hops["front_received"] <= legs["in"], row


def test_served_simulated_acceptance_on_a_dummy_target_replays_what_in_process_recorded(tmp_path):
    """benchmarks/served.py --simulate-acceptance (issue 31's 8B EAGLE-3 served figure, shrunk): the in-process side
    runs first and records plain decoding's outputs of a decisive dummy target; `up` replays them through a real
    dummy EAGLE-3 head in a drafter process, so both sides accept the same drafts (the replay's draws are seeded per
    reference) and no served request leaves its reference; a second round (--rounds 2) sends the reference's prompts
    again on both sides and accepts the same."""
    from test_launcher import free_port_block

    out = tmp_path / "sim.json"
    port = free_port_block(4)
    result = lifeline.run([sys.executable, "-P", "benchmarks/served.py", "--out", str(out), "--port", str(port),
                           "--dummy-preset", "quick", "--dummy-draft-preset", "eagle3-quick",
                           "--simulate-acceptance", "accept-length:3", "--log-level", "info", "--rounds", "2",
                           "--load", "--batch-size 2 --prompt-len 16 --output-len 40 --num-prompts 2 --warmup-requests 1",
                           "--", "--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3",
                           "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4", "--device", "cpu"],
                          capture_output=True, text=True, timeout=600, cwd=str(REPO))
    log = (tmp_path / "sim.log").read_text() if (tmp_path / "sim.log").exists() else ""
    assert result.returncode == 0, result.stderr[-3000:] + log[-3000:]
    report = json.loads(out.read_text())
    assert report["simulated"] == "accept-length:3" and report["in_process"]["simulated"] is True
    assert "dummy weights made decisive" in report["in_process"]["model"]
    assert report["model_flags"][report["model_flags"].index("--load-format") + 1] == "dummy-decisive"
    points = {(p["batch_size"], p["speculative"]): p for p in report["points"]}
    assert set(points) == {(2, None), (2, "EAGLE3")}, report["points"]
    spec = points[(2, "EAGLE3")]
    assert spec["served_errors"] == 0 and abs(spec["in_process_accept_length"] - 3) < 0.4, spec
    assert spec["served_accept_length"] == spec["in_process_accept_length"], spec
    assert spec["served_drafted_token_share"] == spec["in_process_drafted_token_share"] > 0.5, spec
    for r in (0, 1):
        served, inside = (next(row for row in report[side]["rows"] if row["speculative"] and row["round"] == r)
                          for side in ("served", "in_process"))
        assert served["accept_length"] == inside["accept_length"] and served["prompt_tokens_mean"] == 16, (served, inside)
        assert inside["outputs_equal_plain"] == 2 and inside["off_reference"] == 0 and inside["step_ms"]["draft"] > 0
    assert "SIMULATED speculation: EAGLE3 drafts for real" in log  # the drafter process's replay
    # the in-process side runs the engine as the server does (no device synchronisation at phase boundaries)
    assert any(line.startswith("$ ") and " bench " in line and "--url" not in line and "--no-phase-sync" in line
               for line in log.splitlines()), log[:3000]
    assert "follows no reference sequence" not in log


def test_served_plain_deployment_measures_plain_decoding_in_process():
    """benchmarks/served.py with `--speculative-algorithm none` (`up` serving plain decoding): the in-process side gets
    no algorithm (plain decoding only) and no adaptive policy; a named algorithm reaches both sides."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import served
    finally:
        sys.path.pop(0)
    for flags in (["--speculative-algorithm", "none", "--device", "cuda"], ["--speculative-algorithm=None", "--device", "cuda"]):
        assert served.bench_flags(flags) == ["--device", "cuda"]
        assert served.server_adaptive(flags) == []
    flags = ["--speculative-algorithm", "NGRAM", "--speculative-num-steps", "3", "--device", "cuda"]
    assert served.bench_flags(flags) == ["--speculative-algorithm", "NGRAM", "--steps", "3", "--device", "cuda"]
    assert served.server_adaptive(flags) == ["--speculative-adaptive", "on"]
    # every engine flag bench takes reaches the in-process side (a fixed list once dropped the prompt graphs' flag);
    # up's own flags and the load's stay out of it
    flags = ["--prompt-cuda-graph-max-tokens", "512", "--disable-mixed-chunk", "--chunked-prefill-size=64",
             "--drafters", "2", "--port", "8000", "--num-prompts", "9", "--device", "cuda"]
    assert served.bench_flags(flags) == ["--prompt-cuda-graph-max-tokens", "512", "--disable-mixed-chunk",
                                         "--chunked-prefill-size=64", "--device", "cuda"]


def test_the_served_profile_counts_whole_batch_decode_steps_of_its_kind():
    """SPLITSPEC_TORCH_PROFILE_SERVED=BATCH:KIND: the served verifier's profile counts decode steps of BATCH requests
    that all verified trees (spec) or none (plain); prefill steps and partial batches are not counted; off
    without SPLITSPEC_TORCH_PROFILE."""
    code = """
from splitspec.device_profile import served_selector
from splitspec.verifier_svc.step_types import StepReport
profiler, counts = served_selector()
assert profiler.name == 'served_bs4_spec' and (profiler.start, profiler.stop) == (4, 16)
assert counts(StepReport(generated_tokens=9, accept_lengths=[3, 2, 1, 3], forward_tokens=24))
assert not counts(StepReport(generated_tokens=5, accept_lengths=[3, 2], forward_tokens=16))  # part of the batch
assert not counts(StepReport(generated_tokens=9, accept_lengths=[3, 2, 1, 3], prefill_tokens=64))
assert not counts(StepReport(generated_tokens=4, forward_tokens=4))  # plain steps
print('ok')
"""
    env = {**os.environ, "SPLITSPEC_TORCH_PROFILE": "/nonexistent", "SPLITSPEC_TORCH_PROFILE_SERVED": "4:spec"}
    result = lifeline.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=str(REPO))
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
    off = {k: v for k, v in env.items() if k != "SPLITSPEC_TORCH_PROFILE"}
    result = lifeline.run([sys.executable, "-c", "from splitspec.device_profile import served_selector; "
                           "assert served_selector() is None; print('off')"], capture_output=True, text=True,
                          timeout=120, env=off, cwd=str(REPO))
    assert result.returncode == 0 and result.stdout.strip() == "off", result.stderr[-2000:]


def test_bench_client_keeps_connections_alive_and_reopens_one_the_server_closed():
    """`splitspec bench --url`'s client against a real HTTP/1.1 server on a socket: a slot's second request rides
    the first one's connection; when the server then drops a kept-alive connection without saying so, the next
    request is sent again on a new one; a server that answers `Connection: close` gets a new connection each time;
    an error status is reported with its body, and so are a stream cut midway and an error event; a body without a
    length that ends with the connection is read whole; every delivery is counted."""
    import asyncio
    import threading

    from splitspec.bench_http import Http
    from splitspec.bench_measure import Timeline

    connections, requests = [], []

    def sse(texts: list[str], tokens: int) -> bytes:
        events = [json.dumps({"choices": [{"text": t}]}) for t in texts]
        events.append(json.dumps({"choices": [], "usage": {"completion_tokens": tokens}}))
        body = "".join(f"data: {e}\n\n" for e in events) + "data: [DONE]\n\n"
        return b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:7].encode(), body[7:].encode())) + b"0\r\n\r\n"

    async def handle(reader, writer):
        connections.append(writer)
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:  # the client closed its connection between requests
                break
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
            body = json.loads(await reader.readexactly(length))
            requests.append(body)
            mode = body["mode"]
            if mode == "cut":  # the stream's head and one event, then the connection is gone
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + sse(["a"], 1)[:40])
                await writer.drain()
                writer.close()
                break
            if mode == "until-close":  # no length, not chunked: the body is whatever comes before the close
                events = "".join(f"data: {json.dumps(e)}\n\n" for e in (
                    {"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]}, {"choices": [], "usage": {"completion_tokens": 4}}))
                writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + events.encode())
                await writer.drain()
                writer.close()
                break
            if mode == "stream-error":
                event = b'data: {"error": {"message": "engine gone"}}\n\n'
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(event), event))
                await writer.drain()
                continue
            if mode == "error":
                payload = b'{"error": {"message": "bad"}}'
                writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n%s" % (len(payload), payload))
            else:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                             + (b"Connection: close\r\n" if mode == "close" else b"") + b"\r\n"
                             + sse(["a", "b", "c"], 5))
            await writer.drain()
            if mode in ("close", "drop"):  # drop: gone without a word (an idle keep-alive timeout)
                writer.close()
                break

    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", 0))
    port = server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        client = Http(f"http://127.0.0.1:{port}", "key")

        async def scenario():
            connection = client.connection()
            timelines = [Timeline() for _ in range(6)]
            results = []
            for i, mode in enumerate(["keep", "drop", "keep", "close", "keep"]):
                results.append(await connection.stream({"mode": mode, "i": i}, timelines[i]))
            with pytest.raises(RuntimeError, match="HTTP 400.*bad"):
                await connection.stream({"mode": "error", "i": 5}, timelines[5])
            with pytest.raises(RuntimeError, match="closed the connection mid-stream"):
                await connection.stream({"mode": "cut", "i": 6}, Timeline())
            with pytest.raises(RuntimeError, match="stream error.*engine gone"):
                await connection.stream({"mode": "stream-error", "i": 7}, Timeline())
            until_close = Timeline()
            results.append(await connection.stream({"mode": "until-close", "i": 8}, until_close))
            connection.close()
            return results, timelines + [until_close]

        results, timelines = asyncio.run(scenario())
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
    assert [r["usage"]["completion_tokens"] for r in results] == [5] * 5 + [4]
    assert [t.tokens for t in timelines[:5]] == [5] * 5 and all(len(t.deliveries) == 3 for t in timelines[:5])
    assert timelines[-1].tokens == 4 and len(timelines[-1].deliveries) == 2  # the body that ended with the connection
    assert [b["i"] for b in requests] == [0, 1, 2, 3, 4, 5, 6, 7, 8]  # request 2 went once, on a new connection
    # connections: 0+1 (kept alive, then dropped), 2+3 (new; 3 answered close), 4+5 (new), 6 (new after the
    # error status's connection was closed: a failed request's connection is not reused), 7 (new after the cut),
    # 8 (new after the error event)
    assert len(connections) == 6


def test_bench_client_gives_up_on_a_silent_server(monkeypatch):
    """A server that takes the request and never answers fails it with a clear error after the client's timeout
    (600 s; shortened here), instead of hanging the bench."""
    import asyncio
    import socket

    from splitspec import bench_http
    from splitspec.bench_measure import Timeline

    monkeypatch.setattr(bench_http, "TIMEOUT_S", 0.5)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    try:
        connection = bench_http.Http(f"http://127.0.0.1:{listener.getsockname()[1]}", None).connection()

        async def ask():
            try:
                await connection.stream({"prompt": "x"}, Timeline())
            finally:
                connection.close()

        with pytest.raises(RuntimeError, match="nothing from the server for 0.5 s"):
            asyncio.run(ask())
    finally:
        listener.close()


def test_held_out_prompts_take_the_texts_next_windows_before_repeating():
    """More prompts than held-out texts (bench --url --rounds): every text's first window first (what a single round
    sends, as before), then their next windows, all distinct; as ids (a tokenizer here) and as text (--url without one)."""
    import argparse

    from splitspec.bench_measure import make_prompts
    from splitspec.tokenizer_loader import load_tokenizer

    from splitspec.demo import demo_model_dirs

    target = demo_model_dirs()["target"]
    tokenizer = load_tokenizer(target, required=True)
    for model_dir in (target, None):
        args = argparse.Namespace(dataset="auto", url="http://x" if model_dir is None else None, prompt_len=64, seed=0)
        first = make_prompts(args, model_dir, None, 8)
        many = make_prompts(args, model_dir, None, 400)
        assert many[:8] == first
        keys = [tuple(p) if model_dir else p for p in many]
        assert len(set(keys)) == len(keys) == 400, len(set(keys))
        if model_dir is None:  # a text's windows, 4 characters a token
            assert all(len(p) == 256 for p in many)
        else:
            assert all(len(p) == 64 for p in many)
            # the first window is the text's first 64 tokens
            assert first[0] == tokenizer.encode(first_text_with(64, tokenizer))[:64]


def test_every_round_and_batch_size_sends_its_own_prompts():
    """bench's rounds (in process and --url, and served.py's pairs of them): round after round, each batch size its own
    slice of the dataset's order, so that no point sends what another sent (NGRAM's trie, which learns from what it
    served, met the answers of a batch size's points again at the next: served accept length 10.0 against 3.7 in
    process on this CPU); a simulated acceptance's rounds repeat round 0 (its reference)."""
    from splitspec.bench_measure import prompts_for, round_prompts

    counts = {1: 4, 8: 16, 32: 64}
    prompts = list(range(prompts_for(counts, 3)))
    rounds = [round_prompts(prompts, counts, r) for r in range(3)]
    sent = [p for r in rounds for batch in counts for p in r[batch]]
    assert sorted(sent) == prompts and len(prompts) == 3 * 84  # every prompt once
    assert rounds[0][1] == [0, 1, 2, 3] and rounds[0][8] == list(range(4, 20)) and rounds[1][1] == [84, 85, 86, 87]
    assert all(len(r[b]) == n for r in rounds for b, n in counts.items())


def first_text_with(tokens: int, tokenizer) -> str:
    from splitspec.train import corpus

    texts = corpus.read_texts([f for f in corpus.select_files() if f.held_out], held_out=True)
    return next(t for t in texts if len(tokenizer.encode(t[: 16 * tokens])) >= tokens)[: 16 * tokens]


def test_host_speed_per_point_takes_the_samples_inside_its_window():
    """benchmarks/served.py HostSpeed.during: a point's host speed is the median of the samples taken while it ran."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from served import HostSpeed
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    speed = HostSpeed()
    speed.samples, speed.times = [100.0, 300.0, 200.0, 250.0, 90.0], [1.0, 2.0, 3.0, 4.0, 5.0]
    assert speed.during([[1.5, 4.5]]) == 250.0  # 300, 200, 250
    assert speed.during([[5.5, 6.0]]) is None and speed.during(None) is None
    assert speed.during([[0.5, 1.5], [4.5, 5.5]]) == 95.0  # a point's rounds: 100 and 90, not the 300 between them
    report = {"rows": [{"window_s": [0.0, 1.2]}, {"window_s": [2.5, 4.5]}, {},
                       {"window_s": [0.5, 5.5], "windows_s": [[0.5, 1.5], [1.5, 2.5]]}]}
    speed.mark_rows(report)
    assert [row["host_us"] for row in report["rows"]] == [100.0, 225.0, None, 200.0]


def test_step_timeline_times_a_decode_cycle_from_one_decode_step_to_the_next():
    """benchmarks/step_timeline.py: a decode cycle is a decode step's start to the next decode step's start (the loop's
    turn after a step counts; a prefill between two decode steps does not make a cycle), idle is only gaps over 1 ms."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from step_timeline import point_report
    finally:
        sys.path.remove(str(REPO / "benchmarks"))

    def step(began, ended, prefill=0):
        return {"kind": "step", "began": began, "ended": ended, "prefill_tokens": prefill, "forward_tokens": prefill + 4,
                "ms": {"verify": 1.0}}

    engine = [step(1.000, 1.004), step(1.0049, 1.009), step(1.0099, 1.0139),  # cycles 4.9 and 5.0 ms; turns under 1 ms
              step(1.020, 1.050, prefill=128), step(1.0505, 1.0545)]  # idle 6.1 ms before the prefill
    engine += [{"kind": "arrive", "received": 0.95}, {"kind": "publish", "at": 1.004, "first": 1}]
    client = {"sent": 0.94, "first": 1.005}
    report = point_report({"batch_size": 4, "speculative": None, "began": 0.9, "ended": 1.1}, [client], engine)
    assert report["ttft_legs_ms"] == {"in": 10.0, "engine": 54.0, "out": 1.0}
    assert report["decode_cycle_ms"] == 4.95 and report["steps"]["decode"]["count"] == 4
    assert report["idle_between_steps_ms"] == 6.1 and report["idle_gaps"] == 1


def test_replayed_chains_built_in_one_go_equal_the_general_tree():
    """A top-1 replay tree of steps + 1 nodes (the shape the simulated 8B runs draft) is built as a chain in one go;
    the general construction (siblings, padding) gives the same tree and accept count: random contexts on, off and
    past their reference, every draw."""
    vocab, rng = 50, random.Random(5)
    for _ in range(3000):
        steps = rng.randint(1, 6)
        reference = [rng.randrange(vocab) for _ in range(rng.randint(2, 30))]
        n = rng.randint(1, len(reference) + 2)
        context = (reference + [rng.randrange(vocab) for _ in range(3)])[:n]
        if rng.random() < 0.2:
            context[-1] = (context[-1] + 1) % vocab  # off its reference
        rates = sorted((rng.random() for _ in range(steps)), reverse=True)
        chain = ReplayDrafter(_Free(), [reference], rates, vocab, steps, 1, steps + 1)
        general = ReplayDrafter(_Free(), [reference], rates, vocab, steps, 2, steps + 1)  # no room for siblings
        u = rng.random()
        for ref in (reference, None):
            assert chain._tree(context, ref, u, steps + 1) == general._tree(context, ref, u, steps + 1)
