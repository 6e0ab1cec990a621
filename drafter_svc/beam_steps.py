"""Steps 1..S-1 of the beam draft shared by STANDALONE and EAGLE-style heads.

A drafter's steps run in runtime.draft_loop (on the device, one CUDA graph per batch size). A draft model
with sliding-window layers, which the loop's cascade attention does not cover, drafts on the host with
runtime.beam_draft.BeamDraft, the reference: each step forwards, for every request in one batch, all beam nodes
made so far after the request's committed KV under their forest mask (S*(S-1)/2*K extra rows), and the
beam nodes' KV is dropped after the step.
"""

from __future__ import annotations

import logging
import os

import torch

from splitspec.runtime.batch import SequenceInput, device_tensor
from splitspec.runtime.draft_loop import DraftLoop
from splitspec.runtime.inference import inference
from splitspec.runtime.kv_cache import BlockTable, OutOfPagesError
from splitspec.runtime.launched_draft import LaunchedDraft
from splitspec.runtime.runner import ModelRunner
from splitspec.drafter_svc.base import Bet, bet_order
from splitspec.runtime.beam_draft import BeamDraft, batched_topk
from splitspec.runtime.tree import NO_NODE, DraftTree

logger = logging.getLogger(__name__)


def draft_loop_for(runner: ModelRunner, topk: int, num_steps: int, num_draft_tokens: int,
                   token_map: torch.Tensor | None, feature_size: int = 0) -> DraftLoop | None:
    """The device loop for this draft model, or None (sliding windows: the host reference drafts;
    SPLITSPEC_DRAFT_LOOP=host forces the reference, to compare the two)."""
    if os.environ.get("SPLITSPEC_DRAFT_LOOP") == "host":
        return None
    if any(w is not None for w in runner.config.sliding_windows):
        logger.info("the draft model has sliding-window layers: its beam steps run on the host")
        return None
    return DraftLoop(runner, topk, num_steps, num_draft_tokens, token_map, feature_size)


def beam_trees(drafter, request_ids: list[str], roots: list[int], root_logits: torch.Tensor, tables: list[BlockTable],
               budgets: list[int], root_features: torch.Tensor | None, guides: list | None) -> list[DraftTree]:
    """One draft call's trees: the device loop for every request (its trees remembered for bets), but requests a
    grammar guides (DraftAsk.guide in this process), which draft on the host with every step's candidates masked
    to what their grammar allows after each beam's path; no loop (sliding windows): the host for all.
    root_features [B, H]: a head's feature for each root's children (None: a draft LM)."""
    guided = [k for k, guide in enumerate(guides or []) if guide is not None]
    free = sorted(set(range(len(roots))) - set(guided)) if drafter.loop is not None else []
    trees: list[DraftTree | None] = [None] * len(roots)
    if free:
        pick = lambda items: [items[k] for k in free]  # noqa: E731
        features = None if root_features is None else root_features if len(free) == len(roots) else root_features[free]
        run = drafter.loop.launch(pick(roots), root_logits[free] if len(free) < len(roots) else root_logits, features,
                                  pick(tables), pick(budgets))
        ran = run.finish()
        drafter._remember(pick(request_ids), run, pick(budgets))
        for k, tree in zip(free, ran):
            trees[k] = tree
    host = sorted(set(range(len(roots))) - set(free))
    if host:
        pick = lambda items: [items[k] for k in host]  # noqa: E731
        for k in guided:
            drafter._forget_bets(request_ids[k])  # its tree is not the loop's: no bets from it
        ran = host_beam_draft(drafter.runner, pick(roots), root_logits[host] if len(host) < len(roots) else root_logits,
                              pick(tables), pick(budgets), drafter, pick(root_features) if root_features is not None else None,
                              pick(guides) if guides else None)
        for k, tree in zip(host, ran):
            trees[k] = tree
    return trees


