"""The overlap schedule (verifier_svc/overlap.py): plain decoding steps launched before the last step's tokens have
landed give what steps run one after another give (outputs, streams, finish reasons), through arrivals, stop
tokens, aborts, penalties and logprobs beside them, preemption and the prefix cache, and leave no page behind;
served (`splitspec verifier --async-scheduling`, gRPC) the same, with the deferred steps counted in its metrics."""

from __future__ import annotations

import urllib.request

import pytest
import torch
from test_verifier_service import collect, start_verifier, stop, submit

from splitspec.demo import SHIPPED_ROOT, demo_model_dirs
from splitspec.generate import generate_ids
from splitspec.protos import verifier_pb2 as pb
from splitspec.runtime.runner import ModelRunner, RuntimeConfig
from splitspec.runtime.sampling_params import SamplingParams
from splitspec.verifier_svc.engine import Engine, SpecConfig
from splitspec.verifier_svc.overlap import InFlight
from splitspec.verifier_svc.prefix_cache import PrefixCache


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 4000, (12 + 3 * i,), generator=g).tolist() for i in range(n)]


@pytest.fixture(scope="module")
def target():
    """The shipped demo target (a GPU call carries it without the demo draft, which demo_model_dirs would rebuild)."""
    shipped = SHIPPED_ROOT / "target"
    return shipped if (shipped / "config.json").exists() else demo_model_dirs()["target"]


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


def runner_for(target, max_total_tokens: int, device: str = "cpu") -> ModelRunner:
    """The demo target; on a GPU with its CUDA graphs and pinned, event-ordered copies (the overlap's real case)."""
    return ModelRunner.load(RuntimeConfig(model_path=str(target), dtype="float32", device=device,
                                          max_total_tokens=max_total_tokens, page_size=16))


def drive(runner, overlap: bool, script: dict, cache: bool, drafter=None, spec: SpecConfig | None = None,
          policy=None) -> dict:
    """Run script ({step: [("add", key, prompt, params[, speculate]) | ("abort", key)]}) to the end; every request's
    output, finish reason and streamed tokens, and the run's counts."""
    engine = Engine(runner, drafter, spec or SpecConfig(), {2}, prefix_cache=PrefixCache(runner.kv_cache.allocator, 16)
                    if cache else None, overlap_schedule=overlap)
    if policy is not None:
        engine.adaptive = policy
    requests, streamed, finishes = {}, {}, {}
    steps = deferred = preemptions = 0
    while any(s >= steps for s in script) or engine.has_work:
        for action in script.get(steps, []):
            if action[0] == "add":
                requests[action[1]] = engine.add_request(action[2], action[3], *action[4:])
            else:
                engine.abort(requests[action[1]])
        by_id = {r.request_id: key for key, r in requests.items()}
        for event in engine.step():
            key = by_id[event.request_id]
            streamed.setdefault(key, []).extend(event.new_token_ids)
            if event.finish_reason is not None:
                assert key not in finishes, f"{key} finished twice"
                finishes[key] = event.finish_reason
        steps += 1
        deferred += engine.report.deferred
        preemptions += engine.report.preemptions
    return {"outputs": {k: r.output_ids for k, r in requests.items()}, "finish": {k: r.finish_reason for k, r in requests.items()},
            "logprobs": {k: r.logprobs for k, r in requests.items()},
            "stats": {k: r.stats for k, r in requests.items()},
            "streamed": streamed, "finishes": finishes, "steps": steps, "deferred": deferred, "preemptions": preemptions,
            "engine": engine}


