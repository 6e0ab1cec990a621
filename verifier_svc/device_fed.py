"""The device-fed drafted step: the next verification launched before this one's acceptance reaches the host.

A drafted step waits for its acceptance before the next one can be built: the next chains' positions, KV slots and
key counts depend on how many drafts were accepted, and the host learns that only by waiting for the device. For top-1
chains caught up ahead (catch_up_ahead.py: a head in this process, its catch-up and the next draft queued on the
device right behind the verification, each chain's acceptance counted there), everything the next verification needs
is on the device already: its roots (the target's token at each accepted row), its drafts (the loop launched with the
catch-up) and its lengths (kernels.chain_acceptance). So step N+1 is launched from them, built at each request's upper
length (every draft accepted) and moved back on the device (runtime.batch_shift), its catch-up and the draft after it
likewise; then step N lands: its chains are walked, its tokens emitted and the head told what was kept, one step
late, as the overlap schedule lands plain steps. The host's work for N runs while the device verifies N+1.

    step N     verify N, catch-up N, draft N+1 queued (the step returns nothing: it is in flight)
    step N+1   verify N+1 from N's device results, catch-up N+1, draft N+2 queued; then N lands (its events)
    ...        until the batch changes (an arrival to admit, an abort, a request that ended, a page short, a drafter
               that declined): the step in flight lands and the next step runs as usual

A request that ended at step N (its EOS, a stop, its limit) still verified its chain at N+1: that row is dropped when
N+1 lands. Outputs are unchanged: every verification is the one the unfed step would run, at the same positions.

For greedy requests (their target tokens are argmaxes: no output position to know), without logprobs, penalties or
grammars, under fixed trees (`--speculative-adaptive off`: the policy's choices and timings are per landed step; not
yet), with the overlap schedule on. SPLITSPEC_DEVICE_FED=1 turns it on. Off by default: on an H100 it was lossless and
slower than the unfed step (the launch ahead costs more host time than a whole unfed cycle: docs/performance.md).
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass

from splitspec.runtime.batch_shift import batch_at
from splitspec.runtime.launched_draft import PendingChain
from splitspec.verifier_svc.catch_up_ahead import CatchUpAhead
from splitspec.verifier_svc.drafter_client import DraftAsk
from splitspec.verifier_svc.step_types import StepEvent
from splitspec.verifier_svc.verification import ARGMAX, Verify, target_params

ENV = "SPLITSPEC_DEVICE_FED"


@dataclass
class FedFlight:
    """A launched drafted step whose acceptance has not landed: its verifies (every tree a PendingChain, seq_len the
    upper length it was built at until it lands), each sequence's first logits row and first row, its catch-up, and
    its forward's states (read at landing only where the head declined the catch-up: a copy then)."""

    verifies: list[Verify]
    cu_logits: list[int]
    rows: list[int]
    ahead: CatchUpAhead
    features: object = None

    @classmethod
    def of(cls, verifies: list[Verify], batch, ahead: CatchUpAhead, features=None) -> "FedFlight":
        rows = list(itertools.accumulate(batch.attention.q_lens, initial=0))
        return cls(verifies, batch.cu_logits, rows, ahead, features)


