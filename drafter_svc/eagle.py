"""EAGLE (EAGLE-2): an EAGLE head drafting SGLang's dynamic tree from the target's hidden states.

The head (runtime.models.eagle) has its own one-layer paged KV cache. Row p of a request holds token
t[p+1] with the target's hidden state h[p] at position p (REFERENCES §1.4), so the verifier opens a
request with its first token and then sends every later token with the state before it. A draft call:

    1. catch up   forward the rows not yet in the head's KV (committed); the last row holds the root
                  and its output x is the feature of the root's children
    2. steps      runtime.draft_loop: the root row's distribution -> top-K beams, then steps 1..S-1 on the
                  device, each beam node with its parent's output x as feature (the root's children: the
                  root row's x); the best N-1 candidates by probability product make the tree

A verifier in this process may queue step 1 before it knows what it accepted (catch_up_ahead, keep_ahead:
verifier_svc.catch_up_ahead): every verified row of a chain, its root picked on the device.
"""

from __future__ import annotations

import itertools
from collections import deque

import torch

from splitspec.device_profile import phase as device_phase
from splitspec.drafter_svc.base import HiddenStateDrafter
from splitspec.drafter_svc.beam_steps import ModelBets, beam_trees, draft_loop_for, launch_beam_draft
from splitspec.runtime.batch import SequenceInput, device_tensor
from splitspec.runtime.batch_shift import batch_at
from splitspec.runtime.inference import inference
from splitspec.runtime.kv_cache import BlockTable
from splitspec.runtime.launched_draft import LaunchedDraft
from splitspec.runtime.runner import ModelRunner
from splitspec.runtime.tree import DraftTree


class _State:
    __slots__ = ("last_token", "pending_tokens", "pending_hidden", "table", "root_rows", "root_row", "root_logit_rows")

    def __init__(self, first_token: int):
        self.last_token = first_token
        self.pending_tokens: list[int] = []
        self.pending_hidden: list[torch.Tensor] = []
        self.table = BlockTable()
        # the head's output at the root row (after a catch-up): row root_row of the round's gathered roots, taken only
        # when read (a tensor op per request per step otherwise)
        self.root_rows: torch.Tensor | None = None
        self.root_row = 0
        self.root_logit_rows: torch.Tensor | None = None  # the roots' logits beside root_rows, where kept (keep_ahead)

    @property
    def root_feature(self) -> torch.Tensor | None:
        return None if self.root_rows is None else self.root_rows[self.root_row]

    def root_logits(self, model) -> torch.Tensor:
        """The head's distribution at the root [V]: kept with the root, else computed from its feature."""
        if self.root_logit_rows is not None:
            return self.root_logit_rows[self.root_row]
        return model.logits(self.root_feature[None])[0]

    def add(self, tokens: list[int], hidden: torch.Tensor) -> None:
        self.pending_tokens.extend(tokens)
        self.pending_hidden.append(hidden)
        self.last_token = tokens[-1]