def mixed_script(stop_token: int) -> dict:
    p = prompts(10)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24)
    return {
        0: [("add", f"g{i}", p[i], SamplingParams(temperature=0.0, max_new_tokens=16 + 3 * i)) for i in range(4)]
           + [("add", f"s{i}", p[4 + i], SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_new_tokens=20 + i))
              for i in range(3)]
           + [("add", "stop", p[0], SamplingParams(temperature=0.0, max_new_tokens=40, stop_token_ids=[stop_token]))],
        4: [("add", "late", p[7], greedy)],
        9: [("abort", "g1")],
        14: [("add", "penalty", p[8], SamplingParams(temperature=0.0, max_new_tokens=10, frequency_penalty=0.8)),
             ("add", "logprobs", p[9], SamplingParams(temperature=0.0, max_new_tokens=24, logprobs=2))],
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache", [True, False], ids=["prefix-cache", "no-cache"])
def test_overlapped_plain_steps_give_what_serial_steps_give(target, cache, device, monkeypatch):
    runner = runner_for(target, 4096, device)
    landed = []  # the logprobs each landing of a step in flight read
    original = InFlight.landed_logprobs
    monkeypatch.setattr(InFlight, "landed_logprobs", lambda flight: landed.append(original(flight)) or landed[-1])
    first = drive(runner, False, {0: [("add", "probe", prompts(1)[0], SamplingParams(temperature=0.0, max_new_tokens=16))]},
                  cache=False)["outputs"]["probe"]
    stop_token = first[5]
    serial = drive(runner, False, mixed_script(stop_token), cache)
    overlapped = drive(runner, True, mixed_script(stop_token), cache)
    assert serial["deferred"] == 0 and overlapped["deferred"] >= overlapped["steps"] // 2, overlapped
    for key, output in serial["outputs"].items():
        if key == "g1":  # aborted: at a different length, the shorter a prefix of the longer
            short, long = sorted((output, overlapped["outputs"][key]), key=len)
            assert long[: len(short)] == short and overlapped["finish"][key] == "abort"
            continue
        assert overlapped["outputs"][key] == output, key
        assert overlapped["finish"][key] == serial["finish"][key], key
        for run in (serial, overlapped):  # every token streamed once, in order; every end reported once
            assert run["streamed"][key] == run["outputs"][key] and run["finishes"][key] == run["finish"][key], key
    # logprobs computed at the launch and copied with the tokens: the serial steps' (the request is deferred with the rest)
    have, want = overlapped["logprobs"]["logprobs"], serial["logprobs"]["logprobs"]
    assert len(have) == len(want) == len(serial["outputs"]["logprobs"])
    for a, b in zip(have, want):
        assert abs(a.logprob - b.logprob) < 1e-5 and [t for t, _ in a.top] == [t for t, _ in b.top] and len(a.top) == 2
    assert sum(1 for lps in landed if lps) >= 5  # the request's tokens landed from steps in flight, logprobs and all
    stop = overlapped["outputs"]["stop"]
    assert overlapped["finish"]["stop"] == "stop" and stop == first[: first.index(stop_token) + 1]
    assert overlapped["finish"]["g0"] == "length" and overlapped["engine"].in_flight is None
    kv = runner.kv_cache
    held = 0 if not cache else sum(1 for page in range(kv.num_pages) if kv.allocator.refcount(page))
    assert kv.allocator.num_free + held == kv.num_pages and (cache or held == 0)


@pytest.mark.parametrize("device", DEVICES)
def test_preemption_lands_the_step_in_flight_first_and_keeps_outputs(target, device):
    """A pool of 12 pages (192 tokens) for 8 requests of ~30-50 tokens: requests are preempted and readmitted."""
    runner = runner_for(target, 192, device)
    p = prompts(8, seed=1)
    script = {0: [("add", f"r{i}", p[i], SamplingParams(temperature=0.0 if i % 2 else 0.7, seed=i, max_new_tokens=24))
                  for i in range(8)]}
    serial = drive(runner, False, script, cache=False)
    overlapped = drive(runner, True, script, cache=False)
    assert serial["preemptions"] > 0 and overlapped["preemptions"] > 0 and overlapped["deferred"] > 0
    assert overlapped["outputs"] == serial["outputs"] and overlapped["finish"] == serial["finish"]
    assert runner.kv_cache.allocator.num_free == runner.kv_cache.num_pages


