"""Overlap (issue 14): while the verifier verifies a tree, the drafter drafts bets, the trees it would
propose next for the likely outcomes. A bet must be exactly the tree the drafter would draft once its
outcome came true (for a drafter fed tokens alone), drafting bets must leave the drafter's own state as
it was, and the KV forks they draft in must share whole pages and copy the partial one."""

from __future__ import annotations

import time

import torch

from splitspec.demo import demo_model_dirs
from splitspec.drafter_svc.base import Bet
from splitspec.drafter_svc.standalone import StandaloneDrafter
from splitspec.runtime.config import ModelConfig
from splitspec.runtime.kv_cache import BlockTable, KVCache
from splitspec.runtime.runner import ModelRunner, RuntimeConfig
from splitspec.runtime.tree import DraftTree, leaf_outcomes


def test_a_kv_fork_shares_whole_pages_and_copies_the_partial_one():
    config = ModelConfig.from_dir(demo_model_dirs()["target"])
    kv = KVCache(config, num_pages=8, page_size=4, dtype=torch.float32, device="cpu")
    table = BlockTable()
    kv.reserve(table, 10)
    kv.set_length(table, 10)
    for layer in kv.layers:  # distinct values per slot
        layer.copy_(torch.randn_like(layer))
    fork = kv.fork(table, 10)
    assert fork.pages[:2] == table.pages[:2] and fork.pages[2] != table.pages[2]
    assert all(kv.allocator.refcount(p) == 2 for p in table.pages[:2]) and kv.allocator.refcount(table.pages[2]) == 1
    for layer in range(kv.num_layers):
        k, v = kv.flat_kv(layer)
        for a, b in ((kv.slot_ids(table, 0, 10), kv.slot_ids(fork, 0, 10)),):
            assert torch.equal(k[a], k[b]) and torch.equal(v[a], v[b])
    kv.reserve(fork, 14)  # the fork writes past 10 on pages of its own
    assert set(fork.pages[2:]).isdisjoint(table.pages)
    kv.release(fork)
    assert all(kv.allocator.refcount(p) == 1 for p in table.pages) and kv.allocator.num_used == len(table.pages)
    shorter = kv.fork(table, 8)  # on a page boundary: nothing to copy
    assert shorter.pages == table.pages[:2] and kv.allocator.num_used == len(table.pages)
    kv.release(shorter)


def test_standalone_bets_are_the_trees_drafted_after_their_outcomes():
    """Bets for every accept length along the draft's best path (and second guesses): each bet's tree
    equals what the drafter drafts for a request whose sequence already grew by the bet's outcome, and the
    request's own KV and next tree are untouched by the betting."""
    draft_dir = demo_model_dirs()["draft"]
    prompts = [[13, 290, 350, 13, 290, 351, 13, 600], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]]
    for topk, steps, tokens in ((1, 3, 4), (2, 3, 6)):
        runner = ModelRunner.load(RuntimeConfig(model_path=str(draft_dir), dtype="float32", device="cpu", max_total_tokens=4096))
        drafter = StandaloneDrafter(runner, topk=topk, num_steps=steps, num_draft_tokens=tokens)
        for i, prompt in enumerate(prompts):
            drafter.open(f"r{i}", prompt)
        trees = drafter.draft(["r0", "r1"], [tokens, tokens])
        pages_before = runner.kv_cache.allocator.num_used
        lengths = [drafter.tables[r].num_tokens for r in ("r0", "r1")]
        bets = drafter.draft_bets(["r0", "r1"], 2 * (steps + 1))
        assert runner.kv_cache.allocator.num_used == pages_before, "bets must release their forks"
        assert [drafter.tables[r].num_tokens for r in ("r0", "r1")] == lengths
        for i, (prompt, tree, request_bets) in enumerate(zip(prompts, trees, bets)):
            assert len(request_bets) >= steps, (topk, i, request_bets)  # one per accept length at least
            outcomes = [b.outcome for b in request_bets]
            assert len(set(outcomes)) == len(outcomes), outcomes
            for k, bet in enumerate(request_bets):
                assert bet.tree.tokens[0] == bet.outcome[-1]
                # the accepted part is a path of the tree being verified, from its root
                assert list(bet.outcome[:-1]) in [p[: len(bet.outcome) - 1] for p in leaf_outcomes(tree)], bet
                fresh = f"f{i}-{k}"
                drafter.open(fresh, prompt + list(bet.outcome))
                again = drafter.draft([fresh], [tokens])[0]
                drafter.release(fresh)
                assert again.tokens == bet.tree.tokens and again.parents == bet.tree.parents, (topk, i, k)
        # the real next tree after betting is the tree drafted without betting
        assert drafter.draft(["r0"], [tokens])[0].tokens == trees[0].tokens
        drafter.take_bet("r0", 0)  # its bet came true: the next bets follow that bet's tree
        drafter.extend("r0", list(bets[0][0].outcome))
        follow = drafter.draft_bets(["r0"], steps + 1)[0]
        assert follow and all(list(b.outcome[:-1]) in [p[: len(b.outcome) - 1] for p in leaf_outcomes(bets[0][0].tree)]
                              for b in follow)
        for r in ("r0", "r1"):
            drafter.release(r)
        assert runner.kv_cache.allocator.num_used == 0


