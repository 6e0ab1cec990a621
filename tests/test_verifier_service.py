"""`splitspec verifier` as a real process, driven over gRPC: concurrent requests on one stream equal
plain offline generation and are speculated; bad requests are refused by name while the others run;
abort works; health and model info answer."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import assert_greedy_match, hf_model

from splitspec.demo import demo_model_dirs
from splitspec.generate import generate_ids
from splitspec.protos import verifier_pb2 as pb
from splitspec.protos import verifier_pb2_grpc as pb_grpc
from splitspec.runtime.runner import ModelRunner, RuntimeConfig
from splitspec.runtime.sampling_params import SamplingParams

PROMPTS = [[13, 290, 350 + i, 13, 290, 350 + i, 13] for i in range(8)]  # repetitive: NGRAM drafts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def verifier():
    port, metrics_port = free_port(), free_port()
    process = subprocess.Popen(
        [sys.executable, "-P", "-m", "splitspec", "verifier", "--port", str(port), "--max-total-tokens", "4096",
         "--metrics-port", str(metrics_port),
         "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "8", "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
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
    stub.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    yield stub
    channel.close()
    process.terminate()
    process.wait(timeout=30)


def submit(request_id, prompt, max_new_tokens=32, **sampling):
    params = pb.SamplingParams(max_new_tokens=max_new_tokens, **sampling)
    return pb.GenerateClientMessage(submit=pb.SubmitRequest(request_id=request_id, prompt_ids=prompt, sampling=params,
                                                            speculate=True))


def collect(stub, messages, expected: int) -> dict[str, dict]:
    """Send the messages on one stream; gather each request's tokens until `expected` have finished."""
    results: dict[str, dict] = {}
    stream = stub.Generate(iter(messages), timeout=300)
    for response in stream:
        for d in response.deltas:
            r = results.setdefault(d.request_id, {"tokens": [], "finish": None, "error": "", "spec": None})
            r["tokens"] += list(d.token_ids)
            r["spec"] = d.speculation
            if d.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                r["finish"], r["error"] = d.finish_reason, d.error
        if sum(r["finish"] is not None for r in results.values()) == expected:
            stream.cancel()
            break
    return results


def test_concurrent_requests_equal_plain_generation_and_speculate(verifier):
    results = collect(verifier, [submit(f"q{i}", p) for i, p in enumerate(PROMPTS)], len(PROMPTS))
    target = demo_model_dirs()["target"]
    runner = ModelRunner.load(RuntimeConfig(model_path=str(target), dtype="float32", device="cpu", max_total_tokens=2048))
    plain = generate_ids(runner, PROMPTS, [SamplingParams(temperature=0.0, max_new_tokens=32)] * len(PROMPTS), set())
    reference = hf_model(target)
    for i, (prompt, p) in enumerate(zip(PROMPTS, plain)):
        r = results[f"q{i}"]
        assert r["finish"] == pb.FINISH_REASON_LENGTH and r["error"] == ""
        assert_greedy_match(r["tokens"], p.output_ids, reference, prompt, f"verifier q{i}")
    assert sum(r["spec"].accepted_tokens for r in results.values()) > 0
    assert all(r["spec"].fallbacks == 0 for r in results.values())


def test_bad_requests_are_refused_by_name_while_others_run(verifier):
    info = verifier.GetModelInfo(pb.ModelInfoRequest())
    bad = {
        "empty": (submit("empty", []), "the prompt is empty"),
        "oov": (submit("oov", [1, info.vocab_size + 5]), "outside the vocabulary"),
        "zero": (submit("zero", [1, 2], max_new_tokens=0), "max_new_tokens must be at least 1"),
        "huge": (submit("huge", [1, 2], max_new_tokens=10**7), "exceeds the context"),
        "temp": (submit("temp", [1, 2], temperature=-1.0), "temperature must be >= 0"),
        "topp": (submit("topp", [1, 2], top_p=1.5), "top_p must be in (0, 1]"),
    }
    messages = [submit("good-a", PROMPTS[0])] + [m for m, _ in bad.values()] + [submit("good-b", PROMPTS[1])]
    results = collect(verifier, messages, len(messages))
    for name, (_, text) in bad.items():
        assert results[name]["finish"] == pb.FINISH_REASON_ERROR
        assert results[name]["error"].startswith("INVALID_ARGUMENT") and text in results[name]["error"], results[name]
    for name in ("good-a", "good-b"):
        assert results[name]["finish"] == pb.FINISH_REASON_LENGTH and len(results[name]["tokens"]) == 32


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
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_count_what_the_responses_report(verifier):
    before = scrape(verifier.metrics_url)
    results = collect(verifier, [submit(f"m{i}", p, max_new_tokens=20) for i, p in enumerate(PROMPTS[:4])], 4)
    after = scrape(verifier.metrics_url)

    def grew(name, labels=()):
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    accepted = sum(r["spec"].accepted_tokens for r in results.values())
    drafted = sum(r["spec"].draft_tokens for r in results.values())
    steps = sum(r["spec"].verify_steps for r in results.values())
    assert accepted > 0
    assert grew("splitspec:spec_decode_num_accepted_tokens_total") == accepted
    assert grew("splitspec:spec_decode_num_draft_tokens_total") == drafted
    assert grew("splitspec:spec_decode_num_drafts_total") == steps
    assert grew("splitspec:spec_accept_length_count") == steps
    assert grew("splitspec:generation_tokens_total") == 4 * 20
    assert grew("splitspec:prompt_tokens_total") == sum(len(p) for p in PROMPTS[:4])
    assert grew("splitspec:request_success_total", (("finished_reason", "length"),)) == 4
    assert grew("splitspec:step_phase_seconds_count", (("phase", "verify"),)) > 0
    # every page in use is held by the evictable prefix cache alone
    assert after[("splitspec:kv_pages_used", ())] == after[("splitspec:prefix_cache_pages", ())]
    assert after[("splitspec:num_requests_running", ())] == 0


def test_prefix_cache_hits_are_reported_and_keep_output(verifier):
    shared = [13, 290] + list(range(400, 460))  # 62 tokens: 3 full pages of 16 are shareable
    before = scrape(verifier.metrics_url)
    first = collect(verifier, [submit("p1", shared + [5])], 1)["p1"]
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
    after = scrape(verifier.metrics_url)
    assert cached and cached[0] == 48
    assert tokens == first["tokens"]
    hits = after[("splitspec:prefix_cache_hit_tokens_total", ())] - before.get(("splitspec:prefix_cache_hit_tokens_total", ()), 0)
    assert hits >= 48


def test_an_engine_failure_ends_requests_with_an_error_instead_of_hanging():
    """In-process worker over a runner whose forward breaks: every live request gets an error delta."""
    import threading

    from splitspec.verifier_svc.engine import Engine, SpecConfig
    from splitspec.verifier_svc.worker import EngineWorker, Submission

    target = demo_model_dirs()["target"]
    runner = ModelRunner.load(RuntimeConfig(model_path=str(target), dtype="float32", device="cpu", max_total_tokens=1024))

    def broken_forward(batch, return_hidden=False):
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
    assert runner.kv_cache.allocator.num_used == 0 and worker.reserved_pages == 0
