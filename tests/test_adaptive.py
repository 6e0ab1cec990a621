"""Load-adaptive speculation (verifier_svc/adaptive.py): the policy against a modelled GPU whose costs it must
learn, and the engine with the policy on a real tiny model, lossless, with per-request opt-out."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry

from splitspec.runtime.sampling_params import SamplingParams
from splitspec.verifier_svc.adaptive import AdaptiveSpeculation, budget_ladder
from splitspec.verifier_svc.adaptive_estimates import AdaptiveConfig, StepShape
from splitspec.verifier_svc.engine import Engine, SpecConfig
from splitspec.verifier_svc.metrics import EngineMetrics
from splitspec.drafter_svc.ngram import NgramConfig, NgramDrafter
from splitspec.runtime.tree import DraftTree
from splitspec.verifier_svc.drafter_client import InProcessDrafterClient
from splitspec.verifier_svc.timings import Recent


class ModelGpu:
    """Step costs of an 8B-like target: the forward is memory-bound (flat) up to `knee` tokens, then compute-bound
    (linear); a co-located drafter costs per step and per request at its depth; acceptance per depth is q^d."""

    def __init__(self, q: float, knee: int = 128, flat: float = 0.010, draft_per_depth: float = 0.0004,
                 steps: int = 5, seed: int = 0):
        self.q, self.knee, self.flat, self.draft_per_depth, self.steps = q, knee, flat, draft_per_depth, steps
        self.random = random.Random(seed)

    def verify(self, tokens: int) -> float:
        return self.flat * max(1.0, tokens / self.knee)

    def draft(self, budget: int, batch: int) -> float:
        depth = min(self.steps, budget - 1)
        return depth * self.draft_per_depth * (1 + batch / 64) if budget > 1 else 0.0

    def expected(self, budget: int) -> float:
        return 1 + sum(self.q ** d for d in range(1, min(self.steps, budget - 1) + 1))

    def throughput(self, budget: int, batch: int) -> float:
        """The true tokens/s of a step at this budget (what the policy must maximise without knowing it)."""
        return batch * self.expected(budget) / (self.verify(batch * budget) + self.draft(budget, batch) + 0.001)

    def step(self, budget: int, batch: int) -> StepShape:
        accepts = []
        if budget > 1:
            depth = min(self.steps, budget - 1)
            for _ in range(batch):
                accepted = 0
                while accepted < depth and self.random.random() < self.q:
                    accepted += 1
                accepts.append((depth, accepted))
        noise = 1 + 0.02 * (self.random.random() - 0.5)  # timings are never exact
        return StepShape(budget, batch, 0, batch * budget, self.verify(batch * budget) * noise,
                         self.draft(budget, batch) * noise, 0.001, accepts)


class SmallTargetBeamGpu(ModelGpu):
    """A small target's flat 0.6 ms forward and a beam drafter (every step drafted, whatever the budget) at 1 ms below
    batch 8 and 8 ms from there: drafting pays at batch 1 and at no budget at batch 16."""

    def verify(self, tokens: int) -> float:
        return 0.0006

    def draft(self, budget: int, batch: int) -> float:
        return (0.001 if batch < 8 else 0.008) if budget > 1 else 0.0


class OverlappedSmallGpu(ModelGpu):
    """A small target served with the overlap schedule: a plain step is one whole cycle (0.3 ms at batch 1, 0.9 ms
    at 16, no forward timed apart), a drafted step 1.6 ms at batch 1 (0.5 verifying, 0.8 drafting, 0.3 the rest)."""

    def step(self, budget, batch):
        if budget == 1:
            return StepShape(1, batch, 0, 0, 0.0, 0.0, 0.0003 if batch == 1 else 0.0009)
        accepts = super().step(budget, batch).accepts
        return StepShape(budget, batch, 0, batch * budget, 0.0005, 0.0008, 0.0003, accepts)


class FixedCostGpu(ModelGpu):
    """A small target with the overlap schedule at one load: a plain step one whole cycle of `plain` seconds, a drafted
    one `verify` + `spec` + `base` seconds."""

    def __init__(self, q: float, plain: float, verify: float, spec: float, base: float):
        super().__init__(q)
        self.plain, self.costs = plain, (verify, spec, base)

    def step(self, budget, batch):
        if budget == 1:
            return StepShape(1, batch, 0, 0, 0.0, 0.0, self.plain)
        accepts = super().step(budget, batch).accepts
        return StepShape(budget, batch, 0, batch * budget, *self.costs, accepts)


def chain_policy(**kwargs) -> AdaptiveSpeculation:
    return AdaptiveSpeculation(AdaptiveConfig(max_budget=6, num_steps=5, chain=True, **kwargs))


def run_policy(policy: AdaptiveSpeculation, gpu: ModelGpu, batch: int, steps: int) -> list[int]:
    chosen = []
    for _ in range(steps):
        budget = policy.choose(batch)
        chosen.append(budget)
        policy.observe(gpu.step(budget, batch))
    return chosen


def run_overlapped(policy: AdaptiveSpeculation, gpu: ModelGpu, batch: int, steps: int) -> list[int]:
    """run_policy as a GPU server's engine observes steps under the overlap schedule: a plain step right after a
    drafted one only launches (engine._close observes no cycle for it), the plain steps after it are whole cycles."""
    chosen, previous = [], None
    for _ in range(steps):
        budget = policy.choose(batch)
        chosen.append(budget)
        shape = gpu.step(budget, batch)
        if not (budget == 1 and previous is not None and previous > 1):
            policy.observe(shape)
        previous = budget
    return chosen


def test_a_recorded_trace_replays_to_the_same_choices(tmp_path, monkeypatch):
    """SPLITSPEC_ADAPTIVE_TRACE records every observation and choice as JSON lines; benchmarks/replay_adaptive.py
    feeds them through a fresh policy and makes every choice again: the same ones, under a growing load."""
    import subprocess
    import sys
    from pathlib import Path

    from splitspec.verifier_svc.adaptive_estimates import TRACE_ENV

    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv(TRACE_ENV, str(trace))
    policy, gpu = chain_policy(), ModelGpu(0.7)
    chosen = [b for batch in (1, 8, 64, 256) for b in run_policy(policy, gpu, batch, 40)]
    policy._trace.close()
    lines = trace.read_text().splitlines()
    assert len(lines) == 2 * len(chosen) and {line.split('"kind": "')[1][:6] for line in lines} == {"choose", "observ"}
    assert len(set(chosen)) > 1  # the load moved the choice
    replay = subprocess.run([sys.executable, "-P", "benchmarks/replay_adaptive.py", str(trace), "--max-budget", "6",
                             "--num-steps", "5", "--chain"], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).resolve().parent.parent)
    assert replay.returncode == 0, replay.stderr
    assert f"{len(chosen)} choices, 0 differ" in replay.stdout, replay.stdout


def test_budget_ladder():
    assert budget_ladder(6) == [1, 2, 3, 4, 5, 6]
    assert budget_ladder(2) == [1, 2]
    assert budget_ladder(32) == [1, 2, 3, 4, 5, 6, 7, 8, 12, 18, 27, 32]


@pytest.mark.parametrize("q", [0.8, 0.5])
def test_policy_is_never_below_plain_and_has_no_cliff(q):
    """A load that grows from 1 to 256 requests, as a server sees it (one policy learning as it goes): at every
    batch size the budgets it settles on give at least 0.98x plain decoding's true throughput, speculation is
    on at low load and off at the highest, and the throughput of its choices never drops by more than the
    batch's own change explains (no cliff where it switches)."""
    gpu = ModelGpu(q)
    policy = chain_policy()
    settled = {}
    for batch in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256):
        chosen = run_policy(policy, gpu, batch, 60)
        tail = chosen[-20:]
        mean = sum(gpu.throughput(b, batch) for b in tail) / len(tail)
        plain = gpu.throughput(1, batch)
        best = max(gpu.throughput(b, batch) for b in policy.ladder)
        settled[batch] = (max(set(tail), key=tail.count), mean)
        assert mean >= 0.98 * plain, (batch, tail, mean, plain)
        assert mean >= 0.9 * best, (batch, tail, mean, best)
    assert settled[1][0] >= 3  # speculating at low load (the best budget depends on q)
    assert settled[256][0] == 1
    sizes = sorted(settled)
    for a, b in zip(sizes, sizes[1:]):  # tokens/s never falls as the batch grows (a cliff would)
        assert settled[b][1] >= 0.97 * settled[a][1], (a, b, settled)


