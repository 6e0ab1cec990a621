"""`splitspec verifier` as a real process, driven over gRPC: concurrent requests on one stream equal
plain offline generation and are speculated; bad requests are refused by name while the others run;
abort works; health and model info answer."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import assert_greedy_match, hf_model, spawn_service

from splitspec import lifeline
from splitspec.demo import demo_model_dirs
from splitspec.generate import generate_ids
from splitspec.protos import verifier_pb2 as pb
from splitspec.protos import verifier_pb2_grpc as pb_grpc
from splitspec.runtime.runner import ModelRunner, RuntimeConfig
from splitspec.runtime.sampling_params import SamplingParams
from splitspec.verifier_svc.grpc_front import Stream
from splitspec.verifier_svc.step_types import StepEvent, TokenLogprob
from splitspec.verifier_svc.worker import Submission

PROMPTS = [[13, 290, 350 + i, 13, 290, 350 + i, 13] for i in range(8)]  # repetitive: NGRAM drafts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def start_verifier(*extra: str, port: int | None = None, enable_metrics: bool = False):
    """A `splitspec verifier` process with metrics; returns (process, stub). stub.metrics_port is set: a free port, or
    with enable_metrics the one --enable-metrics takes without --metrics-port (--port + 1)."""
    if port is None:
        port = free_port()
        while enable_metrics and not _free(port + 1):
            port = free_port()
    metrics_port = port + 1 if enable_metrics else free_port()
    metrics = ["--enable-metrics"] if enable_metrics else ["--metrics-port", str(metrics_port)]
    process = spawn_service(
        [sys.executable, "-P", "-m", "splitspec", "verifier", "--port", str(port), *metrics,
         "--dtype", "float32", "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "8",
         "--log-level", "warning", *extra])
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.time() + 180
    while True:
        try:
            status = health.Check(health_pb2.HealthCheckRequest(service="splitspec.v1.Verifier"), timeout=2).status
            if status == health_pb2.HealthCheckResponse.SERVING:
                break
        except grpc.RpcError:
            pass
        assert process.poll() is None, process.stderr.read()
        assert time.time() < deadline, "verifier did not become healthy"
        time.sleep(0.3)
    stub = pb_grpc.VerifierStub(channel)
    stub.metrics_port, stub.port = metrics_port, port
    stub.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    stub.channel = channel
    return process, stub


def stop(process, stub) -> None:
    stub.channel.close()
    process.terminate()
    process.wait(timeout=60)  # 30 s was once too few for a verifier's exit in CI, the 2-core machine under full load


@pytest.fixture(scope="module")
def verifier():
    process, stub = start_verifier("--max-total-tokens", "4096")
    yield stub
    stop(process, stub)


@pytest.fixture(scope="module")
def tiny_verifier():
    """Room for 320 tokens (20 pages of 16): 16 requests of ~50 tokens cannot all run at once. It streams in
    deltas of 4 tokens (--stream-interval 4), which the tests of its outputs do not see."""
    process, stub = start_verifier("--max-total-tokens", "320", "--stream-interval", "4")
    yield stub
    stop(process, stub)


class Prometheus:
    """A real Prometheus server scraping the given /metrics ports every 0.5 s (or running the given
    configuration); query() asks its HTTP API."""

    def __init__(self, tmp_path, targets: list[int] = (), config_text: str | None = None):
        import shutil

        binary = shutil.which("prometheus")
        if binary is None:
            if os.environ.get("SPLITSPEC_REQUIRE_PROMETHEUS") == "1":
                pytest.fail("prometheus is not installed (.ci/run installs Debian's prometheus package)")
            pytest.skip("prometheus is not installed (apt-get install prometheus)")
        config = tmp_path / "prometheus.yml"
        config.write_text(config_text or "global:\n  scrape_interval: 500ms\n  evaluation_interval: 500ms\nscrape_configs:\n"
                          "  - job_name: splitspec-verifier\n    static_configs:\n"
                          f"      - targets: [{', '.join(repr(f'127.0.0.1:{t}') for t in targets)}]\n")
        self.port = free_port()
        self.process = lifeline.spawn(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 60
        while not self._ready():
            assert self.process.poll() is None, "prometheus exited"
            assert time.time() < deadline, "prometheus did not become ready"
            time.sleep(0.2)

    def _ready(self) -> bool:
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2).status == 200
        except OSError:
            return False

    def targets(self) -> list[dict]:
        """The active scrape targets: job, scrapeUrl, health ("up", "down", "unknown"), lastError."""
        url = f"http://127.0.0.1:{self.port}/api/v1/targets?state=active"
        return json.loads(urllib.request.urlopen(url, timeout=10).read())["data"]["activeTargets"]

    def query(self, promql: str) -> float | None:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        body = json.loads(urllib.request.urlopen(url, timeout=10).read())
        assert body["status"] == "success", body
        result = body["data"]["result"]
        return float(result[0]["value"][1]) if result else None

    def wait_for(self, promql: str, expected: float, timeout: float = 30.0) -> float | None:
        """The query's value once it equals expected (scrapes lag the server); the last value seen otherwise."""
        deadline, value = time.time() + timeout, None
        while time.time() < deadline:
            value = self.query(promql)
            if value is not None and abs(value - expected) < 1e-9:
                return value
            time.sleep(0.25)
        return value

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def prometheus(verifier, tiny_verifier, tmp_path_factory):
    server = Prometheus(tmp_path_factory.mktemp("prometheus"), [verifier.metrics_port, tiny_verifier.metrics_port])
    yield server
    server.close()


