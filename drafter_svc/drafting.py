"""A drafter process's drafting (a mixin of DrafterServer, over its state): a request opened with its tokens
(and hidden states), each DraftRequest's new tokens taken, the trees of the requests it asks for drafted in
one batch, and overlap's bets on the outcomes of the trees being verified."""

from __future__ import annotations

import logging
import time

from splitspec.drafter_svc import convert
from splitspec.runtime.grammar_guide import draft_to_grammar
from splitspec.runtime.tensor_plane import TensorError

logger = logging.getLogger("splitspec.drafter")


class Drafting:
    """Opening, drafting and betting; the state is DrafterServer's (its __init__)."""

    def _hidden(self, message, frames) -> dict[str, object] | None:
        """Request id -> its hidden-state rows from the message's frames; None (logged) when unreadable."""
        try:
            infos = convert.tensor_infos(message)
            if any(i.buffer_offset >= 0 for i in infos) and self.ipc is None:
                raise TensorError("tensors in a CUDA-IPC buffer this drafter has not mapped")
            if self.ipc is None:
                return {rid: t for name, rid, t in self.plane.unpack(infos, list(frames)) if name == "hidden_states"}
            try:
                tensors = self.ipc.unpack(infos, list(frames))
            except TensorError:
                raise
            except Exception as exc:  # noqa: BLE001 (a failed copy out of the buffer): frames from now on
                logger.exception("reading the CUDA-IPC buffer failed; asking for frames from now on")
                self.ipc = None
                self._heartbeat()
                raise TensorError(f"the CUDA-IPC buffer could not be read ({exc})") from exc
            return {rid: t for name, rid, t in tensors
                    if name == "hidden_states"}
        except TensorError as exc:
            self._drop(f"{message.WhichOneof('kind')}: {exc}", "tensors")
            return None

    def _open(self, message, frames) -> None:
        request_id, tokens = message.open.request_id, list(message.open.token_ids)
        if request_id in self.requests:
            self.drafter.release(request_id)
            self.requests.discard(request_id)
        grammar = (message.open.grammar_kind, message.open.grammar) if message.open.grammar_kind else None
        self.grammars.open(request_id, tokens, grammar, message.open.prompt_tokens)
        if not self.drafter.needs_hidden_states:
            self.drafter.open(request_id, tokens)
            self.requests.add(request_id)
            return
        hidden = self._hidden(message, frames)
        if hidden is None or not tokens or (len(tokens) > 1 and (request_id not in hidden or len(hidden[request_id]) != len(tokens) - 1)):
            self._drop(f"open {request_id}: {len(tokens)} tokens need {len(tokens) - 1} hidden states", "tensors")
            return  # its asks come back as unknown and the verifier opens it again
        self.drafter.open(request_id, tokens[:1])
        if len(tokens) > 1:
            self.drafter.extend(request_id, tokens[1:], hidden[request_id].to(self.device))
        self.requests.add(request_id)

    def _draft(self, message, frames, superseded: set[str] = frozenset()) -> None:
        """Extend every ask's request by its new tokens; draft trees for the asks whose bet did not come
        true and reply; then, when the verifier asked for bets (overlap), draft them for every asked
        request while it verifies, and send them. Superseded asks (a newer one for the request is waiting)
        only extend: no tree, no bets; the reply still goes, so the verifier files the step."""
        start = time.perf_counter()
        step_id = message.draft.step_id
        asks = [a for a in message.draft.asks if a.request_id in self.requests]
        unknown = [a.request_id for a in message.draft.asks if a.request_id not in self.requests]
        hidden = self._hidden(message, frames) if self.drafter.needs_hidden_states else {}
        if hidden is None:  # unreadable states: these requests' histories cannot grow; reopen them
            unknown += [a.request_id for a in asks]
            for ask in asks:
                self._forget(ask.request_id)
            asks = []
        kept = []
        for ask in asks:
            try:
                if ask.bet_taken:  # the verifier verifies that bet now: the next bets follow it
                    self.drafter.take_bet(ask.request_id, ask.bet_taken - 1)
                if ask.new_token_ids and self.drafter.needs_hidden_states:
                    rows = hidden.get(ask.request_id)
                    if rows is None or rows.shape[0] != len(ask.new_token_ids):
                        raise ValueError(f"{len(ask.new_token_ids)} new tokens and {None if rows is None else rows.shape[0]} "
                                         "hidden states")
                    self.drafter.extend(ask.request_id, list(ask.new_token_ids), rows.to(self.device))
                elif ask.new_token_ids:
                    self.drafter.extend(ask.request_id, list(ask.new_token_ids))
                self.grammars.extend(ask.request_id, list(ask.new_token_ids))
            except (ValueError, KeyError, IndexError) as exc:  # its state cannot follow: the verifier opens it again
                self._drop(f"draft {step_id}: {ask.request_id}: {exc}; reopening it", "request_state")
                self._forget(ask.request_id)
                unknown.append(ask.request_id)
                continue
            kept.append(ask)
        current = [a for a in kept if a.request_id not in superseded]
        fresh = [a for a in current if not a.bet_taken]
        budgets = [min(a.max_nodes, self.max_nodes) for a in fresh]
        trees = self._draft_trees(fresh, budgets, unknown)
        self.steps += 1
        pairs = [(a.request_id, t) for a, t in zip(fresh, trees) if t is not None]
        seconds = time.perf_counter() - start
        self._send(draft_reply=convert.draft_reply(step_id, pairs, seconds, unknown, self.received_ns,
                                                   self.ipc.consumed if self.ipc is not None else 0))
        if self.metrics is not None:
            self._observe_step(len(fresh), pairs, seconds)
        betting = [a for a in current if a.num_bets and a.request_id in self.requests]
        if any(a.num_bets for a in message.draft.asks if a.request_id not in superseded):
            self._bets(step_id, betting)
        try:
            self.drafter.idle()  # replied (and bet): what it deferred runs while the verifier verifies
        except Exception:  # noqa: BLE001 (its cache may lag; drafts are verified, outputs cannot change)
            logger.exception("the drafter's idle work failed after step %d", step_id)

    def _draft_trees(self, asks, budgets: list[int], unknown: list[str]) -> list:
        """The asks' trees; a constrained request's only what its grammar allows (grammars.py)."""
        try:
            return self._draft_guided([a.request_id for a in asks], budgets) if asks else []
        except Exception:  # find the request(s) it fails on; the others still get their trees
            logger.exception("drafting a batch of %d failed; drafting them one by one", len(asks))
            trees = []
            for ask, budget in zip(asks, budgets):
                try:
                    trees.append(self._draft_guided([ask.request_id], [budget])[0])
                except Exception:  # its state may be broken: drop it, the verifier opens it again
                    logger.exception("drafting %s failed; dropping it", ask.request_id)
                    self._forget(ask.request_id)
                    unknown.append(ask.request_id)
                    trees.append(None)
            return trees

    def _draft_guided(self, request_ids: list[str], budgets: list[int]) -> list:
        guides = [self.grammars.guide(r) for r in request_ids]
        trees, cut = draft_to_grammar(self.drafter, request_ids, budgets, guides)
        if self.metrics is not None and self.grammars.tracked:  # counted only while some request is constrained
            guided = sum(g is not None for g in guides)
            unguided = sum(g is None and self.grammars.constrained(r) for r, g in zip(request_ids, guides))
            self.metrics.constrained_trees.labels(guided="yes").inc(guided)
            self.metrics.constrained_trees.labels(guided="no").inc(unguided)
            self.metrics.grammar_cut.inc(cut)
        return trees

    def _bets(self, step_id: int, asks) -> None:
        """Overlap: bets on the outcomes of the trees the verifier is verifying now (always answered, empty
        when this drafter has none, so that the verifier never waits for them in vain)."""
        start = time.perf_counter()
        bets = []
        asks = [a for a in asks if not self.grammars.guided(a.request_id)]  # bets are not drafted to a grammar
        if asks and self.drafter.supports_bets:
            try:
                drafted = self.drafter.draft_bets([a.request_id for a in asks], max(a.num_bets for a in asks))
                bets = [(a.request_id, bet) for a, request_bets in zip(asks, drafted) for bet in request_bets[: a.num_bets]]
            except Exception:  # bets are optional: the verifier drafts afresh
                logger.exception("drafting bets for step %d failed; sending none", step_id)
        self.bet_steps += bool(bets)
        self._send(draft_bets=convert.draft_bets(step_id, bets, time.perf_counter() - start, self.received_ns))
        if self.metrics is not None:
            self.metrics.bets.inc(len(bets))

    def _forget(self, request_id: str) -> None:
        self.grammars.release(request_id)
        if request_id in self.requests:
            self.drafter.release(request_id)
            self.requests.discard(request_id)

    def _observe_step(self, batch: int, pairs, seconds: float) -> None:
        metrics = self.metrics
        metrics.steps.inc()
        metrics.batch.observe(batch)
        metrics.compute.observe(seconds)
        metrics.trees.inc(len(pairs))
        metrics.proposed.inc(sum(len(tree.tokens) - 1 for _, tree in pairs))
        cache = getattr(getattr(self.drafter, "runner", None), "kv_cache", None)
        if cache is not None:
            metrics.kv_usage.set(cache.allocator.num_used / cache.allocator.num_pages)
