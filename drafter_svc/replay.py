"""The replay drafter: simulated speculation for benchmarks, labelled so everywhere it appears.

A target with dummy weights (an 8B-shaped model built from its config alone) has no draft model that
agrees with it, so its speculative speed cannot be measured with a real pair. The replay drafter makes
one: it knows the target's own greedy continuation of each prompt (a reference recorded by a plain
run, e.g. `splitspec generate --json`), and proposes trees whose main path follows that continuation
for as many positions as an acceptance profile draws, and then turns wrong. Meanwhile the drafter the
other flags name (an EAGLE-3 head of the target's shape with dummy weights, say) runs for real on
every call, so the draft cost is that of a real head; its own tree is discarded.

    profile   a_1, a_2, ... a_S: the fraction of verify steps that accept at least d drafts
              (what a real run's accepted_per_position / verify_steps gives); accept length
              = 1 + sum(a_d). "accept-length:L" picks a_d = q^d with 1 + q + ... + q^S = L.
    draws     one number u per draft call: the request's k-th point of a Weyl sequence whose start is
              seeded by its reference, the same in every run (in-process and remote drafters accept
              alike) and spread evenly, so a few dozen steps already follow the profile; the main
              path's first d tokens are the reference's for the largest d with u < a_d
    tree      N nodes (the inner drafter's tree size, else the budget): the main path of depth
              min(S, N-1), then per depth up to topk-1 siblings of the main node (tokens that are
              not the reference's), breadth first, as a beam search would lay them out

Once a request's sequence leaves its reference (a bf16 near-tie the reference run broke the other way,
or sampling), the replay knows no continuation: it still proposes a tree of the same shape, of tokens
the target will reject, and counts the request in `off_reference`.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

from splitspec.drafter_svc.base import Drafter
from splitspec.runtime.tree import DraftTree

logger = logging.getLogger(__name__)
GOLDEN = 0.6180339887498949  # the Weyl sequence's step: frac(start + k * GOLDEN) fills [0, 1) most evenly


def parse_profile(text: str, num_steps: int) -> list[float]:
    """The unconditional per-depth acceptance rates a_1..a_S of a --speculative-replay-profile."""
    text = text.strip()
    if text.startswith("accept-length:"):
        try:
            length = float(text.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"--speculative-replay-profile {text!r}: expected accept-length:<number>") from None
        if not 1.0 <= length <= num_steps + 1:
            raise ValueError(f"--speculative-replay-profile {text}: an accept length needs 1 <= L <= num_steps + 1 = "
                             f"{num_steps + 1} (one bonus token plus at most {num_steps} drafts a step)")
        lo, hi = 0.0, 1.0  # 1 + q + ... + q^S grows with q: bisect
        for _ in range(60):
            q = (lo + hi) / 2
            lo, hi = (q, hi) if sum(q**d for d in range(num_steps + 1)) < length else (lo, q)
        q = (lo + hi) / 2
        return [q**d for d in range(1, num_steps + 1)]
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--speculative-replay-profile {text!r}: expected accept-length:L or comma-separated rates") from None
    if not rates or any(not 0.0 <= r <= 1.0 for r in rates) or any(b > a for a, b in zip(rates, rates[1:])):
        raise ValueError(f"--speculative-replay-profile {text!r}: rates must lie in [0, 1] and not increase with depth "
                         "(depth d can only be accepted after depth d-1)")
    return (rates + [0.0] * num_steps)[:num_steps]


def load_references(path: str | Path) -> list[list[int]]:
    """Token sequences (prompt + the target's greedy output) from JSON lines with prompt_ids and
    output_ids, as `splitspec generate --json` prints them."""
    sequences = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            sequences.append([int(t) for t in row["prompt_ids"]] + [int(t) for t in row["output_ids"]])
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"--speculative-replay {path}, line {number}: expected a JSON object with prompt_ids and "
                             f"output_ids ({exc})") from None
    if not sequences:
        raise ValueError(f"--speculative-replay {path}: no reference sequences")
    return sequences


class ReplayDrafter(Drafter):
    """Wraps the drafter that pays the cost; proposes the reference's continuation (see the module)."""

    simulated = True

    def __init__(self, inner: Drafter, references: list[list[int]], rates: list[float], vocab_size: int,
                 num_steps: int, topk: int, num_draft_tokens: int, seed: int = 0):
        self.inner, self.references, self.rates = inner, references, rates
        self.vocab_size, self.num_steps, self.topk, self.num_draft_tokens = vocab_size, num_steps, topk, num_draft_tokens
        self.seed = seed
        self.name = inner.name
        self.needs_hidden_states = inner.needs_hidden_states
        self.hidden_state_layers = getattr(inner, "hidden_state_layers", ())
        self.draws: dict[str, int] = {}  # request -> draws so far
        self.contexts: dict[str, list[int]] = {}
        self.matched: dict[str, int | None] = {}  # request -> reference index (None: not looked up yet, -1: none)
        self.off_reference = 0  # requests whose sequence left their reference
        self._by_first: dict[tuple[int, ...], list[int]] = {}
        for i, ref in enumerate(references):
            self._by_first.setdefault(tuple(ref[:1]), []).append(i)

    def __getattr__(self, name):  # runner, vocab_size of a model drafter, ...: the inner drafter's
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def open(self, request_id: str, prompt_ids: list[int]) -> None:
        self.inner.open(request_id, prompt_ids)
        self.contexts[request_id] = list(prompt_ids)
        self.matched[request_id] = None

    def extend(self, request_id: str, tokens: list[int], hidden=None) -> None:
        if self.needs_hidden_states:
            self.inner.extend(request_id, tokens, hidden)
        else:
            self.inner.extend(request_id, tokens)
        self.contexts[request_id].extend(tokens)

    def release(self, request_id: str) -> None:
        self.inner.release(request_id)
        self.contexts.pop(request_id, None)
        self.matched.pop(request_id, None)
        self.draws.pop(request_id, None)

    def draft(self, request_ids: list[str], max_nodes: list[int]) -> list[DraftTree | None]:
        paid = self.inner.draft(request_ids, max_nodes)  # the real head's work; its tokens are not used
        out: list[DraftTree | None] = []
        for request_id, budget, tree in zip(request_ids, max_nodes, paid):
            n = tree.num_nodes if tree is not None else min(budget, self.num_draft_tokens)
            out.append(self._tree(request_id, n) if n >= 2 else None)
        return out

    # the simulated tree ------------------------------------------------------------------------------
    def _reference(self, request_id: str) -> list[int] | None:
        context = self.contexts[request_id]
        index = self.matched[request_id]
        if index is not None and index >= 0 and self.references[index][: len(context)] == context:
            return self.references[index]
        if index == -1:
            return None
        # first lookup, or the sequence left its reference: another one that it still follows (the same prompt
        # recorded at another batch size, whose bf16 rounding broke a near-tie the other way), else none
        index = next((i for i in self._by_first.get(tuple(context[:1]), [])
                      if self.references[i][: len(context)] == context), -1)
        if index < 0:
            logger.warning("replay: request %s follows no reference sequence at position %d; its drafts will be rejected",
                           request_id, len(context))
            self.off_reference += 1
        self.matched[request_id] = index
        return None if index < 0 else self.references[index]

    def _tree(self, request_id: str, num_nodes: int) -> DraftTree:
        context = self.contexts[request_id]
        reference = self._reference(request_id)
        n = len(context)
        depth = min(self.num_steps, num_nodes - 1)
        # the reference's next tokens, as far as it goes; past it (or without one) tokens nobody predicts
        truth = [reference[n - 1 + d] if reference is not None and n - 1 + d < len(reference) else -1
                 for d in range(1, depth + 1)]
        # this request's k-th draw: a Weyl sequence from a seeded start, so the drawn depths follow the
        # profile closely even over a few dozen steps; depth d is accepted when u < a_d
        k = self.draws[request_id] = self.draws.get(request_id, -1) + 1
        start = random.Random(f"{self.seed}:{self.matched[request_id]}").random()
        u = (start + k * GOLDEN) % 1.0
        accepted = 0
        while accepted < depth and truth[accepted] >= 0 and u < self.rates[accepted]:
            accepted += 1

        def wrong(d: int, j: int) -> int:  # the j-th token (j >= 1) at depth d that is not the reference's
            anchor = truth[d] if truth[d] >= 0 else context[-1]
            return (anchor + j) % self.vocab_size

        tokens, parents = [context[-1]], [-1]
        main = [0]  # node index of the main path at each depth
        for d in range(depth):
            tokens.append(truth[d] if d < accepted else wrong(d, 1) if d == accepted else max(truth[d], 0))
            parents.append(main[-1])
            main.append(len(tokens) - 1)
        for d in range(depth):  # topk - 1 siblings under each main node, shallow ones first
            for j in range(2, self.topk + 1):
                if len(tokens) < num_nodes:
                    tokens.append(wrong(d, j))
                    parents.append(main[d])
        while len(tokens) < num_nodes:  # more nodes than such a tree holds: a chain under the last one
            tokens.append(wrong(depth - 1, len(tokens) + 1))
            parents.append(len(tokens) - 2)
        return DraftTree(tuple(tokens), tuple(parents))


def wrap(drafter: Drafter, args, vocab_size: int, shape: tuple[int, int, int]) -> ReplayDrafter:
    """The ReplayDrafter the --speculative-replay* flags ask for, around the drafter that pays the cost."""
    steps, topk, tokens = shape
    replay = ReplayDrafter(drafter, load_references(args.speculative_replay),
                           parse_profile(args.speculative_replay_profile, steps), vocab_size, steps, topk, tokens,
                           seed=args.speculative_replay_seed)
    logger.warning("SIMULATED speculation: %s drafts for real but proposes the target's recorded continuation from %s "
                   "(%d sequences), accepted per the profile %s (expected accept length %.2f)", drafter.name,
                   args.speculative_replay, len(replay.references), args.speculative_replay_profile,
                   1 + sum(replay.rates))
    return replay
