"""Overlap's bets (a mixin of DrafterPool, under its lock): while a tree is verified, its drafter drafts the
trees it would propose next for the likely outcomes; when the outcome comes true, the matching bet is the
next tree at once (no round trip), a miss or a late bet costs a fresh ask, and bets never change an output."""

from __future__ import annotations

import math
import time

from splitspec.runtime.tree import DraftTree
from splitspec.verifier_svc import convert
from splitspec.verifier_svc.drafter_client import DraftAsk
from splitspec.verifier_svc.drafter_membership import Drafter


class OverlapBets:
    """Bets asked, waited for, matched and filed; the state is DrafterPool's (its __init__)."""

    def _match_bet(self, drafter: Drafter, ask: DraftAsk) -> int:
        """Overlap (under self._cond): wait for the bets on the request's last tree (drafted while it was
        verified), and file the one whose outcome came true as its next tree; its index + 1, or 0."""
        request_id = ask.request_id
        step_id = self._bet_step.get(request_id)
        if step_id is None:
            return 0
        step = self._pending.get(step_id)
        deadline = (step.sent_at if step is not None else time.monotonic()) + (0 if drafter.unresponsive else self.timeout)
        self._wait_while(lambda: request_id in self._bet_waits.get(step_id, (None, {}, ()))[1], deadline)
        self._bet_step.pop(request_id, None)
        bets = self._bets.pop(request_id, None)
        if bets is None:  # late (or its drafter died): draft afresh; bets that come later are dropped
            self._bet_waits.get(step_id, (None, {}, ()))[1].pop(request_id, None)
            self._tally("bets_late")
            self._count_bet(drafter, "late")
            return 0
        outcome = tuple(ask.new_tokens)
        for index, (bet_outcome, tree) in enumerate(bets):
            if bet_outcome == outcome:
                self._results[request_id] = tree.first(ask.max_nodes)
                self._tally("bet_hits")
                self._count_bet(drafter, "hit")
                return index + 1
        self._tally("bet_misses")
        self._count_bet(drafter, "miss")
        return 0

    def _forget_bets(self, request_id: str) -> None:
        step_id = self._bet_step.pop(request_id, None)
        self._bets.pop(request_id, None)
        if step_id is not None:
            self._bet_waits.get(step_id, (None, {}, ()))[1].pop(request_id, None)

    def _count_bet(self, drafter: Drafter, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.bets.labels(drafter=drafter.name, outcome=outcome).inc()

    def _file_bets(self, drafter: Drafter, message) -> None:
        """A step's bets (overlap): checked like trees, filed for the requests still waiting for them."""
        due = self._bet_waits.get(message.step_id)
        if due is None or due[0] is not drafter:
            self._drop(drafter.name, "late" if message.step_id in self._expired or due is None else "stale",
                       f"bets for step {message.step_id}")
            return
        del self._bet_waits[message.step_id]
        self._time_transport("bets", None, message)
        if math.isfinite(message.draft_seconds) and message.draft_seconds >= 0:  # the drafter's clock
            self._tally("bet_steps")
            self.stats.extra["bet_seconds"] = self.stats.extra.get("bet_seconds", 0.0) + message.draft_seconds
        budgets = due[1]
        filed: dict[str, list] = {r: [] for r in budgets if self._bet_step.get(r) == message.step_id}
        for wire in message.bets:
            request_id = wire.request_id
            if request_id not in budgets:
                if request_id in due[2]:  # asked, and since finished, re-pinned or given up on (a late bet, counted then)
                    continue
                self._drop(drafter.name, "wrong_request", f"step {message.step_id} did not ask bets for {request_id!r}")
                continue
            outcome = list(wire.outcome)
            # a bet is the next step's tree, whose budget is not known yet (an adaptive budget moves between
            # steps): bounded here by what the drafter registered, cut to that step's budget when it comes true
            problem = convert.tree_problem(wire.tree, max(budgets[request_id], drafter.max_nodes), self.vocab_size)
            if problem is None and (not outcome or len(outcome) > budgets[request_id]
                                    or any(not 0 <= t < self.vocab_size for t in outcome)):
                problem = f"an outcome of {len(outcome)} tokens"
            if problem is None and wire.tree.tokens[0] != outcome[-1]:
                problem = "the bet tree's root is not its outcome's last token"
            if problem is not None:
                self._drop(drafter.name, "invalid_tree", f"bet for {request_id}: {problem}")
                continue
            if request_id in filed:
                filed[request_id].append((tuple(outcome), DraftTree(tuple(wire.tree.tokens), tuple(wire.tree.parents))))
        self._bets.update(filed)
        self._cond.notify_all()