class ScriptedDrafter:
    """A DrafterPool with overlap on (2 bets per request) and one drafter scripted by the test over a real
    ZeroMQ DEALER socket, registered (capacity 64, 8 nodes, bets) before the test speaks."""

    def __init__(self):
        import socket as sockets

        import zmq
        from prometheus_client import CollectorRegistry

        from splitspec.drafter_svc import convert
        from splitspec.verifier_svc.drafter_pool import DrafterPool
        from splitspec.verifier_svc.metrics import PoolMetrics

        self.convert = convert
        with sockets.socket() as s:
            s.bind(("127.0.0.1", 0))
            address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        self.registry = CollectorRegistry()
        self.pool = DrafterPool(address, "NGRAM", 1000, timeout=5.0, heartbeat_timeout=30.0,
                                metrics=PoolMetrics(self.registry, "m"), overlap="on", num_bets=2)
        self.dealer = zmq.Context.instance().socket(zmq.DEALER)
        self.dealer.connect(address)
        self.session = 0
        self.send(register=convert.register("NGRAM", "", 1000, [], 64, 8, bets=True))
        self.session = self.receive("register_reply").register_reply.session
        assert self.pool.wait_for_drafters(1, 5.0)

    def send(self, **kind):
        self.dealer.send(self.convert.envelope("scripted", 7, self.session, **kind).SerializeToString())

    def receive(self, kind):
        from splitspec.protos import step_pb2

        assert self.dealer.poll(5000), f"no {kind} came"
        message = step_pb2.VerifierMessage.FromString(self.dealer.recv_multipart()[0])
        return message if message.WhichOneof("kind") == kind else self.receive(kind)

    def dropped(self, reason):
        return self.registry.get_sample_value("splitspec:drafter_drafts_dropped_total",
                                              {"drafter": "scripted", "reason": reason, "model_name": "m"}) or 0

    def close(self):
        self.dealer.close(linger=0)
        self.pool.close()


def test_bets_that_arrive_after_their_request_finished_are_dropped_quietly():
    """A request can finish (or be re-pinned) while its bets are being drafted: bets for it that arrive
    then are discarded, not counted as a drafter's wrong request; bets for a request the step never asked
    about still are. A scripted drafter over a real ZeroMQ socket holds its bets until the request is released."""
    from splitspec.drafter_svc import convert
    from splitspec.verifier_svc.drafter_client import DraftAsk

    scripted = ScriptedDrafter()
    pool, send, receive, dropped = scripted.pool, scripted.send, scripted.receive, scripted.dropped
    try:
        pool.open("r0", [5, 6, 7])
        pool.request([DraftAsk("r0", [], 8)])
        receive("open")
        draft = receive("draft").draft
        assert [a.num_bets for a in draft.asks] == [2]  # overlap on: it asks for bets
        send(draft_reply=convert.draft_reply(draft.step_id, [("r0", DraftTree((7, 8), (-1, 0)))], 0.001, []))
        assert pool.collect(["r0"])["r0"].tokens == (7, 8)
        pool.release("r0")  # finished while its bets are being drafted
        receive("release")
        bet = Bet((8, 9), DraftTree((9, 10), (-1, 0)))
        stranger = Bet((8, 9), DraftTree((9, 10), (-1, 0)))
        send(draft_bets=convert.draft_bets(draft.step_id, [("r0", bet), ("r-never-asked", stranger)], 0.001))
        deadline = time.monotonic() + 5
        while dropped("wrong_request") < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert dropped("wrong_request") == 1  # the stranger; r0's bet was dropped quietly
        assert dropped("late") == dropped("stale") == dropped("invalid_tree") == 0
    finally:
        scripted.close()


def test_a_bet_drafted_for_a_larger_budget_is_filed_and_cut_to_the_budget_of_the_step_it_serves():
    """Bets are drafted while the budget of the step they will serve is not known (an adaptive budget moves):
    a bet larger than the budget of the step that asked for it is not dropped as an invalid tree; when its
    outcome comes true it becomes the next step's tree cut to that step's budget."""
    from splitspec.drafter_svc import convert
    from splitspec.verifier_svc.drafter_client import DraftAsk

    scripted = ScriptedDrafter()
    pool, send, receive, dropped = scripted.pool, scripted.send, scripted.receive, scripted.dropped
    try:
        pool.open("r0", [5, 6, 7])
        pool.request([DraftAsk("r0", [], 4)])  # this step's budget: 4 nodes
        receive("open")
        draft = receive("draft").draft
        send(draft_reply=convert.draft_reply(draft.step_id, [("r0", DraftTree((7, 8, 9, 10), (-1, 0, 1, 2)))], 0.001, []))
        assert pool.collect(["r0"])["r0"].tokens == (7, 8, 9, 10)
        bet = Bet((8, 9), DraftTree((9, 20, 21, 22, 23, 24), (-1, 0, 1, 2, 3, 4)))  # 6 nodes: its last budget's size
        send(draft_bets=convert.draft_bets(draft.step_id, [("r0", bet)], 0.001))
        pool.request([DraftAsk("r0", [8, 9], 3)])  # the outcome came true; the next step's budget is 3
        tree = pool.collect(["r0"])["r0"]
        assert tree.tokens == (9, 20, 21) and tree.parents == (-1, 0, 1)
        assert dropped("invalid_tree") == 0
    finally:
        scripted.close()