def launch_beam_draft(drafter, count: int, indices: list[int], request_ids: list[str], roots: list[int],
                      root_logits: torch.Tensor | None, tables: list[BlockTable], budgets: list[int],
                      root_features: torch.Tensor | None, run=None) -> LaunchedDraft:
    """The device loop launched for the asked requests (indices: their places among `count`), as a LaunchedDraft of
    `count` trees (None where not asked): the trees finished, and remembered for bets, when read; top-1 chains
    readable on the device meanwhile (runtime.launched_draft). run: the loop launched already for them (a
    DraftLoop.launch_ahead's, its roots and budgets set to these)."""
    if run is None:
        run = drafter.loop.launch(roots, root_logits, root_features, tables, budgets)
    else:
        run.roots, run.budgets = list(roots), list(budgets)
    rows: list[int | None] = [None] * count
    sizes: list[int | None] = [None] * count
    for j, (i, size) in enumerate(zip(indices, run.sizes())):
        rows[i], sizes[i] = j, size

    def finish() -> list[DraftTree | None]:
        drafter._remember(request_ids, run, budgets)
        out: list[DraftTree | None] = [None] * count
        for i, tree in zip(indices, run.finish()):
            out[i] = tree
        return out

    return LaunchedDraft(finish, rows, sizes, run.chain_tokens, drafter.loop.id_bound)


def host_beam_draft(runner: ModelRunner, roots: list[int], root_logits: torch.Tensor, tables: list[BlockTable],
                    budgets: list[int], shape, root_features: list[torch.Tensor] | None = None,
                    guides: list | None = None) -> list[DraftTree]:
    """BeamDraft for each request (shape: its topk, num_steps, num_draft_tokens, token_map); guides (a request's
    runtime.grammar_guide.GrammarGuide, or None): that request's candidates masked to its grammar at every step."""
    if guides and any(g is not None for g in guides):
        root_logits = root_logits.clone()
        for row, (root, guide) in enumerate(zip(roots, guides)):
            if guide is not None:
                allowed = guide.node_masks(DraftTree((root,), (-1,)))[0]
                _mask(root_logits, [row], allowed[None], shape.token_map)
    top_p, top_idx = batched_topk(root_logits, shape.topk)
    beams = []
    for row, (root, budget) in enumerate(zip(roots, budgets)):
        beam = BeamDraft(root, shape.topk, shape.num_steps, budget, shape.token_map)
        beam.first_topk(top_p[row], top_idx[row])
        beams.append(beam)
    expand_beams(runner, beams, tables, root_features, guides)
    return [beam.tree() for beam in beams]


def _mask(logits: torch.Tensor, rows: list[int], allowed: torch.Tensor, token_map: torch.Tensor | None) -> None:
    """-inf in logits' rows [R, V_draft] where the target ids allowed [R, V_target] (bool) are not allowed."""
    if token_map is not None:
        allowed = allowed[:, token_map.cpu()]
    width = logits.shape[-1]
    if allowed.shape[-1] < width:  # a draft vocabulary padded past the target's: the padding is never allowed
        allowed = torch.cat([allowed, allowed.new_zeros(allowed.shape[0], width - allowed.shape[-1])], dim=-1)
    index = device_tensor(rows, logits.device)
    logits[index] = logits[index].masked_fill(~allowed[:, :width].to(logits.device), float("-inf"))


def expand_beams(runner: ModelRunner, beams: list[BeamDraft], tables: list[BlockTable],
                 root_features: list[torch.Tensor] | None = None, guides: list | None = None) -> None:
    """Run every beam search to its last step. root_features (EAGLE heads): each request's feature for
    the root's children; a deeper node gets its parent's output, so the head's outputs are kept. guides: as
    host_beam_draft's."""
    kv = runner.kv_cache
    outputs: list[list[torch.Tensor]] = [[] for _ in beams]
    while beams[0].beams() is not None:  # every request has the same number of steps
        sequences, features, frontiers = [], [], []
        for k, (beam, table) in enumerate(zip(beams, tables)):
            tokens, depths, mask = beam.layout()
            mask = mask if len(tokens) > 1 else None
            sequences.append(SequenceInput(table, tokens, [table.num_tokens - 1 + d for d in depths], mask, "all"))
            if root_features is not None:
                features += [root_features[k] if p == NO_NODE else outputs[k][p] for p in beam.beam_parents]
            frontiers.append(beam.beams())
        batch = runner.batch(sequences)
        output = runner.forward(batch, return_hidden=root_features is not None,
                                features=torch.stack(features) if root_features is not None else None)
        # every request's frontier rows: one softmax + top-k and one transfer for the whole batch
        picked = [batch.cu_logits[k] + f for k, frontier in enumerate(frontiers) for f in frontier]
        rows = output.logits[device_tensor(picked, output.logits.device)]
        first = 0
        for k, (beam, frontier) in enumerate(zip(beams, frontiers)):
            if guides and guides[k] is not None:  # the grammar after each frontier node's path (node f + 1: the root is 0)
                tree = DraftTree((beam.root, *beam.beam_tokens), (-1, *(p + 1 for p in beam.beam_parents)))
                allowed = guides[k].node_masks(tree)[[f + 1 for f in frontier]]
                _mask(rows, list(range(first, first + len(frontier))), allowed, beam.token_map)
            first += len(frontier)
        top_p, top_idx = batched_topk(rows, beams[0].topk)
        start, row = 0, 0
        for k, (beam, table) in enumerate(zip(beams, tables)):
            n = len(beam.beam_tokens)
            kv.set_length(table, table.num_tokens)  # drop the beam nodes' KV
            if root_features is not None:
                outputs[k] = list(output.hidden_states[start : start + n])
            width = len(frontiers[k])
            beam.expand_topk(top_p[row : row + width], top_idx[row : row + width])
            start, row = start + n, row + width


