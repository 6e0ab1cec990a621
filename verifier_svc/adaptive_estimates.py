"""What the load-adaptive policy (verifier_svc/adaptive.py) knows: each finished step observed into accept rates by
depth, accept lengths by budget, the forward's timings by size, speculation's own time and the rest of a cycle by budget
and load, and whole cycles; and the estimates a choice is predicted from (E(N), verify(T), spec(N, B)), as the policy's
module doc defines them. The choosing is the policy's; this is its memory.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

from splitspec.verifier_svc.timings import Cycle, Recent, batch_bucket, token_bucket

TRACE_ENV = "SPLITSPEC_ADAPTIVE_TRACE"  # a file path: every observation and choice as JSON lines, to replay offline
OFF_RUN = 16  # plain steps in a row after which a drafted step is a probe's or a switch's first (drafter_svc.base.FEED_EVERY)


def _cycle_record(step: int, budget: int, speculating: int, plain: int, seconds: float) -> str:
    """The trace line observe() writes for an overlapped plain step's whole cycle (StepShape(budget, speculating, plain,
    0, 0.0, 0.0, seconds)), without building the shape: the quiet runs' records."""
    return (f'{{"kind": "observe", "step": {step}, "budget": {budget}, "speculating": {speculating}, "plain": {plain}, '
            f'"forward_tokens": 0, "verify_seconds": 0.0, "spec_seconds": 0.0, "base_seconds": {json.dumps(seconds)}, '
            f'"accepts": []}}\n')


@dataclass
class StepShape:
    """What a finished step did, for the policy."""

    budget: int  # the tree budget its speculating requests were asked with (1: none)
    speculating: int  # decoding requests that verified a tree (or their root, at budget 1) and speculate
    plain: int  # decoding requests that do not speculate
    forward_tokens: int  # tokens in the target forward (trees, roots and prefill chunks)
    verify_seconds: float
    spec_seconds: float  # draft + ask phases
    base_seconds: float  # the rest of the step's cycle (schedule, accept, commit, bookkeeping, the caller's share)
    accepts: list[tuple[int, int]] = field(default_factory=list)  # per verify with drafts: (tree depth, accepted)


@dataclass(frozen=True)
class AdaptiveConfig:
    max_budget: int  # --speculative-num-draft-tokens
    num_steps: int  # the drafter's depth (--speculative-num-steps)
    chain: bool = False  # top-1 drafts: a budget's tree is the chain of its depth, so E(N) comes from a_d alone
    hysteresis: float = 0.015  # relative predicted gain a switch needs
    probe_interval: int = 200  # steps without drafts between two probes of the acceptance
    decay: float = 0.99  # per step with speculating requests, of the acceptance counts (~100 steps of memory)
    min_timings: int = 3  # timings of a forward size before they count (until then it is predicted optimistically)
    min_samples: float = 8.0  # decayed verifies at a budget before its own accept length is trusted
    optimism: float = 0.25  # the acceptance bonus of a depth with no trials (over trials + 1 with them)
    stale_steps: int = 256  # while speculating, timings older than this are not trusted (see the module's doc)
    repredict_every: int = 8  # steps a settled choice's predictions serve the same batch (a choice costs ~0.1 ms)
    # the same with drafting off and no probe due: only plain steps' own timings move the predictions then
    repredict_off_every: int = 64
    # at most this share of the time between probes goes to probing: a probe's two drafted steps, the first catching
    # the drafter up on the off-run (a head's backlog: ~2.5 ms at batch 1, ~5 ms at 16 on an H200 serving the demo pair)
    probe_share: float = 0.03