def submit(request_id, prompt, max_new_tokens=32, speculate=True, **sampling):
    params = pb.SamplingParams(max_new_tokens=max_new_tokens, **sampling)
    return pb.GenerateClientMessage(submit=pb.SubmitRequest(request_id=request_id, prompt_ids=prompt, sampling=params,
                                                            speculate=speculate))


def collect(stub, messages, expected: int) -> dict[str, dict]:
    """Send the messages on one stream; gather each request's tokens until `expected` have finished."""
    results: dict[str, dict] = {}
    stream = stub.Generate(iter(messages), timeout=300)
    for response in stream:
        for d in response.deltas:
            r = results.setdefault(d.request_id, {"tokens": [], "finish": None, "error": "", "spec": None})
            r["tokens"] += list(d.token_ids)
            r["spec"], r["preemptions"] = d.speculation, d.num_preemptions
            if d.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                r["finish"], r["error"], r["code"] = d.finish_reason, d.error, d.error_code
        if sum(r["finish"] is not None for r in results.values()) == expected:
            stream.cancel()
            break
    return results


def streaming(stub):
    """One stream of four long requests whose first tokens have arrived (cancel it when done)."""
    stream = stub.Generate(iter([submit(f"long{i}", p, 400) for i, p in enumerate(PROMPTS[:4])]), timeout=300)
    next(stream)
    return stream


def test_concurrent_requests_equal_plain_generation_and_speculate(verifier):
    """8 requests on one stream, plus the same prompt with speculation switched off and one that stops
    at a stop token id: all equal plain offline generation."""
    target = demo_model_dirs()["target"]
    runner = ModelRunner.load(RuntimeConfig(model_path=str(target), dtype="float32", device="cpu", max_total_tokens=2048))
    plain = generate_ids(runner, PROMPTS, [SamplingParams(temperature=0.0, max_new_tokens=32)] * len(PROMPTS), set())
    stop_at = plain[0].output_ids[10]
    messages = [submit(f"q{i}", p) for i, p in enumerate(PROMPTS)]
    messages += [submit("plain", PROMPTS[0], speculate=False), submit("stop", PROMPTS[0], stop_token_ids=[stop_at])]
    results = collect(verifier, messages, len(messages))
    reference = hf_model(target)
    for i, (prompt, p) in enumerate(zip(PROMPTS, plain)):
        r = results[f"q{i}"]
        assert r["finish"] == pb.FINISH_REASON_LENGTH and r["error"] == ""
        assert_greedy_match(r["tokens"], p.output_ids, reference, prompt, f"verifier q{i}")
    assert sum(r["spec"].accepted_tokens for r in results.values()) > 0
    assert all(r["spec"].fallbacks == 0 for r in results.values())
    off = results["plain"]
    assert off["finish"] == pb.FINISH_REASON_LENGTH and off["spec"].verify_steps == 0 and off["spec"].draft_tokens == 0
    assert_greedy_match(off["tokens"], plain[0].output_ids, reference, PROMPTS[0], "speculation off")
    stop, full = results["stop"], results["q0"]["tokens"]
    assert stop["finish"] == pb.FINISH_REASON_STOP and stop["tokens"] == full[: full.index(stop_at) + 1]


