"""What the engine tells and asks the load-adaptive policy (verifier_svc/adaptive.py): each finished step's shape,
observed once its whole cycle is known (the next step's start), and the tree budget of the next asks.

While drafting stays off at a load the policy has settled on (AdaptiveSpeculation.settled_off: no probe due, its
predictions fresh), its next choices are known to be 1; where every request opted out, nothing is chosen at all. An
overlapped run of such steps (overlap.py) neither asks it nor reports to it step by step (~15 us of Python a step,
5-10% of a small model's step on a GPU; with SPLITSPEC_ADAPTIVE_TRACE a line written each step too): the choices
skipped and the cycles timed meanwhile go to it together (observe_quiet) before it is next asked or told anything, and
it ends up knowing exactly what it would have known."""

from __future__ import annotations

from splitspec.verifier_svc.adaptive_estimates import StepShape
from splitspec.verifier_svc.verification import Verify


class QuietRun:
    """A settled drafting-off run's policy calls held back (see the module's doc): choices still to skip, those
    skipped, the whole cycles of the steps since, and the batch's (speculating, plain) they are all for."""

    __slots__ = ("left", "skipped", "cycles", "batch", "budget")

    def __init__(self):
        self.left, self.skipped, self.cycles, self.batch, self.budget = 0, 0, [], (0, 0), 1


class PolicyLink:
    """Engine's side of the load-adaptive policy; the attributes it uses are Engine's (adaptive, spec, scheduler,
    running, report, quiet, _unobserved, _clock)."""

    def _observe_last(self, start: float) -> None:
        """The last step's whole cycle is known now (the caller's handling of its events, streaming and
        detokenizing, is part of its cost too): the adaptive policy observes it."""
        if self._unobserved is None:
            return
        shape, began, seconds = self._unobserved
        self._unobserved = None
        after = max(min(start - began, 2 * seconds) - seconds, 0.0)  # the caller's share, not an idle wait
        if shape is None:  # a quiet step (QuietRun): its whole cycle (its base: verify and spec are 0)
            self.quiet.cycles.append(seconds + after)
            return
        self._flush_quiet()
        shape.base_seconds += after
        self.adaptive.observe(shape)

    def _observe(self, verifies: list[Verify], start: float) -> None:
        """What this step did, for the adaptive policy: fed at the next step's start, when the whole cycle is
        known. Its base is everything but the forward and the speculation phases (schedule, accept, commit,
        the engine's own bookkeeping, and then the caller's). A step the overlap schedule launched while the one
        before it was in flight knows only its whole cycle (its forward ran under the host's work): it is a cycle
        at budget 1 and a base, with no forward timed, so that the policy weighs drafting against plain steps as
        they now run."""
        if self.report.quiet:  # held back with the run's (QuietRun)
            self._unobserved = (None, start, self._clock() - start)
            return
        seconds = self.report.seconds
        speculating = sum(1 for v in verifies if v.request.speculate)
        verify, spec = seconds.get("verify", 0.0), seconds.get("draft", 0.0) + seconds.get("ask", 0.0)
        own = self._clock() - start
        deferred = self.report.deferred
        if deferred:
            verify = spec = 0.0
        self._unobserved = (StepShape(
            budget=self.report.budget, speculating=speculating, plain=len(verifies) - speculating,
            forward_tokens=0 if deferred else self.report.forward_tokens, verify_seconds=verify, spec_seconds=spec,
            base_seconds=max(own - verify - spec, 0.0),
            accepts=list(zip(self.report.tree_depths, [n - 1 for n in self.report.accept_lengths]))), start, own)

    def _choose_budget(self, continuing: bool = False) -> int:
        """The tree budget of the next step's asks: fixed, or the adaptive policy's choice for the batch that
        will decode next (continuing: an overlapped run's, every request decoding)."""
        if self.adaptive is None:
            return self.spec.num_draft_tokens
        if continuing and self._quiet_choice():  # a settled drafting-off run (QuietRun)
            return 1
        self.quiet.left = 0  # a choice made: the run's settled ones, if any, are granted anew by _settle
        self._flush_quiet()
        limit = self.scheduler.chunked_prefill_size  # a prefill that fits the next chunk decodes next step too
        decoding = self.running if continuing else [
            r for r in self.running if r.decoding or limit <= 0 or r.fill_len - r.num_prefilled <= limit]
        speculating = sum(1 for r in decoding if r.speculate)
        choice = self.adaptive.choose(speculating, len(decoding) - speculating, self.report.prefill_tokens)
        if continuing and choice == 1:
            self._settle(speculating, len(decoding) - speculating)
        return choice

    def _quiet_choice(self) -> bool:
        """A continuing run's next budget without asking the policy: True (the budget is 1) while its settled choices
        last; the step's cycle is then held back too (report.quiet)."""
        quiet = self.quiet
        if not quiet.left:
            return False
        quiet.left -= 1
        quiet.skipped += 1
        self.report.quiet = True
        return True

    def _settle(self, speculating: int, plain: int) -> None:
        """After the policy chose drafting off for a continuing run: how many of its next choices it is sure of."""
        self.quiet.left, self.quiet.batch = self.adaptive.settled_off(speculating, plain), (speculating, plain)
        self.quiet.budget = 1

    def _flush_quiet(self) -> None:
        """The skipped choices and held-back cycles to the policy, before it is asked or told anything else."""
        quiet = self.quiet
        if quiet.skipped or quiet.cycles:
            self.adaptive.observe_quiet(*quiet.batch, quiet.skipped, quiet.cycles, quiet.budget)
            quiet.skipped, quiet.cycles = 0, []

    def _quiet_opted_out(self, plain: int) -> None:
        """An overlapped run's step whose requests all opted out: nothing is chosen for them, and its cycle is held back
        with the run's (report.quiet), handed over at once as a settled drafting-off run's are (observe_quiet)."""
        if self.adaptive is None:
            return
        quiet, budget = self.quiet, self.report.budget
        if (quiet.batch, quiet.budget) != ((0, plain), budget):
            self._flush_quiet()  # another run's held-back calls, if any, told first
        quiet.batch, quiet.budget, quiet.left = (0, plain), budget, 0  # no settled choice carries over to another run
        self.report.quiet = True
