"""A step's deltas as columns (verifier_svc/step_columns.py): what the front reads back is, delta for delta, what the
engine thread built whole before (convert.fill_delta with the submission's due tokens and counts), over random runs of
requests that start, decode plainly or speculating, hold tokens (--stream-interval), get preempted, ask for logprobs,
fail and finish; and the columns cross a serialisation as the engine's message does."""

from __future__ import annotations

import copy
import random

import pytest

from splitspec.protos import engine_link_pb2 as link
from splitspec.protos import verifier_pb2 as pb
from splitspec.runtime.sampling_params import SamplingParams
from splitspec.verifier_svc import convert, step_columns
from splitspec.verifier_svc.step_types import Request, StepEvent, TokenLogprob
from splitspec.verifier_svc.worker import Submission


def counts_due(submission: Submission, event: StepEvent) -> bool:
    """The old builder's rule (worker.Submission.counts_due until 2026-12-06): counts on a request's first and last
    delta, and whenever they moved since the last delta that carried them."""
    stats = submission.request.stats if submission.request is not None else None
    mark = None if stats is None else (stats.verify_steps, stats.fallbacks)
    if submission.first or event.finish_reason is not None or mark != submission.counts_sent:
        submission.counts_sent = mark
        return True
    return False


def whole(deliveries) -> list[pb.TokenDelta]:
    """The engine thread's deltas as built before the columns: a TokenDelta per due delivery."""
    out = []
    for submission, event in deliveries:
        due = submission.due(event)
        if due is None:
            continue
        delta = pb.TokenDelta()
        convert.fill_delta(delta, submission.client_id, submission.request, due[0], event.finish_reason,
                           submission.first, event.error, due[1], event.prompt_logprobs, counts_due(submission, event))
        submission.first = False
        out.append(delta)
    return out


def logprobs(rng: random.Random, n: int) -> list[TokenLogprob]:
    return [TokenLogprob(-rng.random(), tuple((rng.randrange(100), -rng.random()) for _ in range(2))) for _ in range(n)]


class Live:
    """One request as the engine runs it: its Request, and a submission for each side (the two publishers each
    change their own)."""

    def __init__(self, rng: random.Random, number: int):
        self.rng = rng
        self.wants_logprobs = rng.random() < 0.2
        params = SamplingParams(max_new_tokens=64, seed=rng.randrange(1 << 30), logprobs=2 if self.wants_logprobs else None)
        self.request = Request(f"r{number}", list(range(rng.randrange(1, 40))), params, speculate=rng.random() < 0.7)
        self.request.cached_tokens = rng.randrange(len(self.request.prompt_ids) + 1)
        interval = rng.choice([1, 1, 1, 3])
        self.sides = [Submission(f"cmpl-{number}-é", self.request.prompt_ids, params, self.request.speculate,
                                 request=self.request, interval=interval) for _ in range(2)]
        self.steps = 0

    def event(self) -> StepEvent:
        """This step's event, the request's counts moved as a step would move them."""
        rng, request = self.rng, self.request
        self.steps += 1
        if rng.random() < 0.05:
            request.num_preemptions += 1
        accepted = 0
        if request.speculate and rng.random() < 0.7:
            drafted = rng.randrange(1, 6)
            accepted = rng.randrange(drafted + 1)
            request.stats.verify_steps += 1
            request.stats.draft_tokens += drafted
            request.stats.accepted_tokens += accepted
            while len(request.stats.accepted_per_position) < accepted:
                request.stats.accepted_per_position.append(0)
            for depth in range(accepted):
                request.stats.accepted_per_position[depth] += 1
        elif request.speculate and rng.random() < 0.1:
            request.stats.fallbacks += 1
        tokens = [rng.randrange(1000) for _ in range(accepted + 1)]
        roll = rng.random()
        if roll < 0.03:
            return StepEvent(request.request_id, [], "error", "INVALID_ARGUMENT: the grammar rejected it")
        finish = "abort" if roll < 0.05 else ("stop" if roll < 0.12 or self.steps > 30 else None)
        prompt = logprobs(rng, len(request.prompt_ids) - 1) if self.steps == 1 and self.wants_logprobs else None
        return StepEvent(request.request_id, tokens, finish, logprobs=logprobs(rng, len(tokens)) if self.wants_logprobs
                         else None, prompt_logprobs=prompt)


@pytest.mark.parametrize("seed", range(6))
def test_the_front_reads_back_the_deltas_the_engine_built_whole(seed):
    rng = random.Random(seed)
    live, made, reader, deltas, with_counts, rich = [], 0, step_columns.Reader(), 0, 0, 0
    for _ in range(200):
        while len(live) < 12 and rng.random() < 0.5:
            live.append(Live(rng, made))
            made += 1
        if not live:
            continue
        rng.shuffle(live)
        events = [(one, one.event()) for one in live]
        expected = whole([(one.sides[0], copy.deepcopy(event)) for one, event in events])
        message = link.EngineMessage()
        finished = step_columns.write([(one.sides[1], event) for one, event in events], message.step)
        sent = link.EngineMessage.FromString(message.SerializeToString())  # as the front receives it
        got = reader.deltas(sent.step) if sent.WhichOneof("kind") == "step" else []
        assert got == expected
        deltas += len(got)
        with_counts += sum(delta.HasField("speculation") for delta in got)
        rich += len(sent.step.rich)
        ended = {one.request.request_id for one, event in events if event.finish_reason is not None}
        assert {s.client_id for s in finished} == {one.sides[1].client_id for one in live if one.request.request_id in ended}
        live = [one for one in live if one.request.request_id not in ended]
    # the run exercised what the columns carry: plain deltas, counts, rich ones, held tokens
    assert deltas > 500 and 0 < with_counts < deltas and 0 < rich < deltas, (deltas, with_counts, rich)
    assert not reader.preemptions or all(reader.preemptions.values())


def test_a_delta_read_back_is_a_message_of_its_own():
    params = SamplingParams(max_new_tokens=8)
    submissions = [Submission(f"c{i}", [1, 2], params, True, request=Request(f"r{i}", [1, 2], params)) for i in range(2)]
    message = link.EngineMessage()
    step_columns.write([(s, StepEvent(s.request.request_id, [5, 6], None)) for s in submissions], message.step)
    first, second = step_columns.Reader().deltas(message.step)
    first.token_ids.append(7)
    first.speculation.verify_steps = 9
    assert list(second.token_ids) == [5, 6] and second.speculation.verify_steps == 0
    assert list(message.step.token_ids) == [5, 6, 5, 6] and not message.step.rich[0].token_ids