def test_bad_requests_are_refused_by_name_while_others_run(verifier):
    info = verifier.GetModelInfo(pb.ModelInfoRequest())
    bad = {
        "empty": (submit("empty", []), "the prompt is empty"),
        "oov": (submit("oov", [1, info.vocab_size + 5]), "outside the vocabulary"),
        "zero": (submit("zero", [1, 2], max_new_tokens=0), "max_new_tokens must be at least 1"),
        "huge": (submit("huge", [1, 2], max_new_tokens=10**7), "exceeds the context"),
        "temp": (submit("temp", [1, 2], temperature=-1.0), "temperature must be >= 0"),
        "topp": (submit("topp", [1, 2], top_p=1.5), "top_p must be in (0, 1]"),
        "freq": (submit("freq", [1, 2], frequency_penalty=2.5), "frequency_penalty must be in [-2, 2]"),
        "rep": (submit("rep", [1, 2], repetition_penalty=0.0), "repetition_penalty must be in (0, 10]"),
        "lps": (submit("lps", [1, 2], top_logprobs=21), "top logprobs must be in [0, 20]"),
    }
    messages = [submit("good-a", PROMPTS[0])] + [m for m, _ in bad.values()] + [submit("good-b", PROMPTS[1])]
    results = collect(verifier, messages, len(messages))
    for name, (_, text) in bad.items():
        assert results[name]["finish"] == pb.FINISH_REASON_ERROR
        assert results[name]["error"].startswith("INVALID_ARGUMENT") and text in results[name]["error"], results[name]
        assert results[name]["code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    for name in ("good-a", "good-b"):
        assert results[name]["finish"] == pb.FINISH_REASON_LENGTH and len(results[name]["tokens"]) == 32


def test_a_submit_batch_is_answered_request_by_request_as_if_each_came_alone(verifier):
    """The gateway sends what it had queued as one SubmitBatch: each request in it is checked, refused or run on
    its own (a bad one among good ones is refused by name), with the outputs the same requests get one by one."""
    info = verifier.GetModelInfo(pb.ModelInfoRequest())
    alone = collect(verifier, [submit("alone-a", PROMPTS[2], max_new_tokens=12), submit("alone-b", PROMPTS[3], max_new_tokens=12)], 2)
    batch = pb.SubmitBatch(requests=[submit("a", PROMPTS[2], max_new_tokens=12).submit,
                                     submit("oov", [1, info.vocab_size + 5]).submit,
                                     submit("b", PROMPTS[3], max_new_tokens=12).submit])
    results = collect(verifier, [pb.GenerateClientMessage(submits=batch)], 3)
    assert results["oov"]["finish"] == pb.FINISH_REASON_ERROR and "outside the vocabulary" in results["oov"]["error"]
    for name in ("a", "b"):
        assert results[name]["finish"] == pb.FINISH_REASON_LENGTH and results[name]["error"] == ""
        assert results[name]["tokens"] == alone[f"alone-{name}"]["tokens"], name
        assert results[name]["spec"].accepted_tokens > 0 and results[name]["spec"].fallbacks == 0


def test_penalties_and_logprobs_over_the_wire(verifier):
    """The wire's penalty and logprob fields reach the engine: speculative output with penalties equals
    offline plain decoding with them, and every token comes with its logprob and top-k."""
    target = demo_model_dirs()["target"]
    runner = ModelRunner.load(RuntimeConfig(model_path=str(target), dtype="float32", device="cpu", max_total_tokens=2048))
    params = SamplingParams(temperature=0.0, max_new_tokens=32, frequency_penalty=0.5, repetition_penalty=1.2, logprobs=3)
    plain = generate_ids(runner, PROMPTS[:4], [params] * 4, set())
    messages = [submit(f"p{i}", p, frequency_penalty=0.5, repetition_penalty=1.2, top_logprobs=3)
                for i, p in enumerate(PROMPTS[:4])]
    stream = verifier.Generate(iter(messages), timeout=300)
    got: dict[str, list] = {}
    finished, accepted = set(), 0
    for response in stream:
        for d in response.deltas:
            assert len(d.logprobs) == len(d.token_ids)
            got.setdefault(d.request_id, []).extend(
                (t, lp.logprob, list(lp.top_token_ids)) for t, lp in zip(d.token_ids, d.logprobs))
            if d.finish_reason:
                finished.add(d.request_id)
                accepted += d.speculation.accepted_tokens
        if len(finished) == 4:
            stream.cancel()
            break
    assert accepted > 0  # NGRAM drafted and the penalised target accepted some
    for i, request in enumerate(plain):
        rows = got[f"p{i}"]
        assert [t for t, _, _ in rows] == request.output_ids
        assert all(abs(lp - ref.logprob) < 1e-3 and len(top) == 3 for (_, lp, top), ref in zip(rows, request.logprobs))


def test_abort_and_model_info(verifier):
    info = verifier.GetModelInfo(pb.ModelInfoRequest())
    assert info.vocab_size == 4096 and info.speculative_algorithm == "NGRAM" and info.speculative_num_draft_tokens == 8
    assert not verifier.Abort(pb.AbortRequest(request_id="nobody")).found

    def messages():
        yield submit("long", PROMPTS[2], max_new_tokens=1500)
        time.sleep(1.0)
        yield pb.GenerateClientMessage(abort=pb.AbortRequest(request_id="long"))
        time.sleep(30)  # keep the stream open; the verifier ends it once "long" is done

    stream = verifier.Generate(messages(), timeout=120)
    tokens, finish = [], None
    for response in stream:
        for d in response.deltas:
            tokens += list(d.token_ids)
            finish = d.finish_reason or finish
        if finish:
            stream.cancel()
            break
    assert finish == pb.FINISH_REASON_ABORT and 0 < len(tokens) < 1500


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """The verifier's /metrics right now, straight from the exporter (Prometheus lags by a scrape)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_count_what_the_responses_report(verifier, prometheus):
    """Counts the responses carried, as Prometheus scraped them from the running verifier."""
    before = scrape(verifier.metrics_url)
    results = collect(verifier, [submit(f"m{i}", p, max_new_tokens=20) for i, p in enumerate(PROMPTS[:4])], 4)
    instance = f'instance="127.0.0.1:{verifier.metrics_port}"'

    def expect(name, grew_by, labels=()):
        want = before.get((name, labels), 0.0) + grew_by
        selector = ",".join([instance] + [f'{k}="{v}"' for k, v in labels])
        got = prometheus.wait_for(f"sum({name}{{{selector}}})", want)
        assert got == want, f"{name}{labels}: Prometheus has {got}, the responses say {want}"

    accepted = sum(r["spec"].accepted_tokens for r in results.values())
    drafted = sum(r["spec"].draft_tokens for r in results.values())
    steps = sum(r["spec"].verify_steps for r in results.values())
    positions = [sum(r["spec"].accepted_per_position[d] if d < len(r["spec"].accepted_per_position) else 0
                     for r in results.values()) for d in range(8)]
    assert accepted > 0
    expect("splitspec:spec_decode_num_accepted_tokens_total", accepted)
    expect("splitspec:spec_decode_num_draft_tokens_total", drafted)
    expect("splitspec:spec_decode_num_drafts_total", steps)
    expect("splitspec:spec_accept_length_count", steps)
    expect("splitspec:spec_decode_num_accepted_tokens_per_pos_total", positions[0], (("position", "0"),))
    expect("splitspec:generation_tokens_total", 4 * 20)
    expect("splitspec:prompt_tokens_total", sum(len(p) for p in PROMPTS[:4]))
    expect("splitspec:request_success_total", 4, (("finished_reason", "length"),))
    assert prometheus.query(f'sum(splitspec:step_phase_seconds_count{{{instance},phase="verify"}})') > 0
    for phase in ("schedule", "draft", "verify", "accept", "commit"):
        assert prometheus.query(f'sum(splitspec:step_phase_seconds_count{{{instance},phase="{phase}"}})'), phase
    # the engine loop's parts, one observation of each per step: the step's own time inside the loop's
    steps = prometheus.query(f'sum(splitspec:engine_loop_seconds_count{{{instance},part="step"}})')
    assert steps >= prometheus.query(f'sum(splitspec:step_phase_seconds_count{{{instance},phase="verify"}})') > 0
    for part in ("intake", "metrics", "publish", "hidden"):
        assert prometheus.query(f'sum(splitspec:engine_loop_seconds_count{{{instance},part="{part}"}})') == steps, part
    # every page in use is held by the evictable prefix cache alone; nothing runs or waits
    used = prometheus.query(f"splitspec:kv_pages_used{{{instance}}}")
    assert used == prometheus.query(f"splitspec:prefix_cache_pages{{{instance}}}")
    assert used + prometheus.query(f"splitspec:kv_pages_free{{{instance}}}") == 4096 // 16
    assert prometheus.query(f"splitspec:num_requests_running{{{instance}}}") == 0
    assert prometheus.query(f"splitspec:num_requests_waiting{{{instance}}}") == 0


def test_prefix_cache_hits_are_reported_and_keep_output(verifier, prometheus):
    shared = [13, 290] + list(range(400, 460))  # 62 tokens: 3 full pages of 16 are shareable
    first = collect(verifier, [submit("p1", shared + [5])], 1)["p1"]
    before = scrape(verifier.metrics_url).get(("splitspec:prefix_cache_hit_tokens_total", ()), 0.0)
    cached = []

    def again():
        yield submit("p2", shared + [5])

    stream = verifier.Generate(again(), timeout=120)
    tokens, finished = [], False
    for response in stream:
        for d in response.deltas:
            tokens += list(d.token_ids)
            if d.prompt_tokens:
                cached.append(d.cached_prompt_tokens)
            finished = finished or bool(d.finish_reason)
        if finished:
            stream.cancel()
            break
    assert cached and cached[0] == 48
    assert tokens == first["tokens"]
    query = f'splitspec:prefix_cache_hit_tokens_total{{instance="127.0.0.1:{verifier.metrics_port}"}}'
    assert prometheus.wait_for(query, before + 48) == before + 48


def test_sixteen_requests_complete_through_preemption_with_unchanged_output(tiny_verifier, prometheus):
    """16 concurrent requests (greedy, and seeded sampling) on a verifier whose KV cache holds a few
    at a time: some are preempted and re-queued, all finish, outputs equal plain generation with
    ample KV; afterwards every page is free or held by the prefix cache alone."""
    prompts = [[13, 290, 350 + i, 13, 290, 350 + i, 13, 700 + i] for i in range(16)]
    sampling = [dict(temperature=0.0) if i % 4 else dict(temperature=0.8, top_p=0.9, seed=40 + i) for i in range(16)]
    results = collect(tiny_verifier, [submit(f"t{i}", p, max_new_tokens=40, ignore_eos=True, **sampling[i])
                                      for i, p in enumerate(prompts)], 16)
    target = demo_model_dirs()["target"]
    runner = ModelRunner.load(RuntimeConfig(model_path=str(target), dtype="float32", device="cpu", max_total_tokens=4096))
    params = [SamplingParams(max_new_tokens=40, ignore_eos=True, **sampling[i]) for i in range(16)]
    plain = generate_ids(runner, prompts, params, set())
    reference = hf_model(target)
    for i, (prompt, p) in enumerate(zip(prompts, plain)):
        r = results[f"t{i}"]
        assert r["finish"] == pb.FINISH_REASON_LENGTH and r["error"] == "", r
        if sampling[i]["temperature"] == 0.0:
            assert_greedy_match(r["tokens"], p.output_ids, reference, prompt, f"preempted t{i}")
        else:
            assert r["tokens"] == p.output_ids, f"seeded t{i} changed through preemption"
    assert sum(r["spec"].accepted_tokens for r in results.values()) > 0
    assert all(r["spec"].fallbacks == 0 for r in results.values())
    instance = f'instance="127.0.0.1:{tiny_verifier.metrics_port}"'
    preempted = sum(r["preemptions"] for r in results.values())  # as each request's last delta reports
    assert preempted > 0, "the budget should have forced preemption"
    assert prometheus.wait_for(f"splitspec:num_preemptions_total{{{instance}}}", preempted) == preempted
    assert prometheus.wait_for(f'sum(splitspec:request_success_total{{{instance},finished_reason="length"}})', 16) == 16
    used = prometheus.query(f"splitspec:kv_pages_used{{{instance}}}")
    assert used == prometheus.query(f"splitspec:prefix_cache_pages{{{instance}}}")
    assert prometheus.query(f"splitspec:num_requests_running{{{instance}}}") == 0


def test_an_engine_failure_ends_requests_with_an_error_instead_of_hanging():
    """In-process worker over a runner whose forward breaks: every live request gets an error delta."""
    import threading

    from splitspec.verifier_svc.engine import Engine, SpecConfig
    from splitspec.verifier_svc.worker import EngineWorker, Submission

    target = demo_model_dirs()["target"]
    runner = ModelRunner.load(RuntimeConfig(model_path=str(target), dtype="float32", device="cpu", max_total_tokens=1024))

    def broken_forward(batch, **kwargs):  # what the engine passes: return_hidden, borrow
        raise RuntimeError("simulated device failure")

    runner.forward = broken_forward
    worker = EngineWorker(Engine(runner, None, SpecConfig(), set()))
    worker.start()
    done, seen = threading.Event(), []

    def deliver(request, event):
        seen.append(event)
        if len(seen) == 2:
            done.set()

    for i in range(2):
        worker.submit(Submission(f"x{i}", [1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=4), False, deliver))
    assert done.wait(60)
    assert all(e.finish_reason == "error" and "simulated device failure" in e.error for e in seen)
    assert runner.kv_cache.allocator.num_used == 0 and not worker.live


def test_a_step_that_stalls_has_the_engine_threads_stack_logged(caplog):
    """A step far longer than steps run (here a forward that stalls once, as a kernel compiling on first use does)
    gets one warning naming where the engine thread is; the request then completes with plain decoding's tokens."""
    import threading

    from splitspec.verifier_svc.engine import Engine, SpecConfig
    from splitspec.verifier_svc.worker import EngineWorker, Submission

    target = demo_model_dirs()["target"]
    runner = ModelRunner.load(RuntimeConfig(model_path=str(target), dtype="float32", device="cpu", max_total_tokens=1024))
    params = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    reference = generate_ids(runner, [[5, 6, 7]], [params], set())[0].output_ids
    forward, stalls = runner.forward, []

    def compiling_on_first_use(batch, **kwargs):
        if not stalls:
            stalls.append(1)
            time.sleep(1.5)
        return forward(batch, **kwargs)

    runner.forward = compiling_on_first_use
    worker = EngineWorker(Engine(runner, None, SpecConfig(), set()), stall_seconds=0.5)
    caplog.set_level("WARNING", logger="splitspec.verifier")
    worker.start()
    done, tokens = threading.Event(), []

    def deliver(request, event):
        tokens.extend(event.new_token_ids)
        if event.finish_reason is not None:
            done.set()

    worker.submit(Submission("s", [5, 6, 7], params, False, deliver))
    assert done.wait(60)
    assert tokens == reference
    warnings = [r.getMessage() for r in caplog.records if "an engine step has run for" in r.getMessage()]
    assert len(warnings) == 1 and "compiling_on_first_use" in warnings[0] and "time.sleep" in warnings[0], warnings
    assert worker.watchdog.reports == 1


def test_overlapped_publishing_keeps_every_stream_whole_and_in_order():
    """The serving loop's overlap (a step's metrics and deltas published during the next step's forward), run
    on CPU in process: speculating requests submitted while others decode and one aborted mid-stream get the
    same tokens as plain greedy generation, in order, each ending once; the abort's deltas end with it; the
    metrics count every token; and most publishes did happen inside a later step's forward."""
    import threading

    from prometheus_client import CollectorRegistry

    from splitspec.drafter_svc.ngram import NgramConfig, NgramDrafter
    from splitspec.verifier_svc.drafter_client import InProcessDrafterClient
    from splitspec.verifier_svc.engine import Engine, SpecConfig
    from splitspec.verifier_svc.metrics import EngineMetrics
    from splitspec.verifier_svc.worker import EngineWorker, Submission

    target = demo_model_dirs()["target"]
    runner = ModelRunner.load(RuntimeConfig(model_path=str(target), dtype="float32", device="cpu", max_total_tokens=4096))
    prompts = [list(range(13, 13 + n)) * 2 for n in (5, 9, 3, 7, 11, 4)]
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    reference = [g.output_ids for g in generate_ids(runner, prompts, [params] * len(prompts), set())]
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry, "demo")
    engine = Engine(runner, InProcessDrafterClient(NgramDrafter(NgramConfig())), SpecConfig(num_draft_tokens=6), set())
    inside = {"steps": 0, "published": 0}
    lock = threading.Lock()
    streams: dict[str, list] = {f"s{i}": [] for i in range(len(prompts))}
    ended = {name: threading.Event() for name in streams}

    def publish(deliveries):
        inside["published"] += 1
        inside["steps"] += worker.in_step
        with lock:
            for submission, event in deliveries:
                streams[submission.client_id].append(event)
                if event.finish_reason is not None:
                    ended[submission.client_id].set()

    worker = EngineWorker(engine, metrics, publish=publish, overlap=True)
    worker.in_step = False
    step = engine.step

    def marked_step():
        worker.in_step = True
        try:
            return step()
        finally:
            worker.in_step = False

    engine.step = marked_step
    worker.start()
    long = SamplingParams(temperature=0.0, max_new_tokens=400, ignore_eos=True)  # s4 is aborted long before its end
    submissions = [Submission(name, prompt, long if name == "s4" else params, True) for name, prompt in zip(streams, prompts)]
    for submission in submissions[:3]:
        worker.submit(submission)
    while sum(len(e.new_token_ids) for e in streams["s0"]) < 4:
        time.sleep(0.001)
    for submission in submissions[3:]:  # joining while the first three decode
        worker.submit(submission)
    while not streams["s4"]:
        time.sleep(0.001)
    assert worker.abort(submissions[4])
    for name, event in ended.items():
        assert event.wait(120), name
    time.sleep(0.2)
    for i, (name, events) in enumerate(streams.items()):
        tokens = [t for e in events for t in e.new_token_ids]
        assert [e.finish_reason for e in events if e.finish_reason] == [events[-1].finish_reason], name  # ends once, last
        if name == "s4":
            assert events[-1].finish_reason == "abort" and tokens[:24] == reference[i][: len(tokens)] and len(tokens) < 400
        else:
            assert tokens == reference[i] and events[-1].finish_reason == "length", (name, tokens, reference[i])
    generated = sum(len(e.new_token_ids) for events in streams.values() for e in events)
    assert registry.get_sample_value("splitspec:generation_tokens_total", {"model_name": "demo"}) == generated
    assert registry.get_sample_value("splitspec:spec_decode_num_accepted_tokens_total", {"model_name": "demo"}) > 0
    assert inside["steps"] > inside["published"] / 2, inside  # most went out under a later step's forward
    assert runner.kv_cache.allocator.num_used == 0