def test_policy_follows_acceptance_and_probes_while_off():
    """A drafter whose drafts are never accepted: speculation goes off even at batch 1, probes come at the
    interval, then twice as far apart each time one leaves drafting off (up to 8x), and speculation comes back once
    a probe measures that acceptance has recovered."""
    gpu = ModelGpu(q=0.0)
    policy = chain_policy(probe_interval=50)
    chosen = run_policy(policy, gpu, 1, 1600)
    assert chosen[-50:].count(1) >= 48, chosen[-50:]
    probes = [i for i in range(1, len(chosen)) if chosen[i] > 1 and chosen[i - 1] == 1]  # each probe's first step
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert len(probes) >= 4 and gaps[:3] == sorted(gaps[:3]) and max(gaps) <= 8 * 50 + 3, (probes, gaps)
    assert gaps[2] >= 3 * gaps[0], gaps
    gpu.q = 0.9
    # within two probes at the backed-off interval (one probe's two verifies may accept little by chance: the many
    # failed ones before still weigh on the estimate)
    chosen = run_policy(policy, gpu, 1, 2 * 8 * 50 + 100)
    assert chosen[-100:].count(6) >= 95, chosen[-100:]


def test_acceptance_measured_long_ago_fades_while_drafting_is_off():
    """The acceptance counts age by steps with speculating requests, drafting on or off. A warm-up that accepted
    little, drafting at batch 1 all along (plain steps were slow then), then a plain run of requests that opted out
    (plain steps now fast), then the traffic, whose drafts are accepted well: the policy starts it with drafting off,
    as the warm-up's acceptance says, and a few probes' verifies must be enough to turn drafting back on. Counted whole
    through the off-run (decayed only by steps with verified drafts), the warm-up's hundreds of samples outweighed
    every probe's two verifies and drafting stayed off (the demo EAGLE-3 head served at batch 1 at f93e3e4: 2597 of
    4323 steps off at accept length ~3.7, its warm-up's ~2.8 judging)."""

    class Gpu(SmallTargetBeamGpu):
        base = 0.001

        def step(self, budget, batch):
            shape = super().step(budget, batch)
            shape.base_seconds = self.base
            return shape

    gpu = Gpu(q=0.5)
    policy = AdaptiveSpeculation(AdaptiveConfig(max_budget=6, num_steps=5))  # a tree's: E(N) from its own tier
    assert run_policy(policy, gpu, 1, 600)[-200:].count(1) <= 10  # drafting pays while plain steps are slow
    gpu.base = 0.0005
    for _ in range(2000):  # the opted-out run: plain steps at 1.1 ms
        policy.observe(StepShape(1, 0, 1, 1, gpu.verify(1), 0.0, gpu.base))
    gpu.q = 0.85
    assert gpu.throughput(6, 1) > 2 * gpu.throughput(1, 1)
    chosen = run_policy(policy, gpu, 1, 1500)
    assert chosen[:50].count(1) >= 45, chosen[:50]  # the warm-up's acceptance judges first
    assert chosen[-500:].count(1) <= 10, chosen[-500:]


@pytest.mark.parametrize("seed", [0, 1])
def test_acceptance_faded_by_an_off_run_keeps_a_floor_of_evidence(seed):
    """The counts an off-run fades keep at least min_samples verifies' weight: faded to nothing, every depth of a tree
    would be predicted with the bonus of a depth never tried, and a probe's lucky verify would turn drafting on again
    and again where it loses (acceptance 0.3 at batch 1: 140-220 drafted steps after the first 400 with no floor)."""
    gpu = SmallTargetBeamGpu(q=0.3, seed=seed)
    assert gpu.throughput(6, 1) < 0.9 * gpu.throughput(1, 1)
    policy = AdaptiveSpeculation(AdaptiveConfig(max_budget=6, num_steps=5))
    chosen = run_policy(policy, gpu, 1, 4000)
    assert sum(b > 1 for b in chosen[400:]) <= 40, policy.probes


def test_probes_at_the_interval_again_when_the_load_moves():
    """Drafting loses at batch 16 (a drafter of 4 ms a step at any budget, a 0.6 ms forward) though full acceptance
    would win: the probes there back off; when the load moves to batch 4, the next probe comes at the configured
    interval, not the backed-off one (or, where a probe there was timed to cost more than probe_share of that
    interval's plain steps, at the interval that share gives)."""

    class BeamGpu(ModelGpu):
        def verify(self, tokens):
            return 0.0006

        def draft(self, budget, batch):
            return 0.004 if budget > 1 else 0.0

    gpu = BeamGpu(q=0.5)
    policy = chain_policy(probe_interval=40)
    run_policy(policy, gpu, 16, 700)
    assert policy.probes <= 4, policy.probes  # 40, 80, 160, 320 apart: not one per 40 steps (17)
    before, backed_off = policy.probes, policy._probe_every
    chosen = run_policy(policy, gpu, 4, 250)
    assert policy.probes > before, chosen
    probe = next(i for i in range(3, len(chosen)) if chosen[i] > 1 and chosen[i - 1] == 1)  # after the load's first tries
    assert probe < min(backed_off, 250), (probe, backed_off, chosen)


def test_drafting_off_choices_skip_the_predictions_until_something_can_change_them():
    """With drafting off at a steady load, no tree runs, so the predictions can move only with plain steps' own
    timings: a settled off choice reuses them for repredict_off_every steps (a decision costs ~10-40 us of Python
    against a small model's ~0.4 ms step), and chooses exactly what predicting every repredict_every steps chose:
    the same probes at the same steps, the same recovery once the load moves."""

    class BeamGpu(ModelGpu):  # drafting loses at batch 16: a drafter of 4 ms a step at any budget, a 0.6 ms forward
        def verify(self, tokens):
            return 0.0006

        def draft(self, budget, batch):
            return 0.004 if budget > 1 else 0.0

    runs = {}
    for every in (0, 64):  # 0: every choice goes through the decision, its predictions made every 8 steps
        policy = chain_policy(probe_interval=40, repredict_off_every=every)
        predictions = 0
        throughput = policy.throughput

        def counted(*args, **kwargs):
            nonlocal predictions
            predictions += 1
            return throughput(*args, **kwargs)

        policy.throughput = counted
        gpu = BeamGpu(q=0.5)
        chosen = run_policy(policy, gpu, 16, 200)
        before = predictions
        chosen += run_policy(policy, gpu, 16, 500)
        off_predictions = predictions - before
        chosen += run_policy(policy, gpu, 4, 60)
        runs[every] = (chosen, off_predictions, policy.probes)
    (slow, slow_predictions, slow_probes), (fast, fast_predictions, fast_probes) = runs[0], runs[64]
    assert fast == slow and fast_probes == slow_probes >= 3  # at 40, then at what each probe costs (~170 steps), backed off
    assert fast[200:700].count(1) >= 490, fast[200:700]
    # 500 steps off: a decision every 8 steps (6 budgets each) before, one every 64 now and at each probe
    assert slow_predictions >= 300 and fast_predictions <= slow_predictions / 3, (slow_predictions, fast_predictions)