class _Current:
    """What the drafter knows of the tree being verified for a request: the tree, the loop's best path
    (target ids, depth 1..S) and, for a head, the outputs its first S-1 nodes were drafted from."""

    __slots__ = ("tree", "path", "_rows", "_row", "budget")

    def __init__(self, tree: DraftTree, path: list[int], rows: torch.Tensor | None, row: int, budget: int):
        """rows [B, S-1, H] (the loop run's path outputs, None without a head) and this request's row of it: taken
        only when a bet drafts from it (a per-request tensor op on every step otherwise)."""
        self.tree, self.path, self._rows, self._row, self.budget = tree, path, rows, row, budget

    @property
    def path_hidden(self) -> torch.Tensor | None:
        return None if self._rows is None else self._rows[self._row]


def _in_tree(tree: DraftTree, path: list[int]) -> int:
    """How many of path's tokens the tree holds as a chain from its root."""
    children: dict[int, dict[int, int]] = {}
    for node in range(1, tree.num_nodes):
        children.setdefault(tree.parents[node], {}).setdefault(tree.tokens[node], node)
    node, depth = 0, 0
    for token in path:
        node = children.get(node, {}).get(token)
        if node is None:
            break
        depth += 1
    return depth


class ModelBets:
    """Overlap's bets for a draft model or head drafting with runtime.draft_loop (STANDALONE, EAGLE,
    EAGLE3). For the tree being verified, the loop's most likely full-depth path P (cut to what the tree
    holds: m tokens). Outcomes, one per accept length a = m, m-1, .., 0 (the longest first), then a second
    guess for each: the drafts P[:a] accepted and a bonus token guessed from the draft's distribution after
    them (for a < m the guess is not P[a], which the verifier rejected). Drafting them, in one batch for all
    requests and outcomes, never touches a request's own KV:

        1. fork the request's KV (whole pages shared) and forward P[:m] after the root, a head fed the
           features P was drafted with: the distributions after each prefix
        2. per outcome, fork that at root + a and forward the guess (a head: fed the output after P[:a])
        3. the draft loop from each guess: the bet trees
        4. release the forks

    A bet's tree and path are kept, so that when its outcome comes true (take_bet) the next bets follow it.
    The class using it provides runner, loop, token_map, `current` and `bets` dicts, and
    `_bet_roots(request_ids)`: per request (KV table whose last row is the root, the root's logits [V],
    the root's output feature or None), after catching up on what extend() brought."""

    supports_bets = True
    feeds_features = False  # a head: rows are fed features

    @property
    def launches_on_device(self) -> bool:  # Drafter.launches_on_device: the draft loop (none: drafted on the host)
        return self.loop is not None

    def _remember(self, request_ids: list[str], run, budgets: list[int]) -> None:
        """After a loop run (a finished draft_loop.LoopRun) for these requests: their current trees."""
        for k, (request_id, tree, budget) in enumerate(zip(request_ids, run.finish(), budgets)):
            self.current[request_id] = _Current(tree, run.paths[k], run.path_hidden, k, budget)

    def take_bet(self, request_id: str, index: int) -> None:
        self.current[request_id] = self.bets[request_id][index][1]

    def _forget_bets(self, request_id: str) -> None:
        self.current.pop(request_id, None)
        self.bets.pop(request_id, None)

    @inference
    def draft_bets(self, request_ids: list[str], num_bets: int) -> list[list[Bet]]:
        try:
            return self._draft_bets(request_ids, num_bets)
        except OutOfPagesError:  # forks need a page each: no bets this step, the verifier drafts afresh
            if not getattr(self, "_warned_pages", False):
                logger.warning("the draft KV cache has no pages left for bets (overlap); raise --max-total-tokens "
                               "or --mem-fraction-static of the drafter. Steps without bets draft afresh.")
                self._warned_pages = True
            for request_id in request_ids:
                self.bets[request_id] = []
            return [[] for _ in request_ids]

    def _draft_bets(self, request_ids: list[str], num_bets: int) -> list[list[Bet]]:
        out: list[list[Bet]] = [[] for _ in request_ids]
        asked = [(k, r) for k, r in enumerate(request_ids) if r in self.current and self.current[r].tree is not None]
        if self.loop is None or num_bets < 1 or not asked:
            return out
        runner, kv = self.runner, self.runner.kv_cache
        roots = self._bet_roots([r for _, r in asked])
        forks: list[BlockTable] = []
        try:
            # 1. the path after each root, in forks of the requests' KV
            sequences, features, cuts = [], [], []
            for (_, request_id), (table, _, root_feature) in zip(asked, roots):
                current = self.current[request_id]
                m = _in_tree(current.tree, current.path)
                cuts.append(m)
                fork = kv.fork(table, table.num_tokens)
                forks.append(fork)
                if m:
                    sequences.append(SequenceInput(fork, current.path[:m], logits="all"))
                if m and self.feeds_features:
                    features.append(torch.cat([root_feature[None], current.path_hidden[: m - 1]]))
            output = None
            if sequences:
                batch = runner.batch(sequences)
                output = runner.forward(batch, return_hidden=self.feeds_features,
                                        features=torch.cat(features) if self.feeds_features else None)
            # 2. the outcomes and their guessed bonus tokens (one top-k and one transfer for all), then the guesses'
            # rows in forks of those forks
            after, outputs, row = [], [], 0
            for k, ((_, request_id), (table, root_logits, root_feature), m) in enumerate(zip(asked, roots, cuts)):
                if m:
                    kv.set_length(forks[k], table.num_tokens + m)
                after += [root_logits] + [output.logits[row + j] for j in range(m)]
                outputs.append([root_feature] + ([output.hidden_states[row + j] for j in range(m)]
                                                 if m and self.feeds_features else [None] * m))
                row += m
            top = torch.stack(after).float().topk(3, dim=-1).indices
            top = (top if self.loop.token_map is None else self.loop.token_map[top]).tolist()  # on the device
            plans, first = [], 0
            for k, ((_, request_id), m) in enumerate(zip(asked, cuts)):
                path = self.current[request_id].path
                # the best two tokens after P[:a], P[a] excluded where the verifier rejected it
                guesses = {a: [t for t in top[first + a] if a == m or t != path[a]][:2] for a in range(m + 1)}
                first += m + 1
                for a, rank in bet_order(m, num_bets):
                    if rank < len(guesses[a]):
                        plans.append((k, a, guesses[a][rank], outputs[k][a]))
            if not plans:
                return out
            sequences, bet_tables = [], []
            for k in range(len(asked)):
                mine = [p for p in plans if p[0] == k]
                if mine:
                    tables = kv.fork_many(forks[k], [roots[k][0].num_tokens + a for _, a, _, _ in mine])
                    forks.extend(tables)
                    bet_tables += tables
            for table, (_, _, guess, _) in zip(bet_tables, plans):
                sequences.append(SequenceInput(table, [guess], logits="last"))
            batch = runner.batch(sequences)
            feats = torch.stack([p[3] for p in plans]) if self.feeds_features else None
            output = runner.forward(batch, return_hidden=self.feeds_features, features=feats)
            for table in bet_tables:
                kv.set_length(table, table.num_tokens + 1)
            # 3. the draft loop from every guess at once
            budgets = [self.current[asked[k][1]].budget for k, _, _, _ in plans]
            trees = self.loop.run([g for _, _, g, _ in plans], output.logits, output.hidden_states if self.feeds_features
                                  else None, bet_tables, budgets)
            kept: dict[int, list] = {}
            for j, ((k, a, guess, _), tree, budget) in enumerate(zip(plans, trees, budgets)):
                outcome = tuple(self.current[asked[k][1]].path[:a]) + (guess,)
                current = _Current(tree, self.loop.paths[j], self.loop.path_hidden, j, budget)
                kept.setdefault(k, []).append((Bet(outcome, tree), current))
            for k, (position, request_id) in enumerate(asked):
                self.bets[request_id] = kept.get(k, [])
                out[position] = [bet for bet, _ in self.bets[request_id]]
            return out
        finally:
            for table in forks:  # 4.
                kv.release(table)