def test_a_request_bigger_than_the_kv_cache_is_refused_with_resource_exhausted(tiny_verifier):
    info = tiny_verifier.GetModelInfo(pb.ModelInfoRequest())
    assert info.max_context_tokens > 400  # fits the model's context, not the 320-token cache
    results = collect(tiny_verifier, [submit("big", [13, 290, 350], max_new_tokens=400), submit("ok", PROMPTS[0], 8)], 2)
    assert results["big"]["finish"] == pb.FINISH_REASON_ERROR and "--max-total-tokens" in results["big"]["error"]
    assert results["big"]["code"] == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert results["ok"]["finish"] == pb.FINISH_REASON_LENGTH and len(results["ok"]["tokens"]) == 8


def test_the_log_says_what_the_engine_does_a_line_per_prefill_and_every_few_decode_steps():
    """--decode-log-interval 4 (SGLang's "Prefill batch" / "Decode batch" lines): a line for each step that prefilled
    prompts, whose new requests add up to those sent, and one every 4 decode steps with the batch, the KV cache, the
    tokens/s since the last line, and NGRAM's accept length and drafted share; each decode line's tokens are at least
    its 4 steps' and at most what the requests generated in all. Started as `up` passes SGLang's launch flags:
    --enable-metrics without --metrics-port serves the metrics on --port + 1."""
    process, stub = start_verifier("--log-level", "info", "--decode-log-interval", "4", "--watchdog-timeout", "120",
                                   "--enable-cache-report", enable_metrics=True)  # SGLang's flags, as `up` passes them
    try:
        results = collect(stub, [submit(f"log{i}", p, max_new_tokens=24) for i, p in enumerate(PROMPTS[:3])], 3)
        generated = scrape(stub.metrics_url)[("splitspec:generation_tokens_total", ())]  # on --port + 1
    finally:
        stop(process, stub)
    assert all(len(r["tokens"]) == 24 and r["finish"] == pb.FINISH_REASON_LENGTH for r in results.values())
    assert generated == 3 * 24
    log = process.stderr.read()
    prefills = re.findall(r"prefill: (\d+) new request\(s\), (\d+) prompt tokens computed", log)
    assert sum(int(n) for n, _ in prefills) == 3 and sum(int(t) for _, t in prefills) == 3 * len(PROMPTS[0])
    decodes = re.findall(r"decode: (\d+) running, (\d+) waiting; KV cache ([\d.]+)% used[^;]*; ([\d.]+) tokens/s over "
                         r"the last 4 steps \(([\d.]+) ms a step\); speculation: (?:accept length ([\d.]+), )?(\d+)% "
                         r"of request-steps drafted", log)
    assert decodes and len(decodes) == log.count(" decode: "), log[-3000:]  # every line says how the requests drafted
    for running, waiting, kv, rate, step_ms, accept, drafted in decodes:
        assert 1 <= int(running) <= 3 and int(waiting) == 0 and 0 < float(kv) <= 100
        tokens = float(rate) * 4 * float(step_ms) / 1e3  # the line's tokens: its rate over its 4 steps' time
        assert 4 - 0.1 <= tokens <= 3 * 23 + 0.1 and 0 <= int(drafted) <= 100
    assert any(accept and float(accept) > 1 for *_, accept, _ in decodes)  # NGRAM's drafts accepted on these prompts