def test_policy_does_not_flap():
    """Near a switch point the hysteresis keeps the budget still: once settled at the new load (it walks down
    the ladder as it learns the larger forwards' times), a few switches in 400 steps, not one per step."""
    gpu = ModelGpu(q=0.8)
    policy = chain_policy()
    run_policy(policy, gpu, 1, 30)
    crossing = next(b for b in range(1, 256) if gpu.throughput(1, b) > max(gpu.throughput(n, b) for n in range(2, 7)))
    run_policy(policy, gpu, crossing, 100)
    before = policy.switches
    chosen = run_policy(policy, gpu, crossing, 400)
    assert policy.switches - before <= 3, (policy.switches - before, chosen)
    assert sum(gpu.throughput(b, crossing) for b in chosen) / len(chosen) >= 0.98 * gpu.throughput(1, crossing)


def test_policy_measures_again_what_it_judged_while_warming_up():
    """The best budget's first steps ran slow (warm-up: allocations, first kernels): it is measured again and
    chosen (its phase timings grow stale while speculating, and the neighbouring budgets' cycles, timed at this
    load, bound what the slow first steps suggested), with or without the staleness."""

    class WarmingGpu(ModelGpu):
        def __init__(self, q):
            super().__init__(q)
            self.steps_run = 0

        def step(self, budget, batch):
            shape = super().step(budget, batch)
            self.steps_run += 1
            if self.steps_run <= 10 and budget == 6:
                shape.verify_seconds *= 2.5
                shape.spec_seconds *= 2.5
            return shape

    for stale_steps in (256, 10**9):
        gpu = WarmingGpu(0.8)
        assert max(range(1, 7), key=lambda b: gpu.throughput(b, 1)) == 6
        policy = chain_policy(stale_steps=stale_steps)
        chosen = run_policy(policy, gpu, 1, 600)
        assert chosen[-200:].count(6) >= 190, (stale_steps, chosen[-200:])


def test_a_cold_first_decode_step_does_not_keep_drafting_off():
    """As an H200 ran the demo EAGLE-3 pair: a prompt's step, then the first decode step ever (every graph's first
    replay) timed at 30x its successors (verify 17.7 ms, drafting 8 ms); plain steps run overlapped (0.5 ms whole
    cycles), drafted ones cost 1.6 ms and make ~4.7 tokens. That first step is not taken for what drafting costs:
    the policy drafts and stays drafting. (Kept in, its one sample priced every tree below plain decoding, and the
    probes' hope with it: drafting stayed off for all of the run's 8000 steps.)"""

    class SmallTargetGpu(ModelGpu):
        def step(self, budget, batch):
            if budget == 1:  # the overlap schedule's plain step: its whole cycle, no forward timed apart
                return StepShape(1, batch, 0, 0, 0.0, 0.0, 0.0005)
            shape = super().step(budget, batch)
            shape.verify_seconds, shape.spec_seconds, shape.base_seconds = 0.00045, 0.00075, 0.0004
            return shape

    gpu = SmallTargetGpu(q=0.9)
    policy = chain_policy()
    policy.observe(StepShape(6, 0, 0, 128, 0.0025, 0.0003, 0.0003))  # the prompt's step
    first = gpu.step(6, 1)
    first.verify_seconds, first.spec_seconds = 0.0177, 0.008
    policy.observe(first)
    chosen = run_policy(policy, gpu, 1, 1500)
    assert sum(b > 1 for b in chosen[-500:]) >= 480, chosen[-500:]


def test_a_drafters_cost_at_a_new_load_prices_every_budget_there():
    """A beam drafter (every step drafted, whatever the budget) whose draft costs 1 ms at batch 1 and 8 ms at batch 16,
    a forward flat at 0.6 ms (a small target): drafting pays at batch 1 and at no budget at batch 16. Every budget was
    timed at batch 1; once one budget was timed at batch 16, the others are priced with its drafting time there, not
    their own at batch 1: the policy leaves drafting after trying one budget, not after trying them one by one (two
    steps each at ~10 ms against ~1.6 for a plain step)."""

    gpu = SmallTargetBeamGpu(q=0.9)
    assert max(range(1, 7), key=lambda b: gpu.throughput(b, 1)) > 1
    assert max(range(1, 7), key=lambda b: gpu.throughput(b, 16)) == 1
    policy = chain_policy()
    for budget in (1, 2, 3, 4, 5, 6):  # every budget timed at batch 1 (an earlier load's tries and switches)
        for _ in range(6):
            policy.observe(gpu.step(budget, 1))
    assert run_policy(policy, gpu, 1, 50)[-20:].count(1) == 0
    at_16 = run_policy(policy, gpu, 16, 150)
    assert sum(b > 1 for b in at_16) <= 3, at_16
    assert at_16[-100:].count(1) == 100, at_16


def test_a_loads_timings_stay_fresh_while_no_request_speculates():
    """Timings age by steps that speculate: a long run of requests that all opted out of speculation (a plain
    benchmark between two speculative ones, a tenant without drafts) changes nothing a drafted step costs. Back at
    the load it had settled, the policy drafts as it did, with no budget tried again as if it had never been timed."""

    class BeamGpu(ModelGpu):
        def draft(self, budget, batch):
            return 0.003 if budget > 1 else 0.0  # a beam drafter: every step drafted, whatever the budget

    gpu = BeamGpu(q=0.8, knee=12)  # the forward grows past 12 tokens: 3-node chains are the best at batch 4
    assert max(range(1, 7), key=lambda b: gpu.throughput(b, 4)) == 3
    policy = chain_policy()
    settled = run_policy(policy, gpu, 4, 400)[-50:]
    assert settled == [3] * 50, settled
    tries = policy.tries
    for _ in range(1000):  # only requests that opted out: no choice asked, every step observed
        policy.observe(StepShape(1, 0, 16, 16, gpu.verify(16), 0.0, 0.001))
    again = run_policy(policy, gpu, 4, 20)
    assert again == [settled[0]] * 20, again
    assert policy.tries == tries


def test_a_budget_timed_nowhere_is_priced_with_the_nearest_ones_drafting_time():
    """The same beam drafter (1 ms at batch 1, 8 ms at 16), where the policy only ever drafted its full budget at batch
    1: at batch 16 the budgets it never drafted anywhere are priced with the drafting time of the nearest budget at the
    nearest load, not as free, so they are not tried one after another: only the full budget drafts at 16 (two steps:
    plain decoding, never timed at 16, is timed first, and a drafted step right after plain ones is not timed), then
    drafting off."""

    gpu = SmallTargetBeamGpu(q=0.9)
    policy = chain_policy()
    assert run_policy(policy, gpu, 1, 300)[-100:].count(6) >= 97  # (plain decoding re-timed once: three steps)
    at_16 = run_policy(policy, gpu, 16, 150)
    assert [b for b in at_16 if b > 1] in ([6], [6, 6]), at_16
    assert at_16[-140:] == [1] * 140, at_16


