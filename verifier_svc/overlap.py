"""The overlap schedule for plain decoding (SGLang's overlap scheduler, vLLM's async scheduling): a step whose
requests all decode without a tree is launched before the last step's tokens have reached the host.

A plain decoding step accepts exactly one token per request, so everything the next step needs is known when
it is queued except the tokens themselves: each request's KV grows by one slot (committed at launch), its next
position is the next one, and its next root is the token this step samples, which stays on the device and is
copied into the next batch's input ids there. So the engine queues step N+1 before it reads step N's tokens;
while the device runs N+1 the host turns N's tokens into events (stop conditions, streams, metrics) and
schedules N+2. The serial host work between two forwards is only the launch.

    step N    launch: forward, sample on the device, copy the tokens (and the logprobs asked for) to the host
              (not waited for)
    step N+1  launch N+1 from N's device tokens, then land N: wait for its copy, emit its tokens
    ...       until the batch changes (an arrival to admit, an abort, a request that speculates, penalties,
              a grammar, no page for one more slot): N lands first and the step runs as usual

Requests that speculate decode this way too while drafting is off for the whole batch (a tree budget below 2: the
load-adaptive policy's choice under load): their tokens are fed to the drafter as they land (a hidden-state drafter's,
EAGLE's and MTP's, with the target's states of the step that sampled them: its forward's own rows, one per request,
kept on the device until a feed sends them), the policy chooses each next budget as it would, and a budget of 2 or
more lands the step in flight before any tree is asked (a tree must grow from the last token).

While drafting stays off at a load the policy has settled on, or every request opted out, the run's steps neither ask
it nor report to it one by one (policy_link.QuietRun).

A request that stopped at step N (its EOS, a stop token) still computed step N+1's row: that row is dropped when
N+1 lands (what SGLang's and vLLM's overlap do too). Its slot N+1 holds the KV of its last token, so the prefix
cache may keep it. Outputs are unchanged: the sampled token of every row is the one the unoverlapped step would
sample (the same keyed sampling at the same output position).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from splitspec.runtime.batch import SequenceInput, device_tensor
from splitspec.runtime.host_tensors import copy_to_host
from splitspec.runtime.sampling import sample
from splitspec.verifier_svc.step_types import Request, StepEvent
from splitspec.verifier_svc.verification import Verify, by_target, logprob_table, read_logprobs, target_params


@dataclass
class InFlight:
    """A launched plain step whose tokens the host has not read: its requests in row order, the tokens on the
    device (the next step's roots), their host copy, the event after which that copy is complete, and the
    forward's states for a hidden-state drafter (row i: request i's, which pairs with the token it sampled)."""

    verifies: list[Verify]
    tokens: torch.Tensor
    host: torch.Tensor
    copied: torch.cuda.Event | None
    features: torch.Tensor | None = None
    # the requests that asked for logprobs: (their rows, the k asked of the table, the table's host copy, its event)
    logprobs: tuple[list[int], int, torch.Tensor, torch.cuda.Event | None] | None = None

    def land(self) -> list[int]:
        if self.copied is not None:
            self.copied.synchronize()
        return self.host.tolist()

    def landed_logprobs(self) -> dict[int, list]:
        """Row -> its token's TokenLogprob list, for the rows that asked (after land())."""
        if self.logprobs is None:
            return {}
        rows, k, host, copied = self.logprobs
        if copied is not None:
            copied.synchronize()
        sizes = [(1, self.verifies[row].request.params.logprobs) for row in rows]
        return dict(zip(rows, read_logprobs(host.tolist(), sizes, k)))


def deferrable(spec, request: Request, drafting_off: bool) -> bool:
    """A request whose next token is the target's own sample of its unmodified logits, and nothing more of it is
    read but its logprobs (computed at the launch, copied with the tokens): no tree (it does not speculate, or drafting
    is off for the whole batch), no penalties or grammar."""
    params = request.params
    return ((not request.speculate or (drafting_off and request.draft_budget < 2)) and by_target(spec, params)
            and request.matcher is None and not request.wants_prompt_logprobs)