def test_a_step_past_the_watchdog_timeout_ends_the_process_with_its_stack_logged():
    """--watchdog-timeout (SGLang's): the engine's StepWatchdog, in a process of its own, over a thread whose "step"
    never ends: a warning with the thread's stack once the step passes the stall threshold, then, past the timeout,
    an error with the stack and the process's exit with the watchdog's code (a hung verifier ends, and its deployment
    starts it again); a step that ends in time leaves the process alone."""
    script = """
import logging, sys, threading, time
from splitspec.verifier_svc.step_watchdog import StepWatchdog
logging.basicConfig(level=logging.INFO)

class Worker:
    step_began = None
    ident = None

def steps(worker, hang):
    worker.step_began = time.perf_counter()
    time.sleep(0.05)  # a step that ends in time
    worker.step_began = None
    time.sleep(0.05)
    if hang:
        worker.step_began = time.perf_counter()
        threading.Event().wait()  # a step that never ends

worker = Worker()
thread = threading.Thread(target=steps, args=(worker, sys.argv[1] == "hang"), daemon=True)
thread.start()
worker.ident = thread.ident
StepWatchdog(worker, threshold_s=0.5, exit_after_s=1.5).start()
thread.join(5)
print("the process went on", flush=True)
"""
    from splitspec.verifier_svc.step_watchdog import EXIT_CODE

    hung = subprocess.run([sys.executable, "-P", "-c", script, "hang"], capture_output=True, text=True, timeout=120)
    assert hung.returncode == EXIT_CODE and "went on" not in hung.stdout, hung.stderr[-3000:]
    assert "WARNING" in hung.stderr and "an engine step has run for" in hung.stderr
    assert "past --watchdog-timeout (1.5 s): the verifier exits" in hung.stderr and "in steps" in hung.stderr
    fine = subprocess.run([sys.executable, "-P", "-c", script, "fine"], capture_output=True, text=True, timeout=120)
    assert fine.returncode == 0 and "the process went on" in fine.stdout and "engine step" not in fine.stderr


