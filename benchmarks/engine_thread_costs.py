"""Host work the verifier's engine thread does around every step, each piece timed alone in a loop on this machine:
the per-step metrics (`EngineMetrics.observe` of a drafted step's report at batch 16: 16 accept lengths, 6 phases; of a
plain one; `observe_loop`), one step's 16 deltas built and serialised (with the speculation counts, and without: a
step that left them as they were), as the TokenDeltas the engine thread built before 2026-12-06 and as the columns it
writes now (verifier_svc/step_columns.py), and the front's reading of them back, the load-adaptive policy's choice and
observation of a drafting-off step (and a quiet step's share of handing them over together), the same for a step of
requests that all opted out, and the logprobs (k=5) of 16 requests' 4-token paths on [192, 4096] logits. No
assertions; medians of 5 runs of N calls.

    python -P benchmarks/engine_thread_costs.py [N]
"""

from __future__ import annotations

import statistics
import sys
import time
import types


def timed(run, calls: int) -> float:
    """Median over 5 runs of the mean time of one call, in us."""
    for _ in range(min(calls, 100)):
        run()
    runs = []
    for _ in range(5):
        began = time.perf_counter()
        for _ in range(calls):
            run()
        runs.append((time.perf_counter() - began) / calls * 1e6)
    return statistics.median(runs)


def metrics_pieces(calls: int) -> None:
    from prometheus_client import CollectorRegistry

    from splitspec.verifier_svc.metrics import EngineMetrics
    from splitspec.verifier_svc.step_types import StepReport

    metrics = EngineMetrics(CollectorRegistry(), "demo")
    drafted = StepReport(budget=12, accept_lengths=[4, 3, 5, 2, 4, 6, 3, 3, 4, 5, 2, 3, 4, 4, 3, 5], draft_tokens=176,
                         accepted_tokens=40, generated_tokens=58, accepted_per_position=[14, 10, 8, 5, 3],
                         seconds={"schedule": 1e-5, "draft": 2e-4, "verify": 6e-4, "commit": 1e-4, "accept": 2e-4, "ask": 9e-5})
    plain = StepReport(budget=1, generated_tokens=16, deferred=True)
    policy = types.SimpleNamespace(predicted={1: 1.0, 12: 1.2}, budget=12, switches=0, probes=0, plain_probes=0, tries=0)
    engine = types.SimpleNamespace(runner=types.SimpleNamespace(kv_cache=types.SimpleNamespace(
        allocator=types.SimpleNamespace(num_used=100, num_free=1000))), running=[None] * 16, waiting=[], prefix_cache=None,
        adaptive=policy, drafter=object(), spec=types.SimpleNamespace(num_steps=0, num_draft_tokens=12))
    parts = {"intake": 1e-5, "step": 1e-3, "metrics": 5e-5, "publish": 7e-5, "hidden": 1e-5}
    print(f"EngineMetrics.observe, a drafted step at batch 16: {timed(lambda: metrics.observe(engine, drafted), calls):.1f} us")
    print(f"EngineMetrics.observe, a plain step at batch 16: {timed(lambda: metrics.observe(engine, plain), calls):.1f} us")
    print(f"EngineMetrics.observe_loop: {timed(lambda: metrics.observe_loop(parts), calls):.1f} us")


def delta_pieces(calls: int) -> None:
    from splitspec.protos import engine_link_pb2 as link
    from splitspec.protos import verifier_pb2 as pb
    from splitspec.runtime.sampling_params import SamplingParams
    from splitspec.verifier_svc import convert, step_columns
    from splitspec.verifier_svc.step_types import Request, SpecStats, StepEvent
    from splitspec.verifier_svc.worker import Submission

    requests = [Request(f"r{i}", list(range(128)), SamplingParams(max_new_tokens=128)) for i in range(16)]
    submissions = []
    for request in requests:
        request.stats = SpecStats(40, 300, 120, 0, [30, 25, 20, 15, 10, 8, 5, 3, 2, 1, 1, 0])
        submissions.append(Submission("cmpl-" + request.request_id, [], request.params, True, request=request, first=False))
    deliveries = [(submission, StepEvent(submission.request.request_id, [1, 2, 3], None)) for submission in submissions]

    def whole(counts: bool) -> bytes:  # before 2026-12-06: a TokenDelta per request
        message = pb.GenerateServerMessage()
        for request in requests:
            convert.fill_delta(message.deltas.add(), "cmpl-" + request.request_id, request, [1, 2, 3], None, False,
                               counts=counts)
        return message.SerializeToString()

    def columns(counts: bool) -> bytes:
        for submission in submissions:  # counts moved since the last delta (drafted) or not
            submission.counts_sent = None if counts else (40, 0)
        message = link.EngineMessage()
        step_columns.write(deliveries, message.step)
        return message.SerializeToString()

    for counts in (True, False):
        which = "in" if counts else "left out"
        print(f"a step's 16 deltas as TokenDeltas built and serialised, speculation counts {which}: "
              f"{timed(lambda: whole(counts), calls):.1f} us")
        print(f"a step's 16 deltas as columns (step_columns.write) and serialised, speculation counts {which}: "
              f"{timed(lambda: columns(counts), calls):.1f} us")
    reader, message = step_columns.Reader(), link.EngineMessage()
    step_columns.write(deliveries, message.step)
    print(f"the front's side: 16 deltas read back from columns: {timed(lambda: reader.deltas(message.step), calls):.1f} us")


