"""Load-adaptive speculation (--speculative-adaptive): each step's tree budget follows the batch size and the
measured acceptance, down to none, so that speculative decoding is never slower than plain decoding.

vLLM switches the number of drafts by fixed batch-size thresholds, and throughput falls off a cliff where a
threshold is crossed (REFERENCES §11); SGLang's adaptive mode picks among step tiers from the accept length
alone, blind to load. Here every step picks, among the budgets 1 (plain decoding) .. --speculative-num-draft-
tokens, the one with the largest expected throughput

    tokens per second(N) = (B * E(N) + P) / (base(B) + spec(N, B) + verify(B * N + P + F))

    B          decoding requests that speculate; P: those that do not (per-request opt-out, one token each);
               F: prefill tokens in the step
    E(N)       expected tokens per verify of a tree of N nodes: 1 + a_1 + ... + a_D, D = min(steps, N - 1),
               a_d = the measured fraction of verifies that accept at least d drafts (counts decayed by every
               step with speculating requests, drafting or not, so it follows the traffic, to no less than
               min_samples verifies' weight); for trees (top-k > 1, NGRAM), where N was used recently enough, its own
               measured accept length
    verify(T)  the target forward's measured time for T tokens: the median of recent timings per quarter-octave of T,
               made non-decreasing in T and interpolated between the points seen (the cost's shape is learned,
               not assumed: flat while memory-bound, rising once compute-bound)
    spec(N,B)  the measured time speculation adds outside the forward at that budget and batch: waiting for
               trees (a co-located drafter's compute; ~0 for a drafter on its own GPU with overlap) and
               asking for them
    base(B,s)  the rest of a step's whole cycle, until the next step starts (schedule, accept, commit, the
               engine's bookkeeping and its caller's handling of the new tokens), measured apart for steps that
               speculate (s) and steps that do not: it grows with the tokens a step emits. A plain step the overlap
               schedule ran (its forward under the host's work, so not timed apart) is priced at its whole cycle
               instead of verify + base: added to a forward from the curve, it would count the forward twice

The sum of those parts is checked against whole decode cycles as they ran (their mean per budget and load, timed
at min_timings steps or more): a tree is predicted at the lower of the two, plain decoding at the higher, so a
stall in some steps or a cost the phases misattribute cannot keep a tree that is measured slower than plain
decoding (see _correct). And a drafted step does all a plain step does and more, so no tree is predicted to take
less time than plain decoding at that load (drafts that are not accepted cannot win on timings' noise; see _bound).
Steps with prompt chunks, the step after them, and a step at another budget than the one before (a probe, a try, a
switch), stay out of the costs.

Both sides of a switch predict the same throughput at the switch point, so throughput changes smoothly as load crosses
it (no cliff); a switch needs a predicted gain of --speculative-adaptive-hysteresis, so the budget does not flap,
except away from a tree predicted no faster than plain decoding (drafting that gains nothing is not kept by the
hysteresis: it costs the drafter's work, which the forward's time does not show). A budget never tried is predicted
optimistically (its acceptance from the larger budgets, its drafting time the nearest budget's at this load, else its
own at the nearest load, else the nearest budget's there), tried, measured and kept or left. While speculation is off
the acceptance cannot be measured, so after --speculative-adaptive-probe-interval steps two steps speculate with the
best budget (the second one's costs are timed: steady), when full acceptance could make speculation win at that load
at all; each probe that leaves drafting off doubles the wait for the next (up to 8x) until drafting resumes at that
load (a power-of-two batch; it keeps its wait while others run); and where a probe was timed at that load, the wait is
at least long enough that probing takes no more than probe_share (3%) of the time (a probe's first step catches a head
up on everything it was fed while drafting was off: on an H200 serving the demo EAGLE-3 pair, 5.4 ms at batch 16, nine
plain steps);
between probes, at a load that holds, the choice reuses the predictions it was made from (up to repredict_off_every
steps: with no tree running, only plain steps' own timings could move them). While it speculates, timings older than
256 steps with speculating requests (a run where all opted out ages nothing) are not trusted (a forward size or budget
timed only that long ago is predicted optimistically again) and are dropped when a new one comes: a budget judged by
its first, warming-up steps, or by a load that has passed, is measured again; but a tree's whole cycles timed at a load
still cap that load's trees when it comes back (at the acceptance of now), and the trees not timed there with them,
so that a load met again is not drafted on hope for min_timings steps. While it does not, nothing is timed but
plain steps and probes: timings older than 256 steps before the last drafted step (a probe's) are not trusted, and
probes add to the probes' timings before them instead of replacing them (a budget timed only by a warm-up's slow first
steps priced every probed tree for good). Plain decoding too: drafting on, where it was last timed at this load that
long ago or never, three plain steps time it (a plain probe; drafting stays chosen unless plain now wins); once timed
at a load it is priced by its own cycles there, until then at most at a smaller load's cost (a larger batch's cycle
would keep it from ever being tried).

Greedy outputs do not depend on the budget (any tree verifies losslessly), nor do seeded samples.
"""