def test_stream_interval_sends_the_first_token_at_once_then_every_fourth_and_the_last(verifier, tiny_verifier):
    """--stream-interval 4: a request's first token comes in a delta of its own, then deltas of 4 tokens or more (a
    speculative step may bring more), and its last delta whatever remains with the finish; the tokens are the same
    as a verifier streaming every step's."""
    messages = [submit("p12", PROMPTS[1], 12, speculate=False), submit("p13", PROMPTS[2], 13, speculate=False),
                submit("s", PROMPTS[3], 30)]
    sizes: dict[str, list[int]] = {}
    tokens: dict[str, list[int]] = {}
    stream = tiny_verifier.Generate(iter(messages), timeout=300)
    finished = 0
    for response in stream:
        for d in response.deltas:
            sizes.setdefault(d.request_id, []).append(len(d.token_ids))
            tokens.setdefault(d.request_id, []).extend(d.token_ids)
            finished += d.finish_reason != pb.FINISH_REASON_UNSPECIFIED
        if finished == len(messages):
            stream.cancel()
            break
    # one token a step: deltas end after tokens 1, 5, 9 and at the last ([1, 4, 4, 3]), or fewer of them where the
    # reader fell behind and a request's waiting deltas were merged; every step's would end after 1, 2, 3, ...
    for request_id, length in (("p12", 12), ("p13", 13)):
        ends = list(itertools.accumulate(sizes[request_id]))
        assert ends[-1] == length and len(ends) >= 2 and set(ends[:-1]) <= {1, 5, 9}, sizes
    assert len(sizes["s"]) >= 2 and all(n >= 4 for n in sizes["s"][1:-1]) and sum(sizes["s"]) == 30, sizes
    every_step = collect(verifier, messages, len(messages))
    assert {k: v["tokens"] for k, v in every_step.items()} == tokens
    assert every_step["s"]["spec"].accepted_tokens > 0
    # a submission's own interval (SubmitRequest.stream_interval, what the gateway asks for an answer it does not
    # stream) over the verifier's: 6 on a verifier streaming every step, 1 on one streaming every fourth token
    for stub, interval, allowed in ((verifier, 6, {1, 7, 13}), (tiny_verifier, 1, set(range(1, 17)))):
        message = submit("own", PROMPTS[4], 17, speculate=False)
        message.submit.stream_interval = interval
        ends = []
        for response in stub.Generate(iter([message]), timeout=300):
            ends += [(ends[-1] if ends else 0) + len(d.token_ids) for d in response.deltas]
            if any(d.finish_reason != pb.FINISH_REASON_UNSPECIFIED for d in response.deltas):
                break
        assert ends[-1] == 17 and set(ends[:-1]) <= allowed, (interval, ends)
        assert interval > 1 or not set(ends[:-1]) <= {1, 5, 9, 13}, ends  # not the verifier's 4


