"""A step's deltas as columns (engine_link.proto's StepColumns): the engine's thread writes them, the front (or, with
--disable-frontend-multiprocessing, the event loop) reads them back into the TokenDeltas the Verifier service streams.

Why: a TokenDelta built per request per step on the engine's thread (a message, its id, its tokens, its speculation
counts: a dozen protobuf calls each) was ~12% of that thread on the demo target at batch 16 (py-spy on an H100,
2026-12-05), time the GPU waited for on a host-bound model. Written as columns, a decoding request's delta costs a few
list appends and the step a dozen protobuf calls in all; a delta with more than tokens and counts (a request's first
and last, an error, logprobs, a new preemption count) is still built whole, once per request lifetime in the common case.

The reader gives every delta exactly what convert.fill_delta would have given it (tests/test_step_columns.py).
"""

from __future__ import annotations

from splitspec.protos import engine_link_pb2 as link
from splitspec.protos import verifier_pb2 as pb
from splitspec.verifier_svc import convert


def write(deliveries, columns: link.StepColumns) -> list:
    """The deliveries' due deltas into columns (held ones, --stream-interval, are left out); clears each submission's
    first. Returns the submissions whose requests finished (their last delta is in). A delta carries the request's
    speculation counts on its first and last and whenever they moved since the last that did (a request decoding
    plainly, or with drafting off, sends none each step). worker.Submission.due() is skipped for the common case (one
    token per delta, nothing held): this loop runs for every request at every step, on the engine's thread."""
    ids, token_counts, token_ids = [], [], []
    counts_at, verify_steps, draft_tokens, accepted_tokens, fallbacks, positions, per_position = [], [], [], [], [], [], []
    rich_at, finished = [], []
    for submission, event in deliveries:
        if submission.interval <= 1 and not submission.held:
            tokens, logprobs = event.new_token_ids, event.logprobs
        else:
            due = submission.due(event)
            if due is None:  # held (--stream-interval)
                continue
            tokens, logprobs = due
        index = len(ids)
        ids.append(submission.client_id)
        token_counts.append(len(tokens))
        token_ids += tokens
        request = submission.request
        finish = event.finish_reason
        ends = submission.first or finish is not None
        rich = ends or bool(event.error or logprobs or event.prompt_logprobs)
        if request is not None:
            stats = request.stats
            mark = (stats.verify_steps, stats.fallbacks)
            if ends or mark != submission.counts_sent:
                submission.counts_sent = mark
                counts_at.append(index)
                verify_steps.append(stats.verify_steps)
                draft_tokens.append(stats.draft_tokens)
                accepted_tokens.append(stats.accepted_tokens)
                fallbacks.append(stats.fallbacks)
                positions.append(len(stats.accepted_per_position))
                per_position += stats.accepted_per_position
            if request.num_preemptions != submission.preemptions_sent:
                submission.preemptions_sent = request.num_preemptions
                rich = True
        if rich:
            rich_at.append(index)
            convert.fill_delta(columns.rich.add(), "", request, [], finish, submission.first, event.error, logprobs,
                               event.prompt_logprobs, counts=False)
            submission.first = False
            if finish is not None:
                finished.append(submission)
    if ids:
        columns.request_ids.extend(ids)
        columns.token_counts.extend(token_counts)
        columns.token_ids.extend(token_ids)
    if rich_at:
        columns.rich_at.extend(rich_at)
    if counts_at:
        columns.counts_at.extend(counts_at)
        columns.verify_steps.extend(verify_steps)
        columns.draft_tokens.extend(draft_tokens)
        columns.accepted_tokens.extend(accepted_tokens)
        columns.fallbacks.extend(fallbacks)
        columns.positions.extend(positions)
        columns.accepted_per_position.extend(per_position)
    return finished


class Reader:
    """Columns back into TokenDeltas; remembers each live request's preemption count (sent when it changes, repeated
    on every delta as the service reports it) until its last delta."""

    def __init__(self):
        self.preemptions: dict[str, int] = {}

    def deltas(self, columns: link.StepColumns) -> list[pb.TokenDelta]:
        tokens = list(columns.token_ids)
        rich = dict(zip(columns.rich_at, columns.rich)) if columns.rich_at else {}
        counted = {index: at for at, index in enumerate(columns.counts_at)}
        starts = [0]
        for length in columns.positions:
            starts.append(starts[-1] + length)
        per_position = list(columns.accepted_per_position)
        preemptions = self.preemptions
        out, start = [], 0
        for index, (request_id, count) in enumerate(zip(list(columns.request_ids), list(columns.token_counts))):
            delta = pb.TokenDelta()
            delta.request_id = request_id
            delta.token_ids.extend(tokens[start:start + count])
            start += count
            full = rich.get(index)
            if full is not None:
                delta.MergeFrom(full)  # into a message of its own: a stream may merge later deltas into it
                if full.num_preemptions:
                    preemptions[request_id] = full.num_preemptions
                if full.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    preemptions.pop(request_id, None)
            elif preemptions:
                delta.num_preemptions = preemptions.get(request_id, 0)
            at = counted.get(index)
            if at is not None:
                delta.speculation.CopyFrom(pb.SpeculationCounts(
                    verify_steps=columns.verify_steps[at], draft_tokens=columns.draft_tokens[at],
                    accepted_tokens=columns.accepted_tokens[at], fallbacks=columns.fallbacks[at],
                    accepted_per_position=per_position[starts[at]:starts[at + 1]]))
            out.append(delta)
        return out