def test_a_tree_measured_slower_than_plain_is_left_though_its_phases_look_cheap(monkeypatch):
    """One drafted step in three pays a long stall (a drafter's collection, a cache's eviction): each phase's median
    is the cheap steps', so the sum of the parts predicts speculation at 3x plain decoding, while what it truly
    makes is below plain. What the whole cycles measured (tokens over seconds at that load) wins over the parts:
    the policy settles on plain decoding. Without that, it would have kept drafting."""

    class StallingGpu(ModelGpu):
        def __init__(self):
            super().__init__(q=0.8)
            self.drafted = 0

        def step(self, budget, batch):
            shape = super().step(budget, batch)
            if budget > 1:
                self.drafted += 1
                if self.drafted % 3 == 0:
                    shape.base_seconds += 0.1
            return shape

        def true_throughput(self, budget, batch):
            return self.throughput(budget, batch) if budget == 1 else batch * self.expected(budget) / (
                self.verify(batch * budget) + self.draft(budget, batch) + 0.001 + 0.1 / 3)

    gpu = StallingGpu()
    assert all(gpu.true_throughput(n, 1) < gpu.true_throughput(1, 1) for n in range(2, 7))
    chosen = run_policy(chain_policy(), gpu, 1, 600)
    tail = chosen[-200:]
    assert tail.count(1) >= 170, tail  # a probe now and then, and the steps that measure what it found
    assert sum(gpu.true_throughput(b, 1) for b in tail) / len(tail) >= 0.95 * gpu.true_throughput(1, 1)

    monkeypatch.setattr(AdaptiveSpeculation, "_correct", lambda self, predicted, speculating, plain: None)
    chosen = run_policy(chain_policy(), StallingGpu(), 1, 600)
    assert chosen[-200:].count(1) < 100, chosen[-200:]  # the sum of the parts alone keeps drafting


def test_plain_decoding_where_it_never_ran_is_priced_no_dearer_than_at_a_smaller_load():
    """Plain steps timed at batch 16 only (their overlapped cycle 0.9 ms), then batch 1, where a plain step takes 0.3
    ms and a drafted one 1.6 ms at acceptance 0.6 (drafting makes 45% of plain's tokens/s there). Priced by batch 16's
    cycle, plain decoding at batch 1 looked slower than drafting and was never tried, so never measured: in process the
    demo EAGLE-3 chain drafted 98% of its batch-1 steps at 0.64x plain (aa4d769). A larger batch's cycle is no guess
    for a smaller one's; priced at a smaller load's at most (none here: optimistic), plain is tried, measured, kept."""

    gpu = OverlappedSmallGpu(q=0.6)
    policy = chain_policy()
    for _ in range(300):
        policy.observe(gpu.step(1, 16))
    assert gpu.expected(6) / 0.0016 < 0.5 / 0.0003
    chosen = run_policy(policy, gpu, 1, 600)
    assert chosen[-300:].count(1) >= 290, chosen[-300:]


def test_plain_decoding_never_timed_at_a_load_is_timed_there_not_priced_by_a_cold_smaller_one():
    """A warm-up's three plain steps at batch 2, cold (1.4 ms each), then batch 16, where a plain step takes 0.65 ms
    (overlapped: a whole cycle) and a drafted one 2.8 ms at acceptance 0.65 (0.61x plain's tokens/s). Priced by batch
    2's cycle, plain decoding at 16 looked slower than drafting and was never run there: in process on an H200 the demo
    EAGLE-3 chain drafted a whole batch-16 point at 0.64x plain (9a05959; its trace: plain predicted 11.7k tok/s, run
    at 24.6k). Never timed at a load, plain decoding is timed there by a plain probe, and the policy leaves drafting."""

    gpu = FixedCostGpu(q=0.65, plain=0.00065, verify=0.0008, spec=0.0014, base=0.0006)
    assert 16 * gpu.expected(6) / 0.0028 < 0.65 * 16 / 0.00065
    policy = chain_policy()
    for _ in range(3):
        policy.observe(StepShape(1, 2, 0, 0, 0.0, 0.0, 0.0014))  # the warm-up's cold plain steps at batch 2
    chosen = run_policy(policy, gpu, 16, 400)
    assert policy.plain_probes >= 1 and sum(b > 1 for b in chosen[:50]) <= 8, (policy.plain_probes, chosen[:50])
    assert chosen[-300:].count(1) >= 290, chosen[-300:]


def test_a_plain_probe_times_plain_decoding_under_the_overlap_schedule():
    """Batch 1 where drafting pays (1.2 ms a drafted step at acceptance 0.8 against a 0.6 ms plain one: 1.8x), served
    with the overlap schedule: the first plain step after a drafted one only launches and is not observed, and the next
    is observed after a drafted one (not steady, so not timed). One plain probe of three steps times plain decoding
    (one of two timed nothing, and a second probe followed at once: four plain steps); after that plain decoding runs
    only to be timed again when its timing goes stale (256 steps)."""

    gpu = FixedCostGpu(q=0.8, plain=0.0006, verify=0.0005, spec=0.0005, base=0.0002)
    assert gpu.expected(6) / 0.0012 > 1.5 / 0.0006
    policy = chain_policy()
    chosen = run_overlapped(policy, gpu, 1, 600)
    assert policy._cycles.get((1, 0)) is not None  # plain decoding timed at batch 1 (token bucket 0)
    assert chosen[-300:].count(1) <= 3, (policy.plain_probes, chosen[-300:])  # one re-timing, its timing gone stale


def test_plain_decoding_timed_long_ago_is_timed_again_while_drafting():
    """Plain decoding timed at batch 1 only in a cold warm-up's first steps (1.2 ms each, where drafting at acceptance
    0.6 and 1.6 ms a step looks better), then drafting: a plain step now takes 0.3 ms and drafting makes under half of
    that. Plain decoding's timings then never aged (drafting was predicted to win, so plain never ran again): in
    process the demo EAGLE-3 chain drafted 98% of its batch-1 steps at 0.64x plain (aa4d769), judged by its warm-up's
    three plain steps at 0.53-0.72 ms. Timed longer ago than stale_steps while drafting, plain decoding is re-timed by
    two steps, and the policy leaves drafting."""
    gpu = OverlappedSmallGpu(q=0.6)
    policy = chain_policy()
    for _ in range(3):
        policy.observe(StepShape(1, 1, 0, 0, 0.0, 0.0, 0.0012))  # the warm-up's cold plain steps
    chosen = run_policy(policy, gpu, 1, 900)
    assert sum(b > 1 for b in chosen[:100]) >= 95, chosen[:100]  # drafting, as the warm-up's plain steps say
    assert policy.plain_probes >= 1 and chosen[-300:].count(1) >= 290, (policy.plain_probes, chosen[-300:])


def _policy_state(policy: AdaptiveSpeculation) -> dict:
    """What a policy knows, as plain data (its timings' values, counts and ages; caches of derived values left out)."""
    def plain(v):
        if isinstance(v, Recent):
            return type(v).__name__, list(v.values), v.count, v.last
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v

    caches = {"_trace", "_nearest_memo", "_nearest_at", "_acceptance_cache", "_acceptance_at", "_curve", "_curve_at"}
    return {k: plain(v) for k, v in vars(policy).items() if k not in caches}


class QuietGpu(ModelGpu):
    """A small target under the overlap schedule: a plain step one whole cycle that grows with the batch (jittered, as
    measured ones are), a drafted one 0.3 ms verifying, 0.02 ms x batch^2 drafting, 0.1 ms the rest: drafting pays at
    batch 2 (2.5x), not at 16 (0.4x)."""

    def step(self, budget, batch):
        if budget == 1:
            return StepShape(1, batch, 0, 0, 0.0, 0.0, (0.0003 + 0.00002 * batch) * (1 + 0.1 * self.random.random()))
        accepts = super().step(budget, batch).accepts
        return StepShape(budget, batch, 0, batch * budget, 0.0003, 0.00002 * batch ** 2, 0.0001, accepts)