def token_delta(request_id, tokens, finish=pb.FINISH_REASON_UNSPECIFIED, verify_steps=0):
    """A TokenDelta as the engine files it (its speculation counts: verify_steps and per-position acceptance so far)."""
    return pb.TokenDelta(request_id=request_id, token_ids=tokens, finish_reason=finish,
                         logprobs=[pb.TokenLogprob(logprob=-t) for t in tokens],
                         speculation=pb.SpeculationCounts(verify_steps=verify_steps,
                                                          accepted_per_position=[verify_steps, verify_steps - 1][:verify_steps]))


def test_a_requests_deltas_that_wait_for_a_slow_reader_are_merged_in_order():
    """A Generate call's Stream: deltas filed while the writer is busy go out as one delta per request (tokens and
    logprobs appended in order, the latest counts and the finish kept), other requests' apart."""
    async def run():
        stream = Stream()
        for d in (token_delta("a", [1], verify_steps=1), token_delta("b", [7]), token_delta("a", [2, 3], verify_steps=2),
                  token_delta("a", [4], pb.FINISH_REASON_LENGTH, verify_steps=3)):
            stream.put(d)
        first = await stream.take()
        assert [d.request_id for d in first] == ["a", "b"]
        a = first[0]
        assert list(a.token_ids) == [1, 2, 3, 4] and [lp.logprob for lp in a.logprobs] == [-1, -2, -3, -4]
        assert a.speculation.verify_steps == 3 and a.finish_reason == pb.FINISH_REASON_LENGTH
        assert list(a.speculation.accepted_per_position) == [3, 2]  # the latest counts, not every delta's appended
        stream.put(token_delta("a", [9]))  # a finished request's id submitted again: its own delta, not merged
        stream.put(token_delta("a", [10]))
        assert [list(d.token_ids) for d in await stream.take()] == [[9, 10]]

    asyncio.run(run())