class ScriptedPolicy:
    """A load-adaptive policy's interface choosing budgets from a script (drafting off for `off` choices, then a tree
    budget of `on` for `burst` choices, again and again), so that the overlap meets drafting turned off and on."""

    def __init__(self, off: int, burst: int, on: int = 8):
        self.cycle, self.calls, self.budget, self.predicted = [1] * off + [on] * burst, 0, on, {}

    def choose(self, speculating: int, plain: int = 0, prefill_tokens: int = 0) -> int:
        self.budget = self.cycle[self.calls % len(self.cycle)]
        self.calls += 1
        return self.budget

    def observe(self, step) -> None:
        pass

    def settled_off(self, speculating: int, plain: int) -> int:
        return 0  # every choice is the script's: none is skipped

    def observe_quiet(self, speculating: int, plain: int, skipped: int, cycles: list, budget: int = 1) -> None:
        pass  # an opted-out run's cycles (policy_link._quiet_opted_out)


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "scripted-policy"])
def test_plain_requests_beside_a_drafter_overlap_until_one_speculates(target, adaptive):
    """An NGRAM drafter in the engine, fixed trees or a policy's budgets (ScriptedPolicy: the real one follows this
    machine's timings): requests that do not speculate are overlapped; a speculating request's arrival lands the step
    in flight and its trees are verified (speculation happens, no fallback); outputs equal serial steps'."""
    from splitspec.drafter_svc.ngram import NgramConfig, NgramDrafter
    from splitspec.verifier_svc.drafter_client import InProcessDrafterClient

    runner = runner_for(target, 4096)
    p = prompts(4, seed=3)
    repetitive = [13, 290, 351, 13, 290, 351, 13, 290, 351, 13]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=40)
    script = {0: [("add", f"plain{i}", p[i], greedy, False) for i in range(4)],
              8: [("add", "spec", repetitive, SamplingParams(temperature=0.0, max_new_tokens=16), True)]}
    spec = SpecConfig(num_draft_tokens=8, adaptive=adaptive)
    runs = [drive(runner, overlap, script, cache=False, drafter=InProcessDrafterClient(NgramDrafter(NgramConfig())),
                  spec=spec, policy=ScriptedPolicy(0, 1) if adaptive else None) for overlap in (False, True)]
    serial, overlapped = runs
    assert overlapped["outputs"] == serial["outputs"] and overlapped["finish"] == serial["finish"]
    assert serial["deferred"] == 0 and overlapped["deferred"] > 0
    for run in runs:
        stats = run["stats"]["spec"]
        assert stats.draft_tokens > 0 and stats.accepted_tokens > 0 and stats.fallbacks == 0
        assert all(run["stats"][f"plain{i}"].draft_tokens == 0 for i in range(4))