def test_a_quiet_drafting_off_run_leaves_the_policy_knowing_what_step_by_step_calls_would(tmp_path, monkeypatch):
    """An overlapped run with drafting settled off does not ask the policy while settled_off says it is sure to choose
    1, and hands it the skipped choices and the steps' cycles at once (observe_quiet), as the engine does
    (policy_link.QuietRun). Through drafting off with probes, drafting that pays at a smaller load, and off again, it
    chooses exactly what a policy asked and told at every step chooses, ends up knowing exactly the same, and writes
    the same trace, line for line, while asked at few of the steps."""
    from splitspec.verifier_svc.adaptive_estimates import TRACE_ENV

    loads = [(2, 200), (16, 900), (2, 300)]  # drafting on, off (probed), off at another load
    monkeypatch.setenv(TRACE_ENV, str(tmp_path / "every.jsonl"))
    every, gpu, chosen_every = chain_policy(probe_interval=40), QuietGpu(q=0.8), []
    for batch, steps in loads:
        chosen_every += run_policy(every, gpu, batch, steps)
    monkeypatch.setenv(TRACE_ENV, str(tmp_path / "quiet.jsonl"))
    quiet, gpu, chosen, asked = chain_policy(probe_interval=40), QuietGpu(q=0.8), [], []
    for batch, steps in loads:
        left, skipped, cycles = 0, 0, []
        for _ in range(steps):
            held = left > 0
            if held:  # a quiet step: the policy not asked, the step's cycle held back
                left, skipped = left - 1, skipped + 1
                budget = 1
            else:
                if skipped or cycles:
                    quiet.observe_quiet(batch, 0, skipped, cycles)
                    skipped, cycles = 0, []
                budget = quiet.choose(batch)
                asked.append(len(chosen))
                left = quiet.settled_off(batch, 0) if budget == 1 else 0
            shape = gpu.step(budget, batch)
            if held:
                cycles.append(shape.base_seconds)
            else:
                quiet.observe(shape)
            chosen.append(budget)
        if skipped or cycles:  # the batch changes: the next choice (another load's) hands them over first
            quiet.observe_quiet(batch, 0, skipped, cycles)
    assert chosen == chosen_every
    assert chosen[:200].count(1) < 10 and chosen[200:].count(1) > 1150, chosen
    assert quiet.probes == every.probes >= 2 and quiet.switches == every.switches >= 2
    off_asked = [i for i in asked if i >= 200]
    assert len(off_asked) < 1200 / 10, off_asked  # ~one choice in 64 steps and each probe's
    assert _policy_state(quiet) == _policy_state(every)
    every._trace.close()
    quiet._trace.close()
    assert (tmp_path / "quiet.jsonl").read_text() == (tmp_path / "every.jsonl").read_text()


def test_an_opted_out_run_told_at_once_leaves_the_policy_knowing_what_step_by_step_calls_would(tmp_path, monkeypatch):
    """A run of overlapped steps whose requests all opted out ("speculative": false) is told to the policy at once
    (observe_quiet with no speculating request, as policy_link._quiet_opted_out does), at the budget the engine's steps
    report, after drafting at batch 2 (budget 6), between runs that speculate and after a prompt's step (a budget of 0
    before it: its first cycle is not steady). The policy then chooses what one told step by step chooses, knows the
    same and writes the same trace, line for line."""
    from splitspec.verifier_svc.adaptive_estimates import TRACE_ENV

    def opted_out(policy, gpu, plain, steps, budget, at_once):
        shapes = [StepShape(budget, 0, plain, 0, 0.0, 0.0, gpu.step(1, plain).base_seconds) for _ in range(steps)]
        if at_once:
            for k in range(0, steps, 7):  # in runs of 7 (the engine hands one over whenever the policy is next told)
                policy.observe_quiet(0, plain, 0, [s.base_seconds for s in shapes[k : k + 7]], budget)
        else:
            for shape in shapes:
                policy.observe(shape)

    policies, chosen = [], []
    for name, at_once in (("every", False), ("quiet", True)):
        monkeypatch.setenv(TRACE_ENV, str(tmp_path / f"{name}.jsonl"))
        policy, gpu, made = chain_policy(probe_interval=40), QuietGpu(q=0.8), []
        made += run_policy(policy, gpu, 2, 150)  # drafting pays: the engine's budget is a tree's
        opted_out(policy, gpu, 4, 60, policy.budget, at_once)
        made += run_policy(policy, gpu, 16, 300)  # drafting off, probed
        opted_out(policy, gpu, 16, 100, policy.budget, at_once)
        policy.observe(StepShape(1, 0, 3, 40, 0.001, 0.0, 0.0004))  # a prompt chunk's step: budget 0 after it
        opted_out(policy, gpu, 3, 50, 1, at_once)
        made += run_policy(policy, gpu, 2, 200)
        policies.append(policy)
        chosen.append(made)
    every, quiet = policies
    assert chosen[0] == chosen[1]
    assert chosen[0][:150].count(1) < 10 and chosen[0][150:450].count(1) > 250, chosen[0]
    assert _policy_state(quiet) == _policy_state(every)
    assert every._cycles != {} and every._whole != {}
    every._trace.close()
    quiet._trace.close()
    lines = (tmp_path / "every.jsonl").read_text().splitlines()
    assert sum('"speculating": 0, "plain": 16' in line for line in lines) == 100
    assert (tmp_path / "quiet.jsonl").read_text().splitlines() == lines


def test_an_overlapped_plain_step_is_priced_at_its_whole_cycle_not_a_forward_on_top():
    """Under the overlap schedule a plain step's forward runs under the host's work, so the engine reports it as one
    whole cycle with no forward timed (engine._observe). At a large batch where every tree loses to plain decoding
    (0.83x here), the policy must not price a plain step as a forward from the curve plus that whole cycle (the
    forward twice: plain decoding would look half as fast as it is and the trees would keep running, as a batch-128
    sweep point with --no-phase-sync did on an H200 at ad3b90d). It settles on plain decoding."""

    class OverlappedGpu(ModelGpu):
        def step(self, budget, batch):
            if budget > 1:
                return super().step(budget, batch)
            return StepShape(1, batch, 0, 0, 0.0, 0.0, (self.verify(batch) + 0.0003) * (1 + 0.02 * (self.random.random() - 0.5)))

        def true_throughput(self, budget, batch):
            return batch / (self.verify(batch) + 0.0003) if budget == 1 else self.throughput(budget, batch)

    gpu = OverlappedGpu(q=0.95, flat=0.007)
    batch = 128
    best_tree = max(gpu.true_throughput(n, batch) for n in range(2, 7))
    assert best_tree < 0.9 * gpu.true_throughput(1, batch)
    policy = chain_policy()
    for warm in (1, 6, 6, 6):  # a plain step, then trees: too few plain cycles timed for the cycles to correct the model
        policy.observe(gpu.step(warm, batch))
    chosen = run_policy(policy, gpu, batch, 400)
    tail = chosen[-200:]
    assert tail.count(1) >= 190, tail
    assert sum(gpu.true_throughput(b, batch) for b in tail) / len(tail) >= 0.97 * gpu.true_throughput(1, batch)