class OverlapSchedule:
    """Engine's overlapped plain decoding; the attributes it uses are Engine's (runner, spec, running, waiting,
    scheduler, eos_ids, report, overlap_schedule, in_flight, budget, needs_hidden, run_states, unsent_max, _events,
    _forward, _retire, _request_drafts, _quiet_opted_out)."""

    @property
    def _drafting_off(self) -> bool:
        """No request drafts this step (the tree budget is below 2: the load-adaptive policy turned drafting off, or
        a budget of 1): speculating requests decode plainly and may overlap (their tokens, and a hidden-state
        drafter's states, are fed to the drafter as they land)."""
        return self.budget < 2

    def _defers(self, prefills, verifies: list[Verify], masks) -> bool:
        """This step may launch without landing: a decode-only step of roots whose tokens nobody but the stream reads."""
        off = self._drafting_off
        return (self.overlap_schedule and not prefills and bool(verifies) and masks is None and not self._events
                and all(v.tree.num_nodes == 1 and deferrable(self.spec, v.request, off) for v in verifies))

    def _launch(self, verifies: list[Verify], logits: torch.Tensor, pending: int, features: torch.Tensor | None) -> InFlight:
        """Sample every row (row i is verifies[i]'s root) on the device at its output position (pending: tokens the
        requests have sampled and not yet emitted), start the copy to the host, and commit each root's KV slot.
        features: the forward's states (a hidden-state drafter's; None for others)."""
        params = [target_params(self.spec, v.request.params) for v in verifies]
        tokens = sample(logits, params, [len(v.request.output_ids) + pending for v in verifies])
        host, copied = copy_to_host(tokens)
        logprobs = None
        rows = [i for i, v in enumerate(verifies) if v.request.params.logprobs is not None]
        if rows:  # their table queued behind the tokens, copied without waiting (verification.logprob_table)
            k = min(max(verifies[i].request.params.logprobs for i in rows), logits.shape[-1])
            asking, their_tokens = logits, tokens
            if len(rows) < len(verifies):  # the asking rows' logits and tokens, one index for both
                index = device_tensor(rows, logits.device)
                asking, their_tokens = logits.index_select(0, index), tokens.index_select(0, index)
            logprobs = (rows, k, *copy_to_host(logprob_table(asking, None, their_tokens, k)))
        kv = self.runner.kv_cache
        for v in verifies:
            kv.set_length(v.request.table, v.seq_len + 1)
        self.report.deferred = True
        return InFlight(verifies, tokens, host, copied, features, logprobs)

    def _continues(self, flight: InFlight) -> bool:
        """The next step is the same batch decoding again: nothing to admit, nobody aborted, drafting still off for
        speculating requests, a page for one more slot each (no preemption: that needs the tokens)."""
        if not self._drafting_off and any(v.request.speculate for v in flight.verifies):
            return False
        limit = self.scheduler.max_running_requests
        if self.waiting and not 0 < limit <= len(self.running):
            return False
        if len(self.running) != len(flight.verifies) or any(
                r is not v.request for r, v in zip(self.running, flight.verifies)):
            return False
        kv = self.runner.kv_cache
        needed = sum(kv.pages_for(r.table.num_tokens + 1) - len(r.table.pages) for r in self.running)
        if needed > kv.allocator.num_free:
            return False
        for request in self.running:
            kv.reserve(request.table, request.table.num_tokens + 1)
        return True

    def _relaunch(self, flight: InFlight) -> InFlight:
        """Step N+1 of the same batch, its roots the device tokens of step N (not landed)."""
        verifies = [Verify(v.request, v.tree, v.request.table.num_tokens) for v in flight.verifies]
        sequences = [SequenceInput(v.request.table, [0], [v.seq_len], None, "all") for v in verifies]
        _, logits, features = self._forward(sequences, roots=flight.tokens, sync=False)
        return self._launch(verifies, logits, pending=1, features=features)

    def _land(self, flight: InFlight) -> list[StepEvent]:
        """Step N's tokens emitted (a hidden-state drafter's states of step N kept for the run: draft_features.RunStates,
        handed to the requests when the run ends or feeds); the rows of requests that ended since its launch (a stop in
        the step before, an abort) dropped."""
        eos_ids = self.eos_ids
        requests = [v.request for v in flight.verifies]
        if flight.features is not None and any(r.speculate for r in requests):
            self.run_states.add(flight.features, requests)
        tokens, logprobs = flight.land(), flight.landed_logprobs()
        return [r.emit([token], eos_ids, None, logprobs.get(i)) for i, (r, token) in enumerate(zip(requests, tokens))
                if r.finish_reason is None]

    def _step_in_flight(self) -> tuple[list[StepEvent], bool]:
        """(events of the step in flight, whether the next one was launched before they landed). Phases: schedule
        (the check and the pages), verify (the launch), accept (the landing: the wait for the copy, the events)."""
        flight, self.in_flight = self.in_flight, None
        began = time.perf_counter()
        continues = self._continues(flight)
        self.report.seconds["schedule"] = time.perf_counter() - began
        if continues:
            self.in_flight = self._relaunch(flight)
        began = time.perf_counter()
        events = self._land(flight)
        if not continues:  # the run ends: its states go to its requests before a step adds any of their own
            self.run_states.flush()
            self.unsent_max = None
        self._retire()
        self.report.seconds["accept"] = time.perf_counter() - began
        if continues and any(v.request.speculate for v in flight.verifies):  # the next budget; the landed tokens fed
            began = time.perf_counter()
            self._request_drafts(trees=False, continuing=True)
            self.report.seconds["ask"] = time.perf_counter() - began
        elif continues:  # every request opted out: the policy told of the run's steps together (policy_link)
            self._quiet_opted_out(len(flight.verifies))
        return events, continues