class EagleDrafter(ModelBets, HiddenStateDrafter):
    name = "EAGLE"
    state_class = _State
    feeds_features = True
    takes_guides = True  # a constrained request drafts on the host, its candidates masked to its grammar

    def __init__(self, runner: ModelRunner, topk: int, num_steps: int, num_draft_tokens: int,
                 token_map: torch.Tensor | None = None):
        """token_map (FR-Spec, --speculative-token-map): draft over these target ids only (the runner's
        head must already be cut to them)."""
        self.runner, self.topk, self.num_steps, self.num_draft_tokens = runner, topk, num_steps, num_draft_tokens
        self.token_map = token_map
        self.max_catch_up = 2048  # rows per forward when catching up (all requests together)
        # states fed and not yet in the head's KV (drafting off: feeds hand rows over, no draft catches them up), caught
        # up at once past this many bytes in all: a long run without drafts holds a bounded amount of device memory
        # (an 8B EAGLE-3 head's rows are 24 KB each: 64 requests x 1600 steps held 2.4 GB before)
        self.max_pending_bytes = 256 << 20
        self.pending_bytes = 0
        self.pad_catch_ups = "graphs"  # see _padded_round
        self.states: dict[str, _State] = {}
        self.current, self.bets = {}, {}  # overlap (beam_steps.ModelBets)
        self.loop = draft_loop_for(runner, topk, num_steps, num_draft_tokens, token_map, runner.config.hidden_size)
        # catch_up_ahead's (places, roots, logits), oldest first, until kept: two while a device-fed step is in flight
        self._ahead: deque[tuple[dict[str, int], torch.Tensor, torch.Tensor]] = deque()
        self._ahead_run: tuple[list[str], object] | None = None  # its draft loop launched too, until launch() asks

    def extend(self, request_id: str, tokens: list[int], hidden=None) -> None:
        self._ahead_run = None
        super().extend(request_id, tokens, hidden)
        self.pending_bytes += hidden.numel() * hidden.element_size()
        if self.pending_bytes >= self.max_pending_bytes:
            self._catch_up([s for s in self.states.values() if s.pending_tokens])

    def release(self, request_id: str) -> None:
        self._ahead_run = None
        state = self.states.get(request_id)
        if state is not None:
            self.pending_bytes -= sum(h.numel() * h.element_size() for h in state.pending_hidden)
        super().release(request_id)
        self._forget_bets(request_id)

    def _catch_up(self, states: list[_State]) -> dict[int, tuple[torch.Tensor, int]]:
        """Forward every state's rows not yet in the head's KV, in rounds of at most max_catch_up rows in all (a long
        prompt, a re-pin, a wave of prompts that finished prefilling together: each round's activations stay within
        what a prompt chunk's take); {index in states: (its round's root logits [roots, V], its row)} for those that
        had any (a round's roots stay together: a step that catches every request up in one round drafts from them
        as they are).
        A round whose requests add unequal numbers of rows (their accept lengths differ) is padded to the
        longest, where a captured CUDA graph holds that shape: each shorter request repeats its last row, whose
        key lands past its length (never committed, overwritten by its next rows), and its root is read at its
        own last row; so the round replays one graph instead of running eagerly."""
        kv = self.runner.kv_cache
        catch_up = [(i, s) for i, s in enumerate(states) if s.pending_tokens]
        root_logits: dict[int, tuple[torch.Tensor, int]] = {}
        for _, s in catch_up:
            if len(s.pending_hidden) > 1:
                s.pending_hidden = [torch.cat(s.pending_hidden)]
        # host work per round is a few tensor ops for the whole batch, not per request (per-request slicing, padding
        # and root copies were ~10 tensor ops per request each round)
        while catch_up:
            taken, room = [], self.max_catch_up  # rows this round, oldest asks first: one bounded forward's activations
            for _, s in catch_up:
                if room == 0:
                    break
                taken.append(min(len(s.pending_tokens), room))
                room -= taken[-1]
            catch_up, held = catch_up[: len(taken)], catch_up[len(taken):]  # held: the next round's
            q = self._padded_round(taken, catch_up[0][1].pending_hidden[0].shape[-1])
            rows = [s.pending_hidden[0] if n == len(s.pending_tokens) else s.pending_hidden[0][:n]
                    for (_, s), n in zip(catch_up, taken)]
            flat = torch.cat(rows) if len(rows) > 1 else rows[0]
            self.pending_bytes -= flat.numel() * flat.element_size()
            starts = list(itertools.accumulate(taken, initial=0))
            if q:  # each shorter request repeats its last row up to q rows: one gather
                index = [start + min(j, n - 1) for start, n in zip(starts, taken) for j in range(q)]
                features = flat.index_select(0, device_tensor(index, flat.device))
                last_rows = [k * q + n - 1 for k, n in enumerate(taken)]
            else:
                features = flat
                last_rows = [end - 1 for end in starts[1:]]
            sequences = [SequenceInput(s.table, s.pending_tokens[:n] + [s.pending_tokens[n - 1]] * (q - n) if q > n
                                       else s.pending_tokens[:n], logits="all" if q else "last")
                         for (_, s), n in zip(catch_up, taken)]
            if q:  # a captured graph's shape
                output = self.runner.forward(self.runner.batch(sequences), return_hidden=True, features=features)
            else:  # an eager round (any count of rows), padded to a ladder size on a GPU
                output = self.runner.forward_padded(sequences, features, return_hidden=True)
            hidden = output.hidden_states
            done = [k for k, ((_, s), n) in enumerate(zip(catch_up, taken)) if n == len(s.pending_tokens)]
            finished = {}  # k -> its row among the roots of the requests whose last row this round held
            if done:  # the roots' features and logits, gathered together (new tensors: no graph buffer is kept)
                device = hidden.device
                if len(done) == len(taken) and not q and len(set(taken)) == 1:  # n rows each: every n-th is a root
                    feats, logits = hidden.view(len(taken), taken[0], -1)[:, -1], output.logits
                else:
                    roots = device_tensor([last_rows[k] for k in done], device)
                    feats = hidden.index_select(0, roots)
                    logits = output.logits.index_select(0, roots if q else device_tensor(done, device))
                finished = {k: row for row, k in enumerate(done)}
            for k, ((i, s), n) in enumerate(zip(catch_up, taken)):
                kv.set_length(s.table, s.table.num_tokens + n)
                if k in finished:
                    s.root_rows, s.root_row, s.root_logit_rows = feats, finished[k], None
                    root_logits[i] = (logits, finished[k])
                    s.pending_tokens, s.pending_hidden = [], []
                else:
                    s.pending_tokens, s.pending_hidden = s.pending_tokens[n:], [s.pending_hidden[0][n:]]
            catch_up = [(i, s) for i, s in catch_up if s.pending_tokens] + held
        return root_logits

    def _padded_round(self, taken: list[int], width: int) -> int:
        """The rows per request a catch-up round is padded to (0: not padded). pad_catch_ups "graphs": where
        the rounds' counts differ and a captured graph of chains of the longest, fed features this wide, holds
        the batch; "always" (tests: the padding path on a CPU); "never"."""
        if self.pad_catch_ups == "never" or len(set(taken)) == 1:
            return 0
        q = max(taken)
        if self.pad_catch_ups == "always":
            return q
        graphs = self.runner.graphs
        if graphs is None or not graphs.has(q, width, len(taken)):
            return 0
        kv = self.runner.kv_cache  # the padding's rows need room too
        return q if kv.allocator.num_free >= len(taken) * kv.pages_for(q) else 0

    def _root_logits(self, states: list[_State]) -> list[torch.Tensor]:
        """Each (caught-up or catching-up) state's root logits."""
        computed = self._catch_up(states)
        return [computed[i][0][computed[i][1]] if i in computed else s.root_logits(self.runner.model)
                for i, s in enumerate(states)]

    def _bet_roots(self, request_ids: list[str]):
        states = [self.states[r] for r in request_ids]
        return [(s.table, logits, s.root_feature) for s, logits in zip(states, self._root_logits(states))]

    def _asked_roots(self, request_ids: list[str], max_nodes: list[int]):
        """The catch-up of every asked request, then (index, state, budget) of those that draft and their root logits
        [B, V] and features [B, H] (None, None, None when none drafts)."""
        asked = [(i, self.states[r], min(self.num_draft_tokens, b)) for i, (r, b) in enumerate(zip(request_ids, max_nodes))
                 if self.states[r].pending_tokens or (b >= 2 and self.states[r].root_feature is not None)]
        # rows not yet in the head's KV, for every asked request in one batch (a budget below 2 only catches up)
        with device_phase("draft.catch_up"):
            computed = self._catch_up([s for _, s, _ in asked])
        asked = [(i, s, b, computed.get(j)) for j, (i, s, b) in enumerate(asked) if b >= 2]
        if not asked:
            return None, None, None
        with device_phase("draft.root_logits"):
            logits, features = _roots(asked, self.runner.model)
        return [(i, s, b) for i, s, b, _ in asked], logits, features

    @inference
    def draft(self, request_ids: list[str], max_nodes: list[int], guides: list | None = None) -> list[DraftTree | None]:
        """guides: per request a grammar guide or None (takes_guides): a guided request drafts on the host, its
        candidates masked to its grammar at every step (beam_steps.beam_trees)."""
        out: list[DraftTree | None] = [None] * len(request_ids)
        asked, logits, features = self._asked_roots(request_ids, max_nodes)
        if not asked:
            return out
        states = [s for _, s, _ in asked]
        budgets = [b for _, _, b in asked]
        with device_phase("draft.loop"):
            trees = beam_trees(self, [request_ids[i] for i, _, _ in asked], [s.last_token for s in states], logits,
                               [s.table for s in states], budgets, features,
                               [guides[i] for i, _, _ in asked] if guides else None)
        for (i, _, _), tree in zip(asked, trees):
            out[i] = tree
        return out

    @inference
    def launch(self, request_ids: list[str], max_nodes: list[int]) -> LaunchedDraft:
        """draft() queued on the device (runtime.launched_draft): the catch-up and the draft loop launched, the trees
        finished when asked; a top-1 draft's chains readable on the device meanwhile."""
        if self.loop is None:
            return LaunchedDraft.ready(self.draft(request_ids, max_nodes))
        ahead, self._ahead_run = self._ahead_run, None
        if ahead is not None and ahead[0] == list(request_ids) and all(b >= 2 for b in max_nodes):
            states = [self.states[r] for r in request_ids]  # its loop launched with the catch-up ahead: taken as it is
            return launch_beam_draft(self, len(request_ids), list(range(len(request_ids))), list(request_ids),
                                     [s.last_token for s in states], None, [s.table for s in states],
                                     [min(self.num_draft_tokens, b) for b in max_nodes], None, run=ahead[1])
        asked, logits, features = self._asked_roots(request_ids, max_nodes)
        if not asked:
            return LaunchedDraft.ready([None] * len(request_ids))
        with device_phase("draft.loop"):
            return launch_beam_draft(self, len(request_ids), [i for i, _, _ in asked], [request_ids[i] for i, _, _ in asked],
                                     [s.last_token for _, s, _ in asked], logits, [s.table for _, s, _ in asked],
                                     [b for _, _, b in asked], features)

    @inference
    def catch_up_ahead(self, request_ids: list[str], lengths: list[int], tokens: torch.Tensor, features: torch.Tensor,
                       acceptance: torch.Tensor, verified: torch.Tensor | None = None) -> bool:
        """The catch-up of a step's verified chains queued before their acceptance reaches the host: tokens [B, n]
        the target's own token at each chain row, features [B * n, W] those rows' states, acceptance [3, B] each
        chain's accepted drafts, accepted row among the B * n and length after acceptance (kernels.chain_acceptance),
        all on the device; lengths: each request's verified length (its root's position).
        Row j pairs the target's token at verified row j with that row's state: for every row up to the bonus token
        it is the pair the accepted path would send (an accepted draft is the target's token there, and so is the
        bonus token). So all n rows are caught up, and each root (the head's output and logits at its accepted row)
        is gathered on the device; keep_ahead commits the accepted rows. The rows past them hold keys beyond the
        head's length, never read and overwritten by the next catch-up, as a padded round's are. False, with nothing
        queued, unless every request is caught up to its verified length with nothing pending, a captured graph
        holds the batch (on a GPU) and its pages are free.
        verified [B] (the device-fed step, verifier_svc.device_fed): the verified lengths are on the device only, the
        step before's acceptance not yet kept here; lengths are their upper bounds, the batch is built there and moved
        back on the device (runtime.batch_shift)."""
        states = [self.states.get(r) for r in request_ids]
        if any(s is None or s.pending_tokens or (s.table.num_tokens != length if verified is None else
                                                  s.table.num_tokens > length) for s, length in zip(states, lengths)):
            return False
        count, n = tokens.shape
        graphs = self.runner.graphs
        if self.runner.cuda_graph_max_bs and (graphs is None or not graphs.has(n, features.shape[-1], count)):
            return False  # an eager forward at a row count not seen costs more host time than this saves
        kv = self.runner.kv_cache
        if kv.allocator.num_free < sum(max(kv.pages_for(length + n) - len(s.table.pages), 0)
                                       for s, length in zip(states, lengths)):
            return False
        # built at the lengths given (the upper ones where verified moves them back)
        batch = batch_at(self.runner, [SequenceInput(s.table, [s.last_token] * n, logits="all") for s in states],
                         lengths, verified)
        batch.adopt_ids(tokens.reshape(-1).to(batch.host_ids.dtype))
        # the graph's own outputs, not copies: read by the gathers queued right behind it
        output = self.runner.forward(batch, return_hidden=True, features=features, borrow=True)
        rows = acceptance[1]
        roots, logits = output.hidden_states.index_select(0, rows), output.logits.index_select(0, rows)
        self._ahead.append(({r: k for k, r in enumerate(request_ids)}, roots, logits))
        # the next draft too, for the same requests at the same budget (launch() takes it if the next ask is that)
        self._ahead_run = None
        if self.loop is not None:
            tables = [s.table for s in states]
            run = self.loop.launch_ahead(logits, roots, tables, [length + n for length in lengths], acceptance[2],
                                         [min(self.num_draft_tokens, n)] * count)
            self._ahead_run = None if run is None else (list(request_ids), run)
        return True

    def launched_ahead(self, request_ids: list[str]) -> bool:
        """Whether the draft loop launched with the last catch-up ahead is these requests' next draft (launch takes
        it)."""
        return self._ahead_run is not None and self._ahead_run[0] == list(request_ids)

    def keep_ahead(self, kept: dict[str, list[int]]) -> None:
        """What acceptance kept of the oldest catch_up_ahead not yet kept: each listed request's accepted tokens (its
        accepted drafts and the bonus token) as its next rows, its root the one gathered at its accepted row. A request
        not listed (finished) keeps nothing. That catch-up ahead is spent either way. While a later one is queued (a
        device-fed step's), the pages past the kept rows stay: that catch-up writes there."""
        if not self._ahead:
            raise RuntimeError("keep_ahead without a catch-up ahead")
        places, features, logits = self._ahead.popleft()
        later = bool(self._ahead)
        kv = self.runner.kv_cache
        for request_id, tokens in kept.items():
            s = self.states[request_id]
            length = s.table.num_tokens + len(tokens)
            if later:
                kv.commit(s.table, length)
            else:
                kv.set_length(s.table, length)
            s.last_token = tokens[-1]
            s.root_rows, s.root_logit_rows, s.root_row = features, logits, places[request_id]


def _roots(asked: list, model) -> tuple[torch.Tensor, torch.Tensor]:
    """(root logits [B, V], root features [B, H]) of the asked (index, state, budget, (round's logits, row) or None):
    the round's own tensors when one catch-up round (or one catch-up ahead, kept) held every asked request's root, in
    order (a step's usual case: no per-request op); else stacked per request."""
    first, features = asked[0][3], asked[0][1].root_rows
    kept = asked[0][1].root_logit_rows
    logits = first[0] if first is not None else kept
    if logits is not None and logits.shape[0] == len(asked) and all(
            s.root_rows is features and s.root_row == k and (c[0] is logits if c is not None else s.root_logit_rows is logits)
            and (c is None or c[1] == k) for k, (_, s, _, c) in enumerate(asked)):
        return logits, features
    logits = torch.stack([c[0][c[1]] if c is not None else s.root_logits(model) for _, s, _, c in asked])
    return logits, torch.stack([s.root_feature for _, s, _, _ in asked])