class CatchingUpGpu(ModelGpu):
    """Batch 16 of a small target with a head that catches up on what it was fed while drafting was off, as an H200
    served the demo EAGLE-3 pair: a plain step 0.6 ms (overlapped: a whole cycle), a drafted one 2.7 ms, and the first
    drafted step after plain ones up to 5.4 ms more (the catch-up, in proportion to the plain steps before it: the head
    is fed every FEED_EVERY = 16 plain steps, so it catches up on at most the last 16; after a plain probe's two, on
    two). Records the true time and tokens of what it ran."""

    def __init__(self, q: float, extra: float = 0.0054, seed: int = 0):
        super().__init__(q, seed=seed)
        self.extra, self.plain_run, self.seconds, self.tokens = extra, 16, 0.0, 0

    def step(self, budget, batch):
        if budget == 1:
            shape = StepShape(1, batch, 0, 0, 0.0, 0.0, 0.0006 * (1 + 0.02 * (self.random.random() - 0.5)))
            self.tokens += batch
            self.plain_run += 1
        else:
            accepts = super().step(budget, batch).accepts
            extra = self.extra * min(self.plain_run, 16) / 16
            shape = StepShape(budget, batch, 0, batch * budget, 0.0012, 0.001 + extra, 0.0005, accepts)
            self.tokens += sum(1 + a for _, a in accepts)
            self.plain_run = 0
        self.seconds += shape.verify_seconds + shape.spec_seconds + shape.base_seconds  # a plain one's: its whole cycle
        return shape


def test_probes_wait_until_what_they_cost_is_a_small_share_of_the_time():
    """Batch 16 where drafting loses (0.82x plain decoding at its steady cost) and a probe's first step catches the
    head up on the off-run (5.4 ms, 9 plain steps): probes at the configured interval (200) backed off to 800 cost
    ~3% of the time (served on an H200, the demo EAGLE-3 pair lost ~5% at batch 16 to probes and their catch-ups).
    Once a probe was timed, the next ones wait until their measured cost is probe_share (3%) of the plain steps
    between them: ~530 steps here (cost 9.6 ms over 0.03 x 0.6 ms)."""
    gpu = CatchingUpGpu(q=0.8)
    policy = chain_policy()
    batch = 16
    assert batch * gpu.expected(6) / 0.0027 < 0.85 * batch / 0.0006
    chosen = run_policy(policy, gpu, batch, 4000)
    starts = [i for i in range(1, len(chosen)) if chosen[i] > 1 and chosen[i - 1] == 1]
    assert all(chosen[i + 2] == 1 for i in starts[1:]), chosen  # probes: two steps, drafting stays off
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert len(starts) >= 3 and min(gaps) >= 500, (starts, gaps)  # still measured, at the cost-based interval
    assert gpu.tokens / gpu.seconds >= 0.985 * batch / 0.0006, gpu.tokens / gpu.seconds


def test_a_probes_cost_is_timed_after_an_off_run_not_after_a_plain_probe():
    """What a probe waits for is priced from drafted steps that follow a run of plain ones (the head's catch-up of the
    run): the drafted step after a plain probe's two steps, with little to catch up on, does not make probes look cheap."""
    policy = chain_policy()
    batch, plain, drafted = 16, 0.0006, 0.0027
    accepts = [(5, 3)] * batch

    def observe(budget: int, seconds: float) -> None:
        if budget == 1:
            policy.observe(StepShape(1, batch, 0, 0, 0.0, 0.0, seconds))
        else:
            policy.observe(StepShape(6, batch, 0, 6 * batch, 0.0012, seconds - 0.0017, 0.0005, accepts))

    for budget, seconds, count in ((6, drafted, 8), (1, plain, 2), (6, drafted, 4), (1, plain, 40), (6, 0.0081, 1),
                                   (6, drafted, 4), (1, plain, 2), (6, drafted, 1)):
        for _ in range(count):
            observe(budget, seconds)
    predicted = {1: batch / plain}
    # timed once, after the 40-step off-run: (8.1 + 2.7 - 2 x 0.6 ms) over 3% of a 0.6 ms plain step
    assert policy._probe_wait(batch, 0, predicted) == int((0.0081 + drafted - 2 * plain) / (0.03 * plain))


def serve_waves(policy: AdaptiveSpeculation, gpu: CatchingUpGpu, waves: int, requests: int = 32, batch: int = 16,
                length: int = 256) -> list[tuple[float, int]]:
    """A benchmark's points at batch 16 as a server runs them: `requests` requests of `length` tokens, at most `batch`
    decoding, those admitted together prefilled in one 1.2 ms step with the others paused; a plain step is one 0.6 ms
    cycle at any batch (a small target), a drafted one CatchingUpGpu's. Each point's (seconds, drafted steps at batch
    16). All plain, a point takes 2 x 256 plain steps and 2 prompt steps: its requests stay in lockstep."""
    out = []
    for _ in range(waves):
        waiting, running, admitted, seconds, drafted = list(range(requests)), {}, 0, 0.0, 0
        while waiting or running:
            while waiting and len(running) + admitted < batch:
                waiting.pop(0)
                admitted += 1
            if admitted:
                for r in range(admitted):
                    running[(len(waiting), r)] = 0
                policy.observe(StepShape(0, 0, 0, 128 * admitted, 0.0006, 0.0, 0.0006))
                seconds, admitted = seconds + 0.0012, 0
                continue
            budget = policy.choose(len(running))
            before = gpu.seconds
            shape = gpu.step(budget, len(running))
            seconds += gpu.seconds - before
            drafted += budget > 1 and len(running) == batch
            policy.observe(shape)
            made = [1 + a for _, a in shape.accepts] if budget > 1 else [1] * len(running)
            for key, n in zip(list(running), made):
                running[key] += n
                if running[key] >= length:
                    del running[key]
        out.append((seconds, drafted))
    return out


@pytest.mark.parametrize("seed", range(3))
def test_waves_at_a_load_where_drafting_loses_are_not_drafted_at_every_return(seed):
    """A benchmark's points at batch 16, one after another, where drafting loses (0.82x at its steady cost): any
    drafted step breaks the point's lockstep, after which arrivals prefill one by one and the point ends in a tail of
    small batches. Each point passes through smaller loads at its tail, and batch 16's drafted timings aged past
    stale_steps meanwhile: predicted from the phases alone, trees were tried again for 10+ steps at every point's start,
    and the probe interval's back-off began anew at each return. Timed at that load before, trees stay capped by what
    they cost then (and the trees not timed there with them), and the load keeps its probe interval: points 2-6 took
    1.07-1.13x all-plain's time and drafted 32-60 steps at batch 16 before; now at most 1.06x and 25 steps."""
    gpu = CatchingUpGpu(q=0.8, seed=seed)
    policy = chain_policy()
    points = serve_waves(policy, gpu, 6)
    plain = 2 * 256 * 0.0006 + 2 * 0.0012
    mean = sum(t for t, _ in points[1:]) / 5
    assert mean <= 1.06 * plain, [round(t / plain, 3) for t, _ in points]
    assert sum(d for _, d in points) <= 25, points


@pytest.mark.parametrize("seed", range(3))
def test_a_warm_ups_drafting_time_does_not_price_the_probes_trees_for_good(seed):
    """As an H200 served the demo EAGLE-3 chain at batch 1 (a963cff): a warm-up's first drafted steps, at budget 5, took
    1.5 ms of drafting (0.3 ms later), so drafting went off. Probes at budget 6 timed 0.3 ms, but one value each (a
    probe's timing was cleared as stale by the next, 256+ steps on), never the min_timings that would let it stand, so
    budget 5's warm-up priced every tree; with drafting off nothing aged, and drafting stayed off for 14339 of 17314
    steps where it made 1.2x plain decoding. Now the probes' timings add up, and while drafting is off timings older
    than stale_steps before the last drafted step are not trusted: the policy drafts."""

    class ProbedGpu(ModelGpu):  # plain steps overlapped (0.63 ms whole cycles), drafted ones 2.1 ms
        def step(self, budget, batch):
            if budget == 1:
                return StepShape(1, batch, 0, 0, 0.0, 0.0, 0.00063)
            accepts = super().step(budget, batch).accepts
            return StepShape(budget, batch, 0, batch * budget, 0.0008, 0.0003, 0.001, accepts)

    gpu = ProbedGpu(q=0.85, seed=seed)
    assert gpu.expected(6) / 0.0021 > 1.2 / 0.00063
    policy = chain_policy()
    for _ in range(4):  # the warm-up's drafted steps
        warm = gpu.step(5, 1)
        warm.spec_seconds, warm.base_seconds = 0.0015, 0.001
        policy.observe(warm)
    chosen = run_policy(policy, gpu, 1, 4000)
    assert sum(b > 1 for b in chosen[-1000:]) >= 950, (policy.probes, chosen[-1000:])