def logprob_pieces(calls: int) -> None:
    import torch

    from splitspec.runtime.sampling_params import SamplingParams
    from splitspec.verifier_svc.acceptance import Acceptance
    from splitspec.verifier_svc.verification import accepted_logprobs

    logits = torch.randn(192, 4096, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(logprobs=5)
    accepted = []
    for i in range(16):
        path = [0, 1, 2, 3]
        request = types.SimpleNamespace(request=types.SimpleNamespace(params=params))
        accepted.append((request, Acceptance(path, [int(logits[i * 12 + j].argmax()) for j in path]), i * 12, i * 12))
    print(f"logprobs (k=5) of 16 requests' 4-token paths: {timed(lambda: accepted_logprobs(logits, accepted), calls // 10):.1f} us")


def policy_pieces(calls: int) -> None:
    """The load-adaptive policy during a drafting-off run at batch 16 (settled: drafted steps of the chain at 2.7 ms
    against 0.6 ms plain cycles, ~3.4 tokens a request a step, so drafting stays off): a choice, and a step's shape
    built and observed as the engine does for an overlapped plain cycle."""
    import random

    from splitspec.verifier_svc.adaptive import AdaptiveSpeculation
    from splitspec.verifier_svc.adaptive_estimates import AdaptiveConfig, StepShape

    policy, batch, rng = AdaptiveSpeculation(AdaptiveConfig(max_budget=6, num_steps=5, chain=True)), 16, random.Random(0)
    for _ in range(3000):
        budget = policy.choose(batch)
        if budget == 1:
            policy.observe(StepShape(1, batch, 0, 0, 0.0, 0.0, 0.0006))
        else:
            accepts = [(5, min(5, int(rng.expovariate(0.4)))) for _ in range(batch)]
            policy.observe(StepShape(budget, batch, 0, batch * budget, 0.0012, 0.001, 0.0005, accepts))
    assert policy.budget == 1, policy.predicted  # the run this times: drafting off, settled
    shape = lambda: policy.observe(StepShape(1, batch, 0, 0, 0.0, 0.0, 0.0006))  # noqa: E731
    print(f"AdaptiveSpeculation.choose, drafting off and settled at batch 16: {timed(lambda: policy.choose(batch), calls):.1f} us")
    print(f"AdaptiveSpeculation.observe of an overlapped plain cycle (its StepShape built): {timed(shape, calls):.1f} us")
    # a settled run's quiet steps (policy_link.QuietRun): no choice, no shape; their choices and cycles handed over
    # together, here 16 at a time (settled_off grants up to repredict_off_every)
    cycles = [0.0006] * 16
    quiet = timed(lambda: policy.observe_quiet(batch, 0, 16, cycles), max(calls // 16, 1)) / 16
    print(f"AdaptiveSpeculation.observe_quiet of 16 quiet steps, a step's share: {quiet:.2f} us")
    # a run of 16 requests that all opted out (policy_link._quiet_opted_out), at the engine's budget of 6: one by one, as
    # before, against told together
    opted = lambda: policy.observe(StepShape(6, 0, batch, 0, 0.0, 0.0, 0.0006))  # noqa: E731
    print(f"AdaptiveSpeculation.observe of an opted-out run's overlapped cycle (its StepShape built): {timed(opted, calls):.1f} us")
    quiet = timed(lambda: policy.observe_quiet(0, batch, 0, cycles, 6), max(calls // 16, 1)) / 16
    print(f"AdaptiveSpeculation.observe_quiet of 16 opted-out steps, a step's share: {quiet:.2f} us")


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    policy_pieces(n)
    metrics_pieces(n)
    delta_pieces(n)
    logprob_pieces(n)