class DeviceFedSteps:
    """Engine's device-fed drafted steps; the attributes it uses are Engine's (runner, drafter, spec, running, waiting,
    scheduler, adaptive, report, fed, device_fed, _forward, _sequences, _accept_trees, _retire, _request_drafts,
    _close, _timed)."""

    @staticmethod
    def fed_enabled() -> bool:
        return os.environ.get(ENV, "0") == "1"

    def _feeds(self, ahead: CatchUpAhead, verifies: list[Verify]) -> bool:
        """This step may stay in flight: its every chain caught up ahead, its requests' tokens argmaxes nobody reads
        before they land (no logprobs), fixed trees."""
        return (self.device_fed and self.adaptive is None and ahead.roots is not None
                and len(ahead.caught_up) == len(verifies)
                and all(target_params(self.spec, v.request.params) is ARGMAX and v.request.params.logprobs is None
                        and isinstance(v.tree, PendingChain) for v in verifies))

    def _step_fed(self, start: float) -> list[StepEvent]:
        """The step after a fed one: its successor launched (when the batch is unchanged), then it lands."""
        flight, self.fed = self.fed, None
        began = time.perf_counter()
        self.fed = self._launch_fed(flight)
        self.report.seconds["verify"] = time.perf_counter() - began
        began = time.perf_counter()
        events = self._land_fed(flight, keep_pages=self.fed is not None)
        self._retire()
        self.report.seconds["accept"] = time.perf_counter() - began
        if self.fed is None:  # the run ends here: the next drafts asked as a landed step asks them
            self._timed("ask", self._request_drafts)
        else:
            self.report.deferred = True
        return self._close(events, [], flight.verifies, start, observe=False)

    def _launch_fed(self, flight: FedFlight) -> FedFlight | None:
        """Step N+1 of the same batch from step N's device results, or None where the batch changed."""
        requests = [v.request for v in flight.verifies]
        limit = self.scheduler.max_running_requests
        if (self.waiting and not 0 < limit <= len(self.running)) or len(self.running) != len(requests) \
                or any(r is not q or r.finish_reason is not None for r, q in zip(self.running, requests)):
            return None
        request_ids = [r.request_id for r in requests]
        if not self.drafter.launched_ahead(request_ids):
            return None
        n = flight.ahead.nodes
        kv = self.runner.kv_cache
        upper = [r.table.num_tokens + n for r in requests]  # every draft of step N accepted
        if max(upper) + n > self.runner.context_length:  # near the context's end: what the graphs are sized for
            return None
        missing = sum(max(kv.pages_for(u + n) - len(r.table.pages), 0) for r, u in zip(requests, upper))
        if missing > kv.allocator.num_free:
            return None
        self.drafter.request([DraftAsk(r, [], n) for r in request_ids])  # takes the draft launched with N's catch-up
        trees = self.drafter.collect(request_ids)
        chains = [trees.get(r) for r in request_ids]
        if any(not isinstance(c, PendingChain) or c.num_nodes != n for c in chains):
            raise RuntimeError(f"a draft launched ahead for chains of {n} nodes came back as {chains!r}")
        verifies = [Verify(r, c, u) for r, c, u in zip(requests, chains, upper)]
        for r, u in zip(requests, upper):
            kv.reserve(r.table, u + n)
        # built at the upper lengths, its pages reserved that far (padded only where they hold the padding)
        sequences, places = self._sequences([], verifies)
        lengths = flight.ahead.lengths_after
        batch = batch_at(self.runner, sequences, upper, lengths)
        ahead = CatchUpAhead(verifies, n, upper=upper, verified=lengths)
        _, _, features = self._forward(batch, roots=flight.ahead.roots, sync=False, chains=places, ahead=ahead)
        return FedFlight.of(verifies, batch, ahead, features)

    def _land_fed(self, flight: FedFlight, keep_pages: bool) -> list[StepEvent]:
        """Step N's chains walked from its target tokens and its tokens emitted; the head keeps its accepted rows;
        the rows of requests that ended since its launch dropped."""
        targets = flight.ahead.targets()
        vocab = self.runner.config.vocab_size
        kept = [i for i, v in enumerate(flight.verifies) if v.request.finish_reason is None]
        verifies = []
        for i in kept:
            v = flight.verifies[i]
            v.seq_len = v.request.table.num_tokens  # its length once the step before landed
            if isinstance(v.tree, PendingChain):
                v.tree = v.tree.resolve(v.request.output_ids[-1], vocab)
            verifies.append(v)
        cu_logits = [flight.cu_logits[i] for i in kept]
        rows = [flight.rows[i] for i in kept]
        # (a caught-up step's head is told what it kept, even with every request ended: that catch-up is spent)
        return self._accept_trees(verifies, 0, cu_logits, None, targets, rows, flight.features, flight.ahead.caught_up,
                                  keep_pages=keep_pages)
