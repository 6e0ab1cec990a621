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
    bets      (overlap) as many bets as the inner drafter drafted for real, on the outcomes it bets on
              (accept lengths S, S-1, .., 0, then second guesses); the bet on the length this step
              will accept guesses the bonus token right with the guess rate (--speculative-replay-
              guess-rate; default a_S / a_S-1, the profile's rate at its last depth), drawn like the
              acceptance from a second Weyl sequence; every other bet is wrong

Once a request's sequence leaves its reference (a bf16 near-tie the reference run broke the other way,
or sampling), the replay knows no continuation: it still proposes a tree of the same shape, of tokens
the target will reject, and counts the request in `off_reference`.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

from splitspec.drafter_svc.base import Bet, Drafter, bet_order
from splitspec.runtime.launched_draft import LaunchedDraft
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
                 num_steps: int, topk: int, num_draft_tokens: int, seed: int = 0, guess_rate: float | None = None):
        self.inner, self.references, self.rates = inner, references, rates
        if guess_rate is None:
            guess_rate = rates[-1] / rates[-2] if len(rates) > 1 and rates[-2] > 0 else rates[0]
        self.guess_rate = guess_rate
        self.supports_bets = getattr(inner, "supports_bets", False)
        self.launches_on_device = getattr(inner, "launches_on_device", False)  # the inner drafter's work is what launch() queues
        self.current: dict[str, tuple[int, DraftTree]] = {}  # request -> (drafts the target accepts, tree)
        self.bets: dict[str, list[tuple[Bet, tuple[int, DraftTree]]]] = {}
        self.vocab_size, self.num_steps, self.topk, self.num_draft_tokens = vocab_size, num_steps, topk, num_draft_tokens
        self.seed = seed
        self.name = inner.name
        self.needs_hidden_states = inner.needs_hidden_states
        self.hidden_state_layers = getattr(inner, "hidden_state_layers", ())
        self.draws: dict[str, int] = {}  # request -> draws so far
        self.contexts: dict[str, list[int]] = {}
        self.matched: dict[str, int | None] = {}  # request -> reference index (None: not looked up yet, -1: none)
        self.checked: dict[str, int] = {}  # request -> how much of its context is known to equal its reference's start
        self._starts: dict[tuple[int | None, str], float] = {}  # (reference, salt) -> the Weyl sequence's start
        self.off_reference = 0  # requests whose sequence left their reference
        self._by_first: dict[tuple[int, ...], list[int]] = {}
        self._unfinished: list[LaunchedDraft] = []  # the inner drafter's launched drafts (launch)
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
        self.checked[request_id] = 0

    def extend(self, request_id: str, tokens: list[int], hidden=None) -> None:
        if self.needs_hidden_states:
            self.inner.extend(request_id, tokens, hidden)
        else:
            self.inner.extend(request_id, tokens)
        self.contexts[request_id].extend(tokens)

    def release(self, request_id: str) -> None:
        self._finish_inner()
        self.inner.release(request_id)
        self.contexts.pop(request_id, None)
        self.current.pop(request_id, None)
        self.bets.pop(request_id, None)
        self.matched.pop(request_id, None)
        self.checked.pop(request_id, None)
        self.draws.pop(request_id, None)

    def draft(self, request_ids: list[str], max_nodes: list[int]) -> list[DraftTree | None]:
        self._finish_inner()
        paid = self.inner.draft(request_ids, max_nodes)  # the real head's work; its tokens are not used
        return self._trees(request_ids, max_nodes, [None if tree is None else tree.num_nodes for tree in paid])

    def launch(self, request_ids: list[str], max_nodes: list[int]) -> LaunchedDraft:
        """In the verifier's process: the inner drafter's work launched as a real draft's would be (its trees finished
        in idle(), under the verification, as the verifier resolves a real launched draft's), these trees now."""
        self._finish_inner()
        paid = self.inner.launch(request_ids, max_nodes)
        sizes = paid.sizes if paid.sizes is not None else [None if t is None else t.num_nodes for t in paid.trees()]
        if not paid.finished:
            self._unfinished.append(paid)
        return LaunchedDraft.ready(self._trees(request_ids, max_nodes, sizes))

    def _finish_inner(self) -> None:
        """The inner drafter's launched drafts finished (its bookkeeping done) before it does anything else."""
        while self._unfinished:
            self._unfinished.pop(0).trees()

    def idle(self) -> None:
        self._finish_inner()
        self.inner.idle()

    def _trees(self, request_ids: list[str], max_nodes: list[int], sizes: list[int | None]) -> list[DraftTree | None]:
        """The simulated trees, each of its inner tree's size (None: the budget's)."""
        out: list[DraftTree | None] = []
        for request_id, budget, size in zip(request_ids, max_nodes, sizes):
            n = size if size is not None else min(budget, self.num_draft_tokens)
            if n < 2:
                out.append(None)
                continue
            k = self.draws[request_id] = self.draws.get(request_id, -1) + 1
            context, reference = self.contexts[request_id], self._reference(request_id)
            tree, accepted = self._tree(context, reference, self._draw(request_id, k), n, checked=len(context))
            self.current[request_id] = (accepted, tree)
            out.append(tree)
        return out

    def draft_bets(self, request_ids: list[str], num_bets: int) -> list[list[Bet]]:
        self._finish_inner()
        paid = self.inner.draft_bets(request_ids, num_bets)  # the real work; its trees are not used
        out = []
        for request_id, inner_bets in zip(request_ids, paid):
            if request_id not in self.current or not inner_bets:
                self.bets[request_id] = []
                out.append([])
                continue
            accepted, tree = self.current[request_id]
            context, reference = self.contexts[request_id], self._reference(request_id)
            depth = min(self.num_steps, tree.num_nodes - 1)
            main = list(tree.tokens[1 : depth + 1])  # _tree lays the main path out first
            k = self.draws.get(request_id, -1) + 1  # the draw the next tree uses
            n = len(context)
            truth = reference[n + accepted] if reference is not None and n + accepted < len(reference) else None
            right = truth is not None and self._draw(request_id, k, salt="guess") < self.guess_rate
            bets = []
            for a, rank in bet_order(depth, len(inner_bets)):  # the outcomes the inner drafter paid for
                hit = a == accepted and rank == 0 and right
                guess = truth if hit else (main[a] if a < depth else context[-1]) + 1 + rank
                guess %= self.vocab_size
                outcome = tuple(main[:a]) + (guess,)
                bet_context = context + list(outcome)
                bet_tree, bet_accepted = self._tree(bet_context, reference, self._draw(request_id, k), tree.num_nodes,
                                                    checked=n)
                bets.append((Bet(outcome, bet_tree), (bet_accepted, bet_tree)))
            self.bets[request_id] = bets
            out.append([bet for bet, _ in bets])
        return out

    def take_bet(self, request_id: str, index: int) -> None:
        self._finish_inner()
        inner_bets = getattr(self.inner, "bets", {}).get(request_id) or []
        if inner_bets:  # the inner drafter follows a bet of its own (cost only)
            self.inner.take_bet(request_id, min(index, len(inner_bets) - 1))
        self.current[request_id] = self.bets[request_id][index][1]
        self.draws[request_id] = self.draws.get(request_id, -1) + 1

    # the simulated tree ------------------------------------------------------------------------------
    def _reference(self, request_id: str) -> list[int] | None:
        """The reference this request's context still follows (None: none does). Contexts only grow, so each call
        compares only the tokens added since the last one (a whole-context comparison per request per step was
        the replay's own host cost, paid inside the step it measures)."""
        context = self.contexts[request_id]
        index, checked = self.matched[request_id], self.checked.get(request_id, 0)
        if index is not None and index >= 0:
            reference = self.references[index]
            if reference[checked : len(context)] == context[checked:]:  # (false too when the context outgrew it)
                self.checked[request_id] = len(context)
                return reference
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
        self.checked[request_id] = len(context) if index >= 0 else 0
        return None if index < 0 else self.references[index]

    def _draw(self, request_id: str, k: int, salt: str = "") -> float:
        """This request's k-th draw: a Weyl sequence from a seeded start, so that the drawn depths follow
        the profile closely even over a few dozen steps."""
        key = (self.matched[request_id], salt)
        start = self._starts.get(key)
        if start is None:  # seeding a Random from a string hashes it: once per (reference, salt), not per draw
            start = self._starts[key] = random.Random(f"{self.seed}:{key[0]}{salt}").random()
        return (start + k * GOLDEN) % 1.0

    def _tree(self, context: list[int], reference: list[int] | None, u: float, num_nodes: int,
              checked: int = 0) -> tuple[DraftTree, int]:
        """(the tree for this context and draw, how many of its drafts the target will accept). A context
        that is not a prefix of the reference gets a tree the target rejects; its first `checked` tokens are
        known to be the reference's."""
        n = len(context)
        depth = min(self.num_steps, num_nodes - 1)
        if reference is not None and (n > len(reference) or reference[checked:n] != context[checked:]):
            reference = None
        # the reference's next tokens, as far as it goes; past it (or without one) tokens nobody predicts
        truth = [reference[n - 1 + d] if reference is not None and n - 1 + d < len(reference) else -1
                 for d in range(1, depth + 1)]
        accepted = 0  # depth d is accepted when u < a_d
        while accepted < depth and truth[accepted] >= 0 and u < self.rates[accepted]:
            accepted += 1

        def wrong(d: int, j: int) -> int:  # the j-th token (j >= 1) at depth d that is not the reference's
            anchor = truth[d] if truth[d] >= 0 else context[-1]
            return (anchor + j) % self.vocab_size

        if self.topk == 1 and num_nodes == depth + 1:  # a chain (top-1, the tree the loop drafts): in one go
            drafts = truth[:accepted]
            if accepted < depth:
                drafts += [wrong(accepted, 1), *(max(t, 0) for t in truth[accepted + 1 :])]
            return DraftTree.chain(context[-1], drafts), accepted
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
        return DraftTree(tuple(tokens), tuple(parents)), accepted


def wrap(drafter: Drafter, settings, vocab_size: int, shape: tuple[int, int, int]) -> ReplayDrafter:
    """The ReplayDrafter the --speculative-replay* flags ask for (settings: splitspec.speculation.Replay), around
    the drafter that pays the cost."""
    steps, topk, tokens = shape
    replay = ReplayDrafter(drafter, load_references(settings.references), parse_profile(settings.profile, steps),
                           vocab_size, steps, topk, tokens, seed=settings.seed, guess_rate=settings.guess_rate)
    logger.warning("SIMULATED speculation: %s drafts for real but proposes the target's recorded continuation from %s "
                   "(%d sequences), accepted per the profile %s (expected accept length %.2f; overlap's bonus guesses "
                   "right at rate %.2f)", drafter.name, settings.references, len(replay.references),
                   settings.profile, 1 + sum(replay.rates), replay.guess_rate)
    return replay