class AdaptiveEstimates:
    """The policy's measurements (observe) and the estimates it predicts from; AdaptiveSpeculation chooses by them."""

    def __init__(self, config: AdaptiveConfig):
        self.config = config
        self.budget = config.max_budget  # what the last choice was (the policy's; _horizon reads it)
        depth = self._depth(config.max_budget)
        self._trials = [0.0] * (depth + 1)  # [d]: decayed verifies that drafted depth d with d-1 accepted
        self._hits = [0.0] * (depth + 1)  # [d]: those that accepted d
        self._tier_tokens: dict[int, float] = {}  # budget -> decayed sum of tokens per verify
        self._tier_count: dict[int, float] = {}  # budget -> decayed verifies
        self._verify: dict[int, tuple[Recent, Recent]] = {}  # token bucket -> (mean tokens, mean seconds)
        self._spec: dict[tuple[int, int], Recent] = {}  # (budget, batch bucket) -> seconds outside the forward
        self._base: dict[tuple[bool, int], Recent] = {}  # (drafted?, batch bucket) -> seconds
        # (False, batch bucket) -> whole cycles of plain steps the overlap schedule ran (forward under the host's work)
        self._whole: dict[tuple[bool, int], Recent] = {}
        # (budget, batch quarter-octave) -> whole decode cycles; plain decoding's never go stale (they do not depend
        # on the traffic), a budget's do, as its timings do
        self._cycles: dict[tuple[int, int], Cycle] = {}
        # batch bucket -> whole cycles of a drafted step right after a run of plain ones (a probe's, a switch's: the
        # drafter catches up on what it was fed meanwhile); what a probe costs is priced from them
        self._first_drafted: dict[int, Recent] = {}
        self._plain_run = 0  # consecutive steps at budget 1 with speculating requests, up to the last one observed
        self._previous_budget = -1  # the last observed step's budget (-1: none yet; 0: it ran prompt chunks)
        self._steps = 0  # steps observed
        self._age = 0  # steps observed with requests that speculate: what timings age by (opted-out runs age nothing)
        self._drafted_at = -1  # _age at the last step with drafts (a probe's, while drafting is off)
        self._accepts_at = 0  # _age at the last step with verified drafts (the acceptance counts age by _age too)
        self._acceptance_cache: list[float] = []
        self._acceptance_at = -1  # the step it was computed at
        self._curve: list[tuple[float, float]] = []
        self._curve_at: tuple[int, int] | None = None
        self._nearest_memo: dict[tuple, float] = {}
        self._nearest_at = -1
        path = os.environ.get(TRACE_ENV)
        self._trace = open(path, "a", buffering=1) if path else None  # noqa: SIM115 (line-buffered: a killed server keeps its lines)

    def _record(self, kind: str, **fields) -> None:
        self._trace.write(json.dumps({"kind": kind, "step": self._steps, **fields}) + "\n")

    def _depth(self, budget: int) -> int:
        return min(self.config.num_steps, budget - 1)

    # learning ------------------------------------------------------------------------------------
    def observe(self, step: StepShape) -> None:
        cfg = self.config
        if step.speculating + step.plain == 0 and step.forward_tokens == 0:
            return
        if self._trace is not None:
            self._record("observe", **asdict(step))
        self._steps += 1
        self._age += step.speculating > 0
        now, stale = self._age, cfg.stale_steps
        if step.budget > 1 and step.speculating:
            self._drafted_at = now
        # a probe's steps (drafting off: the policy's budget stays 1) keep what the probes before timed: each probe times
        # one steady step, and a budget probed at intervals longer than stale_steps, its timings cleared as stale at
        # every probe, never held min_timings of its own (another budget's warm-up steps then priced it for good)
        stale = 0 if self.budget == 1 and step.budget > 1 else stale
        batch = step.speculating + step.plain
        decode_only = step.forward_tokens <= step.speculating * step.budget + step.plain
        # a step at another budget than the one before (a probe, a try, a switch) pays the change (the drafter's
        # catch-up, a shape's first use): kept out of the costs, as are prompt chunks' steps (their host work) and
        # the decode step after them, out of the forward's timings too: the drafter catches up over the prompts, and
        # a server's first decode step replays every graph for the first time (one timed 30x its successors, and
        # kept drafting off for good)
        cold = self._previous_budget == 0 and batch and decode_only
        steady = step.budget == self._previous_budget or self._previous_budget < 0
        if self._plain_run >= OFF_RUN and step.budget > 1 and step.speculating and decode_only:
            # after an off-run, not a plain probe's two steps while drafting (those leave little to catch up on)
            self._first_drafted.setdefault(batch_bucket(batch), Recent()).add(
                step.verify_seconds + step.spec_seconds + step.base_seconds)
        if step.speculating:
            self._plain_run = self._plain_run + 1 if step.budget == 1 else 0
        self._previous_budget = step.budget if batch and decode_only else 0
        if step.forward_tokens and not cold:
            key = token_bucket(step.forward_tokens)
            tokens, seconds = self._verify.setdefault(key, (Recent(), Recent()))
            tokens.add(step.forward_tokens, now, stale)
            seconds.add(step.verify_seconds, now, stale)
        if batch and decode_only and steady:
            drafted = step.budget > 1 and step.speculating > 0
            # an overlapped plain step (no forward timed: it ran under the host's work) is a whole cycle, not a base
            base = self._whole if not (drafted or step.forward_tokens) else self._base
            base.setdefault((drafted, batch_bucket(batch)), Recent()).add(step.base_seconds, now, stale)
            if step.speculating:
                self._spec.setdefault((step.budget, batch_bucket(step.speculating)), Recent()).add(
                    step.spec_seconds, now, stale)
            self._cycles.setdefault((step.budget if drafted else 1, token_bucket(batch)), Cycle()).add(
                step.verify_seconds + step.spec_seconds + step.base_seconds, now, stale if drafted else 0)
        if step.accepts:
            # decayed by the steps with speculating requests since the last verifies with drafts, not once per such
            # verify: while drafting is off nothing measures the acceptance but probes, and counts kept whole through
            # the off-run (a warm-up's short answers, another traffic) outweighed every probe's two verifies for good.
            # But to no less than min_samples verifies' weight: counts decayed to nothing would make every depth
            # optimistic (the bonus of a depth with no trials) and keep drafting on one probe's luck
            verifies = self._trials[1]  # every verify with drafts tried depth 1
            floor = min(1.0, cfg.min_samples / verifies) if verifies else 1.0
            decay = max(cfg.decay ** max(now - self._accepts_at, 1), floor)
            self._accepts_at = now
            for d in range(1, len(self._trials)):
                self._trials[d] *= decay
                self._hits[d] *= decay
            for tier in self._tier_count:
                self._tier_count[tier] *= decay
                self._tier_tokens[tier] *= decay
            for depth, accepted in step.accepts:
                for d in range(1, min(depth, len(self._trials) - 1) + 1):
                    if accepted < d - 1:
                        break
                    self._trials[d] += 1
                    self._hits[d] += accepted >= d
            # per speculating request: one that got no tree this step (NGRAM found no match) made one token
            self._tier_count[step.budget] = self._tier_count.get(step.budget, 0.0) + max(step.speculating,
                                                                                          len(step.accepts))
            self._tier_tokens[step.budget] = self._tier_tokens.get(step.budget, 0.0) + sum(
                1 + a for _, a in step.accepts) + max(step.speculating - len(step.accepts), 0)

    def _observe_off_cycles(self, speculating: int, plain: int, cycles: list[float], choices: int) -> None:
        """observe() of len(cycles) overlapped drafting-off steps of this batch in a row (budget 1, no forward timed:
        their whole cycles), at once; with the trace, their records and those of the `choices` settled choices
        between them (adaptive.AdaptiveSpeculation.observe_quiet) as observe() and choose() write them, in order.
        Only after such a step (the last observed at budget 1 with this batch decoding): else one by one."""
        if self._previous_budget != 1 or not speculating:
            for j in range(max(choices, len(cycles))):
                if j < choices and self._trace is not None and speculating:
                    self._record("choose", speculating=speculating, plain=plain, prefill=0, choice=1, budget=self.budget)
                if j < len(cycles):
                    self.observe(StepShape(1, speculating, plain, 0, 0.0, 0.0, cycles[j]))
            return
        if self._trace is not None:
            lines = []
            for j in range(max(choices, len(cycles))):
                step = self._steps + j
                if j < choices:
                    lines.append(f'{{"kind": "choose", "step": {step}, "speculating": {speculating}, "plain": {plain}, '
                                 f'"prefill": 0, "choice": 1, "budget": {self.budget}}}\n')
                if j < len(cycles):
                    lines.append(_cycle_record(step, 1, speculating, plain, cycles[j]))
            self._trace.write("".join(lines))
        if not cycles:
            return
        count, first, stale = len(cycles), self._age + 1, self.config.stale_steps
        self._steps += count
        self._age += count
        self._plain_run += count
        batch = speculating + plain
        self._whole.setdefault((False, batch_bucket(batch)), Recent()).add_run(cycles, first, stale)
        self._spec.setdefault((1, batch_bucket(speculating)), Recent()).add_run([0.0] * count, first, stale)
        self._cycles.setdefault((1, token_bucket(batch)), Cycle()).add_run(cycles, first)

    def _observe_opted_out_cycles(self, plain: int, cycles: list[float], budget: int) -> None:
        """observe() of len(cycles) overlapped steps in a row of `plain` requests that all opted out (no forward timed:
        their whole cycles; reported at `budget`), at once, their records in the trace as observe() writes them. Such
        steps age nothing (no request speculates): each is a plain cycle of this batch at the same age."""
        if cycles and self._previous_budget not in (budget, -1):  # the first after another budget's: not steady
            self.observe(StepShape(budget, 0, plain, 0, 0.0, 0.0, cycles[0]))
            cycles = cycles[1:]
        if not cycles:
            return
        if self._trace is not None:
            self._trace.write("".join(_cycle_record(self._steps + j, budget, 0, plain, c) for j, c in enumerate(cycles)))
        self._steps += len(cycles)
        self._previous_budget = budget
        now, stale = self._age, self.config.stale_steps
        self._whole.setdefault((False, batch_bucket(plain)), Recent()).add_same(cycles, now, stale)
        self._cycles.setdefault((1, token_bucket(plain)), Cycle()).add_same(cycles, now)

    # prediction ----------------------------------------------------------------------------------
    def acceptance(self) -> list[float]:
        """See _acceptance; computed once per observed step (a choice asks for it once per budget)."""
        if self._acceptance_at != self._steps:
            self._acceptance_cache, self._acceptance_at = self._acceptance(), self._steps
        return self._acceptance_cache

    def _acceptance(self) -> list[float]:
        """a_1..a_S: the estimated fraction of verifies that accept at least d drafts, from each depth's
        conditional rate: its decayed hits over trials, pulled towards the depth above's rate while it has few
        trials, plus an optimism bonus that shrinks as trials grow (a depth not drafted lately, whose trials
        decay, gets tried again instead of staying judged by a few old samples)."""
        rates, a, prior, weight = [], 1.0, 0.5, 0.2
        for d in range(1, len(self._trials)):
            trials = self._trials[d]
            rate = (self._hits[d] + weight * prior) / (trials + weight)
            prior, weight = rate, 1.0
            a *= min(1.0, rate + self.config.optimism / (trials + 1.0))
            rates.append(a)
        return rates

    def expected_tokens(self, budget: int, optimistic: bool = False) -> float:
        """E(N): tokens per verify of a request at this budget (1 at budget 1)."""
        if budget <= 1:
            return 1.0
        depth = self._depth(budget)
        if optimistic:
            return 1.0 + depth
        count = self._tier_count.get(budget, 0.0)
        if not self.config.chain and count >= self.config.min_samples:
            return self._tier_tokens[budget] / count
        return 1.0 + sum(self.acceptance()[:depth])

    def verify_seconds(self, tokens: int) -> float | None:
        """The forward's time for this many tokens, interpolated between the points seen (a size between two far-apart
        points, never timed, costs the smaller's); below the first, proportional, above the last, the last segment's
        slope (both optimistic: tried, and their times then correct the curve)."""
        points = self._verify_curve()
        if not points:
            return None
        if tokens <= points[0][0]:  # not seen: optimistic (proportional), so that it is tried and measured
            return points[0][1] * tokens / points[0][0]
        for (t0, s0), (t1, s1) in zip(points, points[1:]):
            if tokens <= t1:
                if token_bucket(tokens) not in (token_bucket(t0), token_bucket(t1)):  # between two far apart, untimed:
                    return s0  # as cheap as the smaller (the cost may stay flat that far), so that it gets tried
                return s0 + (s1 - s0) * (tokens - t0) / (t1 - t0) if t1 > t0 else s1
        t_last, s_last = points[-1]
        slope = 0.0
        if len(points) > 1:
            t_prev, s_prev = points[-2]
            slope = max((s_last - s_prev) / (t_last - t_prev), 0.0) if t_last > t_prev else 0.0
        return s_last + slope * (tokens - t_last)

    def _verify_curve(self) -> list[tuple[float, float]]:
        """The (tokens, seconds) points verify_seconds interpolates, built once per observed step and horizon."""
        key = (self._steps, self._horizon())
        if self._curve_at == key:
            return self._curve
        timed = list(self._verify.values())
        fresh = [(t, s) for t, s in timed if s.last >= key[1]]
        timed = fresh or timed
        trusted = [(t.value, s.value) for t, s in timed if s.count >= self.config.min_timings]
        # sizes timed fewer times are left out once others are trusted: predicted from those, optimistically,
        # they get tried again instead of being judged by one sample
        points = sorted(trusted or [(t.value, s.value) for t, s in timed])
        for i in range(len(points) - 2, -1, -1):  # more tokens never cost less: a noisy high point does not stick
            if points[i][1] > points[i + 1][1]:
                points[i] = (points[i][0], points[i + 1][1])
        self._curve, self._curve_at = points, key
        return points

    def _horizon(self) -> int:
        """The oldest step whose timings are trusted: the last stale_steps while speculation is on; while it is off,
        nothing replaces them, so all but those older than stale_steps before the last drafted step (a probe's): a
        budget timed only in a warm-up's first steps, long before the probes, is not what drafting costs now (on an
        H200 serving the demo EAGLE-3 pair, a budget-5 warm-up's 2.5 ms of drafting priced every tree at batch 1 for
        the whole run, against ~0.3 ms probed, and drafting stayed off where it made 1.2x plain decoding)."""
        if self.budget > 1:
            return self._age - self.config.stale_steps
        return self._drafted_at - self.config.stale_steps if self._drafted_at >= 0 else -1

    def _enough(self, timings: Recent) -> bool:
        """Whether these timings hold min_timings values (fewer are not yet what the thing costs: its first, odd steps)."""
        return len(timings.values) >= self.config.min_timings

    def _nearest(self, table: dict, bucket: int, first, fresh: bool = False, trusted: bool = False,
                 below: bool = False) -> float:
        """The entry of table (keyed (first, batch bucket)) nearest this batch bucket among those of `first`
        (and with fresh, timed lately); 0 where there is none: optimistic, so that it gets tried. With trusted, 0 too
        where no load was timed min_timings times (a few odd steps are not evidence). With below, only this load's and
        smaller ones' (a cost that grows with the batch: a larger batch's would be a pessimistic guess, never tried)."""
        horizon = self._horizon() if fresh else -1
        memo_key = (id(table), bucket, first, horizon, trusted, below)
        if self._nearest_at != self._steps:  # the tables change only when a step is observed
            self._nearest_memo.clear()
            self._nearest_at = self._steps
        value = self._nearest_memo.get(memo_key)
        if value is None:
            keys = [k for k in table if k[0] == first and table[k].last >= horizon and (not below or k[1] <= bucket)]
            enough = [k for k in keys if self._enough(table[k])]
            if enough:
                value = table[min(enough, key=lambda k: abs(k[1] - bucket))].value
            elif trusted:
                value = 0.0
            else:  # no load timed enough lately: the median of what there is (one odd step is not a load's)
                pooled = sorted(x for k in keys for x in table[k].values)
                value = pooled[len(pooled) // 2] if pooled else 0.0
            self._nearest_memo[memo_key] = value
        return value

    def _spec_seconds(self, budget: int, bucket: int, trusted: bool = False) -> float:
        """What speculation adds outside the forward at this budget and load: as timed here, else the nearest budget's
        here (a drafter's time follows the batch more than the budget: tries one by one otherwise), else its own at the
        nearest load, else the nearest budget's there (not free); 0 (so tried) where nothing was timed. A budget timed
        fewer than min_timings times here is priced as the nearest one timed that often (its few steps may have been
        its first: warming up); with trusted, only such timings count (else 0)."""
        horizon = self._horizon()
        here = [k for k in self._spec if k[0] > 1 and k[1] == bucket and self._spec[k].last >= horizon]
        enough = [k for k in here if self._enough(self._spec[k])]
        if enough or trusted:
            here = enough
        if here and budget > 1:
            return self._spec[min(here, key=lambda k: (abs(k[0] - budget), k[0]))].value
        own = self._nearest(self._spec, bucket, budget, fresh=True, trusted=trusted)
        if own or budget <= 1:
            return own
        timed = [k for k in self._spec if k[0] > 1 and self._spec[k].last >= horizon and self._enough(self._spec[k])]
        near = min(timed, key=lambda k: (abs(k[1] - bucket), abs(k[0] - budget), k[0]), default=None)
        return 0.0 if near is None else self._spec[near].value