# the engine ----------------------------------------------------------------------------------------------
PROMPTS = ["def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n", "import os\nimport sys\n\n",
           "for i in range(10):\n    print(i)\nfor i in range(10):\n", "class Config:\n    def __init__(self, path):\n",
           "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [", "assert a == 1\nassert b == 2\nassert c == 3\nassert"]


@pytest.fixture(scope="module")
def demo():
    from transformers import AutoTokenizer

    from splitspec.demo import demo_model_dirs
    from splitspec.runtime.runner import ModelRunner, RuntimeConfig

    target = demo_model_dirs()["target"]
    runner = ModelRunner.load(RuntimeConfig(model_path=str(target), dtype="float32", device="cpu",
                                            max_total_tokens=len(PROMPTS) * 256, page_size=16))
    tokenizer = AutoTokenizer.from_pretrained(target)
    return runner, [tokenizer.encode(p) for p in PROMPTS]


class Recording(NgramDrafter):
    """NGRAM, recording how many tokens each extend brought."""

    def __init__(self):
        super().__init__(NgramConfig())
        self.extends: dict[str, list[int]] = {}

    def extend(self, request_id, tokens):
        self.extends.setdefault(request_id, []).append(len(tokens))
        super().extend(request_id, tokens)


class Wrong(NgramDrafter):
    """Drafts chains of tokens the target never picks (its drafts are never accepted)."""

    def draft(self, request_ids, max_nodes):
        return [DraftTree.chain(self.contexts[r][-1], [0] * (n - 1)) if n >= 2 else None
                for r, n in zip(request_ids, max_nodes)]


def step_all(engine: Engine, metrics: EngineMetrics | None = None) -> list[int]:
    """Run to the end; the budget of every decode step."""
    budgets = []
    while engine.has_work:
        engine.step()
        if metrics is not None:
            metrics.observe(engine)
        if engine.report.generated_tokens and not engine.report.prefill_tokens:
            budgets.append(engine.report.budget)
    return budgets


def test_engine_with_the_policy_is_lossless_and_speculates(demo):
    """Greedy outputs with the policy on equal plain decoding's, speculation happened (drafts proposed and
    accepted, no fallbacks), the budgets it chose are reported per step and as gauges, and requests that opted
    out get no drafts."""
    runner, prompts = demo
    params = [SamplingParams(temperature=0.0, max_new_tokens=48, ignore_eos=True) for _ in prompts]
    plain = Engine(runner, None, SpecConfig(), set()).run(prompts, params)
    engine = Engine(runner, InProcessDrafterClient(NgramDrafter(NgramConfig())),
                    SpecConfig(num_draft_tokens=6, adaptive=True, num_steps=5), set())
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry, "demo")
    requests = [engine.add_request(p, sp, speculate=i % 3 != 2) for i, (p, sp) in enumerate(zip(prompts, params))]
    budgets = step_all(engine, metrics)
    assert [r.output_ids for r in requests] == [r.output_ids for r in plain]
    speculating = [r for r in requests if r.speculate]
    assert sum(r.stats.draft_tokens for r in speculating) > 0
    assert sum(r.stats.accepted_tokens for r in speculating) > 0
    assert all(r.stats.fallbacks == 0 for r in requests)
    assert all(r.stats.verify_steps == 0 for r in requests if not r.speculate)
    assert set(budgets) <= set(engine.adaptive.ladder) and budgets[0] == 6
    labels = {"model_name": "demo"}
    assert registry.get_sample_value("splitspec:spec_adaptive_num_draft_tokens", labels) == engine.report.budget
    assert registry.get_sample_value("splitspec:spec_adaptive_num_steps", labels) == min(5, engine.report.budget - 1)
    assert runner.kv_cache.allocator.num_used == 0


def test_engine_turns_speculation_off_when_it_cannot_pay_and_stays_lossless(demo):
    """Drafts that are never accepted cannot pay for what drafting and verifying them costs: the policy turns
    drafting off (budget 1 on nearly every later step, a probe now and then) and outputs stay plain's."""
    runner, prompts = demo
    params = [SamplingParams(temperature=0.0, max_new_tokens=120, ignore_eos=True) for _ in prompts[:3]]
    plain = Engine(runner, None, SpecConfig(), set()).run(prompts[:3], params)
    engine = Engine(runner, InProcessDrafterClient(Wrong(NgramConfig())),
                    SpecConfig(num_draft_tokens=6, adaptive=True, num_steps=5, adaptive_probe_interval=40), set())
    requests = [engine.add_request(p, sp) for p, sp in zip(prompts[:3], params)]
    budgets = step_all(engine)
    assert [r.output_ids for r in requests] == [r.output_ids for r in plain]
    assert budgets[0] == 6 and all(r.stats.draft_tokens > 0 and r.stats.accepted_tokens == 0 for r in requests)
    # off on the later steps but for two-step probes (40 steps apart, then 80): no tree is predicted faster per step
    # than plain decoding, so a busy CPU's noisy timings cannot keep one whose drafts are not accepted (before that
    # bound, CI once saw a budget of 2 held for 37 of the last 60 steps)
    assert budgets[-60:].count(1) >= 50, budgets


def traced_overlap(demo, tmp_path, monkeypatch, drafter, max_new_tokens: int, **spec):
    """An overlapped engine with this in-process drafter and the load-adaptive policy tracing to a file; three of the
    demo's prompts, greedy params of max_new_tokens for each and plain decoding's requests of them: (engine, prompts,
    params, plain requests, trace path)."""
    from splitspec.verifier_svc.adaptive_estimates import TRACE_ENV

    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv(TRACE_ENV, str(trace))
    runner, prompts = demo
    params = [SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True) for _ in prompts[:3]]
    plain = Engine(runner, None, SpecConfig(), set()).run(prompts[:3], params)
    engine = Engine(runner, InProcessDrafterClient(drafter), SpecConfig(num_draft_tokens=6, adaptive=True, num_steps=5,
                                                                        **spec), set(), overlap_schedule=True)
    return engine, prompts, params, plain, trace


def trace_records(engine, trace) -> list[dict]:
    """The policy's trace once the last step's cycle and the held-back ones are told, as a next step would tell them."""
    import json

    engine._observe_last(engine._clock())
    engine._flush_quiet()
    engine.adaptive._trace.close()
    return [json.loads(line) for line in trace.read_text().splitlines()]