from __future__ import annotations

from splitspec.verifier_svc.adaptive_estimates import AdaptiveConfig, AdaptiveEstimates
from splitspec.verifier_svc.step_types import SpecConfig
from splitspec.verifier_svc.timings import batch_bucket, token_bucket


PLAIN_PROBE_STEPS = 3  # a plain probe's steps (see _decide)


def budget_ladder(max_budget: int) -> list[int]:
    """The budgets a step may use: 1 (no drafts) .. max_budget, every one up to 8, then about x1.5 apart."""
    ladder = list(range(1, min(max_budget, 8) + 1))
    while ladder[-1] < max_budget:
        ladder.append(min(max_budget, int(ladder[-1] * 1.5)))
    return ladder


class AdaptiveSpeculation(AdaptiveEstimates):
    """Picks the next step's tree budget; fed each finished step (observe) and asked before each ask (choose)."""

    def __init__(self, config: AdaptiveConfig):
        super().__init__(config)
        self.ladder = budget_ladder(config.max_budget)
        self._off_steps = 0  # consecutive steps at budget 1
        self._used: dict[int, int] = {}  # budget -> when it was last chosen (on the _age clock)
        self.switches = 0
        self.probes = 0
        self._probing = 0  # a probe's budget, for its next steps (1: plain decoding's, timed while drafting)
        self._probe_left = 0  # steps of the probe still to come
        self.plain_probes = 0
        self._probe_every, self._probe_bucket = config.probe_interval, -1  # off steps to the next probe; its load
        self._probe_intervals: dict[int, int] = {}  # batch bucket -> its probe interval, kept while another load runs
        self.tries = 0  # single steps at a budget not used lately, to measure it before switching to it
        self.predicted: dict[int, float] = {}  # the last choice's predicted tokens/s per budget
        self._predicted_for: tuple | None = None  # the (speculating, plain, prefill, step) self.predicted is for
        self._last_choice = 0

    def throughput(self, budget: int, speculating: int, plain: int, prefill_tokens: int,
                   optimistic: bool = False) -> float | None:
        """Predicted tokens per second of a step at this budget; None before any forward was timed. optimistic (a
        probe's hope): every draft accepted, and speculation's own costs only as timed min_timings times."""
        verify = self.verify_seconds(speculating * budget + plain + prefill_tokens)
        if verify is None:
            return None
        bucket = batch_bucket(speculating + plain)
        drafted = budget > 1 and speculating > 0
        # plain decoding's cost where this load never ran it: a smaller load's at most (a larger batch's cycle would
        # price it dearer than it is, and a plain step that drafting is predicted to beat is never tried, so never timed)
        whole = 0.0
        if not (drafted or prefill_tokens):  # timed here (a plain probe's steady step at least): its own, else as above
            own = self._whole.get((False, bucket))
            whole = own.value if own is not None else self._nearest(self._whole, bucket, False, below=True)
        if whole:  # plain steps as the overlap schedule runs them: their whole cycle (the forward is in it)
            return (speculating + plain) / whole
        base = self._nearest(self._base, bucket, drafted, below=not drafted)
        own = self._base.get((True, bucket))
        if drafted and (own is None or not self._enough(own)):
            # drafted steps timed too few times at this load: no dearer than the steps without drafts (optimistic,
            # so tried and measured; another load's base, or one odd step, must not keep drafting off here)
            undrafted = self._nearest(self._base, bucket, False)
            whole = 0.0 if undrafted else self._nearest(self._whole, bucket, False)
            if whole:  # only overlapped plain steps known here: their cycle less the forward's predicted time
                undrafted = max(whole - (self.verify_seconds(speculating + plain) or 0.0), 0.0)
            base = min(base, undrafted) if base else undrafted
        seconds = verify + base
        if speculating:
            seconds += self._spec_seconds(budget, batch_bucket(speculating), trusted=optimistic)
        tokens = speculating * self.expected_tokens(budget, optimistic) + plain
        return tokens / seconds if seconds > 0 else None

    def _probe_wait(self, speculating: int, plain: int, predicted: dict[int, float]) -> int:
        """Plain steps a probe at this load must wait for, so that probing takes at most probe_share of the time: its
        measured cost (its first step's whole cycle, the drafter catching up on the off-run, and a steady drafted
        cycle, less the two plain steps they stand for) over probe_share of a plain step. 0 before a probe or a switch
        was timed here."""
        batch = speculating + plain
        first = self._first_drafted.get(batch_bucket(batch))
        if first is None or not predicted.get(1):
            return 0
        plain_cycle = batch / predicted[1]
        bucket = token_bucket(batch)
        drafted = [self._cycles[(n, bucket)].value for n in self.ladder[1:] if (n, bucket) in self._cycles]
        cost = first.value + (min(drafted) if drafted else plain_cycle) - 2 * plain_cycle
        return int(cost / (self.config.probe_share * plain_cycle)) if cost > 0 else 0

    def _plain_untimed(self, batch: int) -> bool:
        """Whether plain decoding's whole cycles were not timed at this load within stale_steps: never (priced then by
        a smaller load's cycle, which may be a cold warm-up's first steps: in process on an H200 the demo EAGLE-3 chain
        priced batch 16's plain steps by three 1.4 ms cycles at batch 2 and drafted a whole point at 0.64x plain, whose
        step took 0.65 ms; 9a05959), or long ago, by what may no longer hold."""
        cycle = self._cycles.get((1, token_bucket(batch)))
        return cycle is None or cycle.last < self._horizon()

    def _timed(self, budget: int, batch: int) -> bool:
        """Whether min_timings whole decode cycles were timed at this budget and load, lately."""
        cycle = self._cycles.get((budget, token_bucket(batch)))
        return cycle is not None and self._enough(cycle) and (
            budget == 1 or cycle.last >= self._horizon())

    def _correct(self, predicted: dict[int, float], speculating: int, plain: int) -> None:
        """Where a budget's whole decode cycle was timed at this load (min_timings steps, fresh), its mean checks the
        sum of the phases' medians (stalls, costs shared by every tree size, host work under the forward), a tree
        at the lower of the two, plain decoding at the higher; trees not timed here are scaled down by how far the
        sum overrated those that were (tokens per step: the acceptance's estimate). So drafting is kept only where
        the phases and the cycles as they ran both say it pays: never slower than plain decoding."""
        batch = speculating + plain
        bucket, ratios, known = token_bucket(batch), [], set()
        for n in self.ladder:
            cycle = self._cycles.get((n, bucket))
            if not self._timed(n, batch):
                if n > 1 and cycle is not None and self._enough(cycle) and predicted[n]:
                    # timed here, longer ago than stale_steps: what a tree cost then still caps it (at today's
                    # acceptance), so that a load met again is not drafted on hope until min_timings fresh cycles say
                    # again what they said (served, the demo EAGLE-3 chain drafted 10-26 steps of ~3 ms against ~0.7 ms
                    # drafting off at every return to batch 16, and each such run broke the batch's lockstep)
                    measured = (speculating * self.expected_tokens(n) + plain) / cycle.value
                    ratios.append(measured / predicted[n])  # and the trees not timed here with it (below)
                    predicted[n] = min(predicted[n], measured)
                    known.add(n)
                continue
            if n == 1:
                predicted[1] = max(predicted[1], batch / cycle.value)
                continue
            measured = (speculating * self.expected_tokens(n) + plain) / cycle.value
            if predicted[n]:
                ratios.append(measured / predicted[n])
            predicted[n] = min(predicted[n], measured)
        scale = sorted(ratios)[len(ratios) // 2] if ratios else 1.0
        if scale < 1.0:
            for n in self.ladder[1:]:
                if not self._timed(n, batch) and n not in known:
                    predicted[n] *= scale

    def _bound(self, predicted: dict[int, float], speculating: int, plain: int) -> None:
        """A drafted step does all a plain step does and more (drafts, a larger forward, the tree walk), so no tree is
        predicted to take less time than plain decoding at this load: its throughput is at most plain's times the
        tokens it is expected to make per step. Where drafts are not accepted (E(N) ~ 1) a tree cannot then win on
        timings' noise alone (a busy CPU's tree steps timed a little faster than its plain ones)."""
        plain_rate = predicted.get(1)
        if not plain_rate:
            return
        batch = speculating + plain
        for n in self.ladder[1:]:
            if predicted[n]:
                predicted[n] = min(predicted[n], plain_rate * (speculating * self.expected_tokens(n) + plain) / batch)

    # choosing ------------------------------------------------------------------------------------
    def choose(self, speculating: int, plain: int = 0, prefill_tokens: int = 0) -> int:
        """The budget of the next trees of `speculating` requests (1: no drafts this step)."""
        before = self._predicted_for
        choice = self._choose(speculating, plain, prefill_tokens)
        if self._trace is not None and speculating:
            # the predictions only where they were made again (a settled choice reuses them: its record stays short,
            # so that tracing a served run does not slow its steps)
            extra = {} if self._predicted_for is before else {
                "predicted": {n: round(v or 0.0, 1) for n, v in self.predicted.items()},
                "acceptance": [round(a, 3) for a in self.acceptance()]}
            self._record("choose", speculating=speculating, plain=plain, prefill=prefill_tokens, choice=choice,
                         budget=self.budget, **extra)
        return choice

    def settled_off(self, speculating: int, plain: int) -> int:
        """How many of the next choices for this batch, decoding alone (no prefill) and observed once between each
        two, _choose's settled drafting-off path is sure to make (1, at a few us each): none once a probe is due or
        the predictions are due again. An overlapped run of plain steps (overlap.py) skips asking for them and hands
        them over with their steps' cycles in one observe_quiet call."""
        cached = self._predicted_for
        if cached is None or cached[:3] != (speculating, plain, 0) or self.budget != 1 or self._last_choice != 1 \
                or self._probing or not self._timed(1, speculating + plain):
            return 0
        # choice j (1, 2, ...) sees _off_steps + j - 1 and an age of j more: _choose's conditions with those
        return max(min(self._probe_every - self._off_steps, self.config.repredict_off_every
                       - (self._steps - cached[3])) - 1, 0)

    def observe_quiet(self, speculating: int, plain: int, skipped: int, cycles: list[float], budget: int = 1) -> None:
        """What `skipped` choices on the settled drafting-off path (see settled_off) and observe() of the overlapped
        plain steps' whole cycles after each would have done, in that order, at once: ~1 us a step, not ~15. A run
        with no speculating request (every request opted out: nothing is chosen for it) is observed at the budget its
        steps reported (the engine's, which none of them used)."""
        if skipped:
            self._off_steps += skipped
            self._used[1] = self._age + skipped - 1  # the last choice's: before the cycle observed after it
        if speculating:
            self._observe_off_cycles(speculating, plain, cycles, skipped)
        else:
            self._observe_opted_out_cycles(plain, cycles, budget)

    def _choose(self, speculating: int, plain: int, prefill_tokens: int) -> int:
        if speculating == 0:
            return self.budget
        key = (speculating, plain, prefill_tokens)
        cached = self._predicted_for
        settled = cached is not None and cached[:3] == key and self._last_choice == self.budget
        age = self._steps - cached[3] if settled else 0
        if settled and self.budget == 1 and not self._probing and self._off_steps + 1 < self._probe_every \
                and age < self.config.repredict_off_every and self._timed(1, speculating + plain):
            # drafting off, settled at this load, no probe due: no tree has run since the predictions were made, so
            # nothing but plain steps' timings moved them. Kept for longer, and the choice costs ~3-4 us of Python instead
            # of a decision's ~10-40 (a reprediction's ~200): a small model's plain step takes ~0.4 ms on a GPU
            self._off_steps += 1
            self._used[1] = self._age
            return 1
        if settled and age < self.config.repredict_every and self._timed(self.budget, speculating + plain):
            # settled on a budget whose cycles were timed at this batch, lately predicted: as then
            predicted = self.predicted
        else:
            predicted = {n: self.throughput(n, speculating, plain, prefill_tokens) for n in self.ladder}
            if any(v is None for v in predicted.values()):  # nothing timed yet: speculate fully and measure
                return self.budget
            if not prefill_tokens:
                self._correct(predicted, speculating, plain)
            self._bound(predicted, speculating, plain)
            self.predicted, self._predicted_for = predicted, (*key, self._steps)
        self._last_choice = self._decide(predicted, speculating, plain, prefill_tokens)
        return self._last_choice

    def _decide(self, predicted: dict[int, float], speculating: int, plain: int, prefill_tokens: int) -> int:
        if self._probing:
            probe, self._probe_left = self._probing, self._probe_left - 1
            if self._probe_left <= 0:
                self._probing = 0
            return probe
        best = max(self.ladder, key=lambda n: (predicted[n], -n))  # ties: the smaller tree
        # the hysteresis keeps the current budget against a slightly better one, but a tree predicted no faster
        # than plain decoding is not kept by it (drafting that gains nothing still costs the drafter's work)
        keep = self.budget in predicted and predicted[self.budget] >= (1 - self.config.hysteresis) * predicted[best] \
            and (self.budget == 1 or predicted[self.budget] > predicted[1])
        choice = self.budget if keep else best
        if choice == 1:
            self._off_steps += 1
            bucket = batch_bucket(speculating + plain)
            if bucket != self._probe_bucket:  # another load: probed at the interval its own probes earned (a load met
                # before keeps its back-off: a benchmark's waves at batch 16 pass through smaller loads at every tail,
                # and each wave was probed at the configured interval again; served, a probe there also breaks the
                # wave's lockstep), a new one at the configured interval
                self._probe_intervals[self._probe_bucket] = self._probe_every
                self._probe_bucket = bucket
                self._probe_every = self._probe_intervals.get(bucket, self.config.probe_interval)
            wait = self._probe_wait(speculating, plain, predicted) if self._off_steps >= self._probe_every else 0
            if wait > self._probe_every:  # a probe here costs more than the interval's share: it waits longer
                self._probe_every = wait
            elif self._off_steps >= self._probe_every:  # refresh the acceptance if it could matter
                self._off_steps = 0
                hopeful = {n: self.throughput(n, speculating, plain, prefill_tokens, optimistic=True)
                           for n in self.ladder[1:]}
                probe = max(hopeful, key=lambda n: hopeful[n]) if hopeful else 1
                if hopeful and hopeful[probe] > predicted[1]:
                    self.probes += 1
                    self._probing, self._probe_left = probe, 1
                    # the next one waits twice as long while drafting stays off at this load (up to 8x)
                    self._probe_every = min(2 * self._probe_every, 8 * self.config.probe_interval)
                    return probe  # two steps (the second one's costs are steady: timed); self.budget stays 1
        else:
            self._off_steps, self._probe_every = 0, self.config.probe_interval
            if self.budget > 1 and self._plain_untimed(speculating + plain) and not prefill_tokens \
                    and self._timed(self.budget, speculating + plain):
                # drafting on and timed at this load, plain decoding never timed here or long ago (a cold warm-up's
                # first steps, another minute of the host): three plain steps time it, drafting stays chosen. Three:
                # under the overlap schedule the first only launches (not observed) and the second is the first observed
                # after a drafted one (not steady): the third is timed (a probe of two timed nothing there, and another
                # followed at once)
                self.plain_probes += 1
                self._probing, self._probe_left = 1, PLAIN_PROBE_STEPS - 1
                return 1
        if choice != self.budget:
            last = self._used.get(choice)
            if last is None or self._age - last > self.config.stale_steps:  # predicted from little or old data:
                self._used[choice] = self._age  # one step to measure it; the next choice switches if it holds
                self.tries += 1
                return choice
            self.switches += 1
            self.budget = choice
        self._used[choice] = self._age
        return choice


def adaptive_policy(spec: SpecConfig) -> AdaptiveSpeculation | None:
    """The load-adaptive policy the config asks for, or None (fixed trees)."""
    if not spec.adaptive:
        return None
    return AdaptiveSpeculation(AdaptiveConfig(spec.num_draft_tokens, spec.num_steps or spec.num_draft_tokens - 1,
                                              spec.topk == 1, spec.adaptive_hysteresis, spec.adaptive_probe_interval))


def verify_tree_sizes(spec: SpecConfig | None) -> tuple[int, ...]:
    """The tree sizes a target verifies (each gets CUDA graphs): the full budget, or with the adaptive policy
    every budget of its ladder (a budget that ran eagerly would cost more than its graph and mislead the policy)."""
    if spec is None:
        return ()
    return tuple(n for n in budget_ladder(spec.num_draft_tokens) if n > 1) if spec.adaptive else (spec.num_draft_tokens,)