def in_process_drafter(kind: str, runner, target):
    """An NGRAM drafter, or a shipped demo head (hidden-state drafters: EAGLE reads the target's last state, EAGLE3
    the inputs of three layers, which the runner captures), in the engine's process."""
    from splitspec.verifier_svc.drafter_client import InProcessDrafterClient

    if kind == "NGRAM":
        from splitspec.drafter_svc.ngram import NgramConfig, NgramDrafter

        return InProcessDrafterClient(NgramDrafter(NgramConfig()))
    from test_draft_loading import flags

    from splitspec.draft_models import build_drafter, capture_for
    from splitspec.speculation import resolve

    drafter = build_drafter(resolve(flags(
        "--speculative-algorithm", kind, "--speculative-draft-model-path", str(SHIPPED_ROOT / kind.lower()),
        "--model-path", str(target), "--max-total-tokens", "4096", "--speculative-num-steps", "3",
        "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "8")), target=runner)
    capture_for(runner, drafter.hidden_state_layers)
    return InProcessDrafterClient(drafter)


@pytest.mark.parametrize("kind", ["NGRAM"] + [pytest.param(head, marks=pytest.mark.skipif(
    not (SHIPPED_ROOT / head.lower() / "config.json").exists(), reason=f"the demo {head} head is not in this tree"))
    for head in ("EAGLE", "EAGLE3")])
@pytest.mark.parametrize("script", [(12, 3), (3, 1), (20, 2)], ids=["long-off", "short-off", "off-with-feeds"])
def test_speculating_requests_overlap_while_drafting_is_off(target, script, kind):
    """A drafter (NGRAM; the demo EAGLE and EAGLE-3 heads, which need the target's states) and a policy that turns drafting off
    and on: while it is off the speculating requests' steps overlap (their tokens, and the head's states of the steps
    that sampled them, fed as they land), when it turns on the step in flight lands and trees are asked from the last
    token: no fallback, speculation accepted, outputs (greedy and seeded) equal serial steps'."""
    runner = runner_for(target, 4096)
    repetitive = [[13, 290, 351 + i, 13, 290, 351 + i, 13, 290, 351 + i, 13] for i in range(3)]
    params = [SamplingParams(temperature=0.0, max_new_tokens=48), SamplingParams(temperature=0.0, max_new_tokens=40),
              SamplingParams(temperature=0.8, seed=3, max_new_tokens=44)]
    script_steps = {0: [("add", f"r{i}", repetitive[i], params[i], True) for i in range(3)]}
    runs = []
    for overlap in (False, True):
        policy = ScriptedPolicy(*script)
        run = drive(runner, overlap, script_steps, cache=False, drafter=in_process_drafter(kind, runner, target),
                    spec=SpecConfig(num_draft_tokens=8, adaptive=True), policy=policy)
        runs.append(run)
    serial, overlapped = runs
    assert overlapped["outputs"] == serial["outputs"] and overlapped["finish"] == serial["finish"]
    assert serial["deferred"] == 0 and overlapped["deferred"] > 0
    for run in runs:
        assert sum(s.draft_tokens for s in run["stats"].values()) > 0
        assert sum(s.accepted_tokens for s in run["stats"].values()) > 0
        assert all(s.fallbacks == 0 for s in run["stats"].values()), run["stats"]
    # the same trees either way: the drafter was fed the same tokens (and the head the same states of the target's)
    drafted = [{k: (s.draft_tokens, s.accepted_tokens) for k, s in run["stats"].items()} for run in runs]
    assert drafted[0] == drafted[1], drafted


@pytest.mark.skipif(not (SHIPPED_ROOT / "eagle3" / "config.json").exists(), reason="the demo EAGLE3 head is not in this tree")
def test_aborts_inside_a_drafting_off_run_leave_the_others_states_in_order(target):
    """Two of four EAGLE-3 requests aborted while drafting is off and their steps overlap (their rows in the run's
    states, draft_features.RunStates, never fed): the others' outputs and drafted and accepted counts equal serial
    steps', no fallback, no page left behind."""
    runner = runner_for(target, 4096)
    prompts_ = [[13, 290, 351 + i, 13, 290, 351 + i, 13, 290, 351 + i, 13] for i in range(4)]
    params = [SamplingParams(temperature=0.0, max_new_tokens=60, ignore_eos=True) for _ in range(4)]
    script = {0: [("add", f"r{i}", prompts_[i], params[i], True) for i in range(4)], 20: [("abort", "r1")],
              37: [("abort", "r3")]}
    serial, overlapped = [drive(runner, overlap, script, cache=False, drafter=in_process_drafter("EAGLE3", runner, target),
                                spec=SpecConfig(num_draft_tokens=8, adaptive=True), policy=ScriptedPolicy(20, 2))
                          for overlap in (False, True)]
    assert overlapped["deferred"] > 0 and overlapped["finish"] == serial["finish"]
    assert serial["finish"]["r1"] == serial["finish"]["r3"] == "abort"
    for key in ("r0", "r2"):
        assert overlapped["outputs"][key] == serial["outputs"][key]
        counts = [(run["stats"][key].draft_tokens, run["stats"][key].accepted_tokens) for run in (serial, overlapped)]
        assert counts[0] == counts[1] and counts[0][1] > 0, counts
    assert all(s.fallbacks == 0 for run in (serial, overlapped) for s in run["stats"].values())
    assert runner.kv_cache.allocator.num_free == runner.kv_cache.num_pages


@pytest.mark.parametrize("kind", ["NGRAM", pytest.param("EAGLE3", marks=pytest.mark.skipif(
    not (SHIPPED_ROOT / "eagle3" / "config.json").exists(), reason="the demo EAGLE3 head is not in this tree"))])
def test_drafting_off_overlap_through_a_preemption(target, kind):
    """A KV cache too small for four speculating requests (256 tokens): one is preempted and readmitted while the
    policy turns drafting off and on, overlapped or not; outputs and each request's drafted and accepted counts are
    the same either way (the head's unsent states survive the preemption's landing of the step in flight)."""
    runner = runner_for(target, 256)
    prompts_ = [[13, 290, 351 + i, 13, 290, 351 + i, 13, 290, 351 + i, 13] * 3 for i in range(4)]
    params = [SamplingParams(temperature=0.0, max_new_tokens=48 + 4 * i, ignore_eos=True) for i in range(4)]
    script = {0: [("add", f"r{i}", prompts_[i], params[i], True) for i in range(4)]}
    serial, overlapped = [drive(runner, overlap, script, cache=False, drafter=in_process_drafter(kind, runner, target),
                                spec=SpecConfig(num_draft_tokens=8, adaptive=True), policy=ScriptedPolicy(5, 2))
                          for overlap in (False, True)]
    assert serial["preemptions"] >= 1 and overlapped["preemptions"] >= 1
    assert overlapped["deferred"] > 0 and overlapped["outputs"] == serial["outputs"]
    drafted = [{k: (s.draft_tokens, s.accepted_tokens, s.fallbacks) for k, s in run["stats"].items()}
               for run in (serial, overlapped)]
    assert drafted[0] == drafted[1] and all(d[1] > 0 and d[2] == 0 for d in drafted[0].values()), drafted
    assert runner.kv_cache.allocator.num_free == runner.kv_cache.num_pages  # no page left behind


def test_served_with_async_scheduling_equals_plain_generation(target):
    """A verifier process with --async-scheduling: plain (speculate off) greedy, seeded and stopping requests over
    gRPC equal offline generation; its /metrics count deferred steps."""
    process, stub = start_verifier("--max-total-tokens", "4096", "--async-scheduling")
    try:
        p = prompts(6, seed=2)
        runner = runner_for(target, 2048)
        params = [SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)] * 4 + [
            SamplingParams(temperature=0.9, seed=5, max_new_tokens=24, ignore_eos=True)] * 2
        plain = generate_ids(runner, p, params, set())
        stop_at = plain[0].output_ids[6]
        plain_flags = {"max_new_tokens": 24, "speculate": False, "ignore_eos": True}
        messages = [submit(f"q{i}", p[i], **plain_flags) for i in range(4)]
        messages += [submit(f"q{i}", p[i], temperature=0.9, seed=5, **plain_flags) for i in (4, 5)]
        messages.append(submit("stop", p[0], stop_token_ids=[stop_at], **plain_flags))
        results = collect(stub, messages, len(messages))
        for i, reference in enumerate(plain):
            assert results[f"q{i}"]["tokens"] == reference.output_ids and results[f"q{i}"]["finish"] == pb.FINISH_REASON_LENGTH
        full = plain[0].output_ids
        assert results["stop"]["tokens"] == full[: full.index(stop_at) + 1]
        assert results["stop"]["finish"] == pb.FINISH_REASON_STOP
        text = urllib.request.urlopen(stub.metrics_url, timeout=10).read().decode()
        deferred = sum(float(line.split()[-1]) for line in text.splitlines()
                       if line.startswith("splitspec:overlap_deferred_steps_total"))
        assert deferred > 0, "no step was deferred"
    finally:
        stop(process, stub)


@pytest.mark.parametrize("script", [(3, 1), (2, 2)], ids=["off-3-on-1", "off-2-on-2"])
def test_the_engine_thread_delivers_both_events_of_a_request_in_one_step(target, script):
    """The engine's thread as a served verifier runs it (EngineWorker, overlap on): when drafting turns back on, a step
    lands the step in flight and then runs its own forward, so a request can have two events in that step (the landed
    token, then its next tokens and perhaps its end). Every event reaches the request's stream: on a GPU, a served
    warm-up lost such requests' last delta, and their streams waited for it forever."""
    import threading
    import time

    from splitspec.drafter_svc.ngram import NgramConfig, NgramDrafter
    from splitspec.verifier_svc.drafter_client import InProcessDrafterClient
    from splitspec.verifier_svc.worker import EngineWorker, Submission

    runner = runner_for(target, 4096)
    repetitive = [[13, 290, 351 + i, 13, 290, 351 + i, 13, 290, 351 + i, 13] for i in range(8)]
    params = [SamplingParams(temperature=0.0, max_new_tokens=14 + 3 * i, ignore_eos=True) for i in range(8)]
    reference = drive(runner, False, {0: [("add", f"r{i}", repetitive[i], params[i], True) for i in range(8)]},
                      cache=False, drafter=InProcessDrafterClient(NgramDrafter(NgramConfig())),
                      spec=SpecConfig(num_draft_tokens=8, adaptive=True), policy=ScriptedPolicy(*script))
    engine = Engine(runner, InProcessDrafterClient(NgramDrafter(NgramConfig())), SpecConfig(num_draft_tokens=8, adaptive=True),
                    {2}, overlap_schedule=True)
    engine.adaptive = ScriptedPolicy(*script)
    lock, streams = threading.Lock(), {f"r{i}": [] for i in range(8)}
    ended = {name: threading.Event() for name in streams}
    twice = {"steps": 0}  # steps that delivered two events of one request

    def publish(deliveries):
        names = [s.client_id for s, _ in deliveries]
        with lock:
            twice["steps"] += len(names) != len(set(names))
            for submission, event in deliveries:
                streams[submission.client_id].append(event)
                if event.finish_reason is not None:
                    ended[submission.client_id].set()

    worker = EngineWorker(engine, publish=publish, overlap=True)
    worker.start()
    submissions = [Submission(name, repetitive[i], params[i], True) for i, name in enumerate(streams)]
    for submission in submissions:
        worker.submit(submission)
    deadline = time.monotonic() + 120
    missing = [name for name, event in ended.items() if not event.wait(max(deadline - time.monotonic(), 0.01))]
    assert not missing, (missing, {n: sum(len(e.new_token_ids) for e in streams[n]) for n in missing})
    assert twice["steps"] > 0  # the case this test is for happened
    for name, events in streams.items():
        tokens = [t for e in events for t in e.new_token_ids]
        assert tokens == reference["outputs"][name] and [e.finish_reason for e in events if e.finish_reason] == ["length"]
    stats = [s.request.stats for s in submissions]  # speculation happened on the thread too
    assert sum(s.accepted_tokens for s in stats) > 0 and all(s.fallbacks == 0 for s in stats)