def test_an_interval_holds_a_requests_tokens_until_due_its_first_and_last_at_once():
    """Submission.due (the engine's publish, --stream-interval): with 3, the first token goes alone, then the tokens
    are held until 3 or more have gathered (a speculative step's 2 on top of 2 held go as 4), and the last delta takes
    what remains with the finish; logprobs travel with their tokens."""
    submission = Submission("x", [1, 2], SamplingParams(), False, interval=3)
    sent = []
    for tokens, finish in (([1], None), ([2], None), ([3], None), ([4, 5], None), ([6], None), ([7], "length")):
        event = StepEvent("x", tokens, finish, logprobs=[TokenLogprob(-t, ()) for t in tokens])
        due = submission.due(event)
        if due is not None:
            assert [lp.logprob for lp in due[1]] == [-t for t in due[0]]
            sent.append(due[0])
            submission.first = False  # as the publishers do once a delta went
    assert sent == [[1], [2, 3, 4, 5], [6, 7]]
    assert submission.held == [] and submission.held_logprobs == []
    every = Submission("y", [1], SamplingParams(), False)
    assert [every.due(StepEvent("y", [t], None))[0] for t in (1, 2, 3)] == [[1], [2], [3]]


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def _cmdline(pid: int) -> list[str]:
    """A process's argv; empty once it is gone (or a zombie)."""
    try:
        return [a for a in Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0") if a]
    except OSError:
        return []


def test_grpc_runs_in_a_front_process_that_lives_and_dies_with_the_engine(verifier):
    """The gRPC server (streams, protobuf) is the verifier's child process, not a thread beside the engine;
    the same requests give the same tokens with --disable-frontend-multiprocessing (gRPC on the engine's
    process); a front that dies ends its verifier, and a verifier that dies takes its front with it; SIGTERM (how `up`
    and docker stop it) stops both. The link's socket directory is gone once the verifier serves (its connections
    outlive the files), so however the verifier ends, even killed, it leaves nothing in /tmp."""
    process, stub = start_verifier("--max-total-tokens", "2048", "--disable-frontend-multiprocessing")
    try:
        assert not [c for c in _children(process.pid) if "front_process" in " ".join(_cmdline(c))]
        messages = [submit(f"q{i}", p, 24) for i, p in enumerate(PROMPTS[:4])]
        here = collect(stub, messages, len(messages))
        # SIGTERM while streams decode, handled on the loop: the streams end, then the engine thread's loop (a process
        # exiting under a running step died of SIGABRT in libtorch's teardown), and it exits as a front's verifier does
        live = streaming(stub)
        process.terminate()
        assert process.wait(timeout=60) == 128 + signal.SIGTERM, process.stderr.read()[-2000:]
        live.cancel()
    finally:
        stop(process, stub)
    apart = collect(verifier, messages, len(messages))
    assert {k: r["tokens"] for k, r in here.items()} == {k: r["tokens"] for k, r in apart.items()}
    assert all(r["finish"] == pb.FINISH_REASON_LENGTH for r in apart.values())
    assert sum(r["spec"].accepted_tokens for r in apart.values()) > 0  # speculation ran on both
    assert sum(r["spec"].accepted_tokens for r in here.values()) > 0

    # SIGTERM while it waits for drafters that never come (neither gRPC's nor the wait's thread holds it)
    waiting = spawn_service([sys.executable, "-P", "-m", "splitspec", "verifier", "--port", str(free_port()),
                             "--dtype", "float32", "--speculative-algorithm", "NGRAM", "--max-total-tokens", "2048",
                             "--drafter-bind-addr", f"tcp://127.0.0.1:{free_port()}", "--wait-for-drafters", "1",
                             "--disable-frontend-multiprocessing"])
    try:
        deadline = time.time() + 180
        while "waiting for 1 drafters" not in waiting.stderr.read():
            assert waiting.poll() is None and time.time() < deadline, waiting.stderr.read()
            time.sleep(0.3)
        waiting.terminate()
        assert waiting.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        waiting.kill()

    for victim in ("front", "engine", "terminated"):
        process, stub = start_verifier("--max-total-tokens", "2048")
        fronts = [c for c in _children(process.pid) if "splitspec.verifier_svc.front_process" in _cmdline(c)]
        assert len(fronts) == 1 and f"127.0.0.1:{stub.port}" in _cmdline(fronts[0])
        front = fronts[0]
        assert "libtorch" not in Path(f"/proc/{front}/maps").read_text()  # a light process: gRPC and protobuf only
        argv = _cmdline(front)
        sockets = Path(argv[argv.index("--engine") + 1].removeprefix("ipc://")).parent  # the link's socket directory
        assert sockets.name.startswith("splitspec-verifier-") and not sockets.exists()
        if victim == "terminated":  # as `up` and docker stop it; it served through the links first, and streams
            served = collect(stub, messages[:2], 2)
            assert {k: r["tokens"] for k, r in served.items()} == {k: apart[k]["tokens"] for k in served}
            live = streaming(stub)
            process.terminate()
        else:
            os.kill(front if victim == "front" else process.pid, signal.SIGKILL)
        try:
            process.wait(timeout=30)  # the engine ends with its front (exit 1), or was killed, or stopped
        finally:
            if victim == "terminated":
                live.cancel()
            stub.channel.close()
        assert process.returncode == {"front": 1, "engine": -signal.SIGKILL, "terminated": 128 + signal.SIGTERM}[victim]
        deadline = time.time() + 5
        while _cmdline(front) and time.time() < deadline:
            time.sleep(0.1)
        assert not _cmdline(front), f"the front outlived its verifier ({victim})"
        if victim == "front":
            assert "the gRPC front process exited" in process.stderr.read()
        assert not sockets.exists(), victim