def test_a_settled_drafting_off_run_is_quiet_and_the_policy_still_sees_every_step(demo, tmp_path, monkeypatch):
    """Under the overlap schedule (a GPU server's, here on a CPU), once drafting is settled off most steps neither ask
    the policy nor report to it (report.quiet); outputs stay plain's, and the policy's trace still holds an
    observation of every step it would have seen, numbered without a gap, and a choice for each quiet step."""
    engine, prompts, params, plain, trace = traced_overlap(demo, tmp_path, monkeypatch, Wrong(NgramConfig()), 160,
                                                          adaptive_probe_interval=40)
    requests = [engine.add_request(p, sp) for p, sp in zip(prompts[:3], params)]
    steps = quiet = 0
    while engine.has_work:
        engine.step()
        steps, quiet = steps + 1, quiet + engine.report.quiet
    assert [r.output_ids for r in requests] == [r.output_ids for r in plain]
    assert quiet > steps / 2, (quiet, steps)
    records = trace_records(engine, trace)
    observed = [r for r in records if r["kind"] == "observe"]
    assert [r["step"] for r in observed] == list(range(len(observed))) == list(range(engine.adaptive._steps))
    assert len(observed) >= steps - 10  # all but the steps that only launched (the overlap's first of a run)
    settled = [r for r in records if r["kind"] == "choose" and "predicted" not in r and r["choice"] == 1]
    assert len(settled) >= quiet


def test_an_opted_out_run_is_quiet_and_the_policy_still_sees_every_step(demo, tmp_path, monkeypatch):
    """Requests that opted out (speculate False) beside a drafter and its policy, overlapped (a GPU server's schedule,
    here on a CPU): their run's steps are quiet (nothing to choose; each cycle held back and handed over together), and
    the trace still holds an observation of every step, numbered without a gap, at the engine's budget, none speculating.
    Then a request that speculates joins: drafted steps are verified and observed as before; outputs equal plain's."""
    engine, prompts, params, plain, trace = traced_overlap(demo, tmp_path, monkeypatch, NgramDrafter(NgramConfig()), 80)
    requests = [engine.add_request(p, sp, speculate=False) for p, sp in zip(prompts[:2], params)]
    steps = quiet = 0
    while engine.has_work:
        if steps == 40:
            requests.append(engine.add_request(prompts[2], params[2]))
        engine.step()
        steps, quiet = steps + 1, quiet + (engine.report.quiet and steps < 40)
    assert [r.output_ids for r in requests] == [r.output_ids for r in plain]
    assert quiet >= 30, (quiet, steps)
    assert requests[2].stats.verify_steps > 0 and requests[2].stats.draft_tokens > 0
    observed = [r for r in trace_records(engine, trace) if r["kind"] == "observe"]
    assert [r["step"] for r in observed] == list(range(len(observed))) == list(range(engine.adaptive._steps))
    opted_out = [r for r in observed if r["speculating"] == 0 and r["plain"] == 2 and not r["forward_tokens"]]
    # before the join the engine's budget is the spec's (nothing is chosen for opted-out requests); after it, the policy's
    assert len(opted_out) >= quiet and {r["budget"] for r in opted_out[:quiet]} == {6}


def test_speculation_off_still_feeds_the_drafter(demo):
    """With speculation off (the policy's choice forced to 1), the drafter still gets every request's tokens, in
    batches of FEED_EVERY, so drafting can resume at once; no drafts are verified."""
    from splitspec.drafter_svc.base import FEED_EVERY

    runner, prompts = demo
    params = [SamplingParams(temperature=0.0, max_new_tokens=3 * FEED_EVERY + 5, ignore_eos=True) for _ in prompts[:2]]
    drafter = Recording()
    engine = Engine(runner, InProcessDrafterClient(drafter), SpecConfig(num_draft_tokens=6, adaptive=True, num_steps=5),
                    set())
    engine.adaptive.choose = lambda *args, **kwargs: 1  # the policy's decision, forced: the feeding is under test
    requests = [engine.add_request(p, sp) for p, sp in zip(prompts[:2], params)]
    step_all(engine)
    for request in requests:
        assert drafter.extends[request.request_id] == [FEED_EVERY] * 3, drafter.extends
        assert request.stats.verify_steps == 0 and len(request.output_ids) == 3 * FEED_EVERY + 5


def test_speculation_off_feeds_staggered_requests_together(demo):
    """Requests that began decoding at different steps are fed in the same steps (when one has FEED_EVERY tokens
    unsent, all go), so the drafter catches up in one forward per feed, not one per request as each reaches the
    mark; every token still reaches it, in order, and outputs equal plain decoding's."""
    from splitspec.drafter_svc.base import FEED_EVERY

    runner, prompts = demo
    drafter = Recording()
    engine = Engine(runner, InProcessDrafterClient(drafter), SpecConfig(num_draft_tokens=6, adaptive=True, num_steps=5),
                    set())
    engine.adaptive.choose = lambda *args, **kwargs: 1
    feeds = []  # per drafter call: the requests it fed
    original = engine.drafter.request
    engine.drafter.request = lambda asks: (feeds.append(sorted(a.request_id for a in asks if a.new_tokens)), original(asks))
    params = SamplingParams(temperature=0.0, max_new_tokens=3 * FEED_EVERY, ignore_eos=True)
    first = engine.add_request(prompts[0], params)
    for _ in range(5):  # the second request starts 5 steps later
        engine.step()
    second = engine.add_request(prompts[1], params)
    step_all(engine)
    plain = Engine(runner, None, SpecConfig(), set()).run(prompts[:2], [params] * 2)
    assert [first.output_ids, second.output_ids] == [r.output_ids for r in plain]
    decode_feeds = [f for f in feeds if f]
    both = [f for f in decode_feeds if f == sorted([first.request_id, second.request_id])]
    assert len(both) >= 2, decode_feeds  # fed together while both decode
    for request in (first, second):  # every output token but those after the last feed reached the drafter
        sent = sum(drafter.extends.get(request.request_id, []))
        assert 0 < sent <= len(request.prompt_ids) + len(request.output_ids)
        assert sent >= len(request.output_ids) - FEED_EVERY, (sent, len(request.output_ids))


def test_budgets_that_change_every_few_steps_over_zeromq_with_overlap(demo):
    """The policy's decisions as the drafter pool sees them: a real `splitspec drafter` process over tcp with
    overlap on, the budget changing every few steps (full, none with feed-only asks, smaller with bets drafted
    under the larger one trimmed, full again). Outputs equal plain's, drafts are accepted, no step falls back
    and the drafter drops nothing."""
    from test_drafter_pool import start_drafter
    from test_verifier_service import free_port

    from splitspec.verifier_svc.drafter_pool import DrafterPool

    runner, prompts = demo
    params = [SamplingParams(temperature=0.0, max_new_tokens=90, ignore_eos=True) for _ in prompts[:4]]
    plain = Engine(runner, None, SpecConfig(), set()).run(prompts[:4], params)
    pool = DrafterPool(f"tcp://127.0.0.1:{free_port()}", "NGRAM", runner.config.vocab_size, timeout=5.0,
                       heartbeat_timeout=30.0, overlap="on", num_bets=4)
    process = start_drafter(pool.address, "adaptive")
    try:
        assert pool.wait_for_drafters(1, 60.0)
        engine = Engine(runner, pool, SpecConfig(num_draft_tokens=6, adaptive=True), set())
        schedule = [6] * 5 + [1] * 20 + [3] * 5 + [6] * 4 + [2] * 3
        steps = iter(range(10_000))
        engine.adaptive.choose = lambda *args, **kwargs: schedule[next(steps) % len(schedule)]
        requests = [engine.add_request(p, sp) for p, sp in zip(prompts[:4], params)]
        budgets = step_all(engine)
        assert [r.output_ids for r in requests] == [r.output_ids for r in plain]
        assert {1, 2, 3, 6} <= set(budgets)
        assert all(r.stats.fallbacks == 0 and r.stats.accepted_tokens > 0 for r in requests)
        assert pool.stats.faults == 0 and pool.stats.extra.get("bet_hits", 0) > 0
    finally:
        pool.close()
        process.kill()
        process.wait(timeout=30)
