"""Drafts launched on the device and verified before they reach the host (runtime.launched_draft): a launched
EAGLE-3 draft gives the trees draft() gives, its top-1 chains are readable on the device meanwhile, and
write_chains puts them into a batch's rows as the trees say (both of its paths, and the vocabulary clamp)."""

from __future__ import annotations

import pytest
import torch
from test_draft_loading import eagle3_flags

from splitspec.demo import demo_model_dirs
from splitspec.draft_models import build_drafter
from splitspec.runtime.launched_draft import LaunchedDraft, PendingChain, write_chains
from splitspec.runtime.tree import DraftTree
from splitspec.speculation import resolve


def eagle3_drafter(topk: int, steps: int, tokens: int):
    return build_drafter(resolve(eagle3_flags(demo_model_dirs(heads=True)["eagle3"], "--speculative-num-steps", str(steps),
                                              "--speculative-eagle-topk", str(topk),
                                              "--speculative-num-draft-tokens", str(tokens))))


def opened(drafter, lengths: list[int], seed: int) -> list[str]:
    width = drafter.runner.model.fc_input_size
    generator = torch.Generator().manual_seed(seed)
    ids = []
    for i, n in enumerate(lengths):
        drafter.open(f"r{i}", [7 + i])
        drafter.extend(f"r{i}", torch.randint(0, 4096, (n,), generator=generator).tolist(), torch.randn(n, width, generator=generator))
        ids.append(f"r{i}")
    return ids


@pytest.mark.parametrize("topk", [1, 2])
def test_a_launched_draft_gives_the_trees_draft_gives(topk):
    """Two drafters in the same state: one drafts, one launches; the same trees, sizes known at launch, and at top-1
    the chains on the device (row per drafted request) hold each tree's drafts; a request with nothing to draft from
    gets no tree and no row."""
    trees = {}
    for how in ("draft", "launch"):
        drafter = eagle3_drafter(topk, 4, 5)
        ids = opened(drafter, [6, 19, 11], seed=3)
        drafter.open("empty", [9])  # no rows yet: no root feature to draft from
        asked, budgets = ids[:2] + ["empty"] + ids[2:], [5, 3, 5, 5]
        if how == "draft":
            trees[how] = drafter.draft(asked, budgets)
            continue
        launched = drafter.launch(asked, budgets)
        assert launched.sizes == [5, 3, None, 5] and launched.rows == [0, 1, None, 2]
        if topk == 1:
            chains = launched.chain_tokens.tolist()  # before the trees are asked for
            pending = launched.pending()
            assert pending[2] is None and [p.num_nodes for p in pending if p] == [5, 3, 5]
            assert not launched.finished
        else:
            assert launched.chain_tokens is None
        trees[how] = launched.trees()
        if topk == 1:
            for k, i in enumerate((0, 1, 3)):
                tree = trees[how][i]
                assert tree.parents == tuple(range(-1, tree.num_nodes - 1)) and list(tree.tokens[1:]) == chains[k][: tree.num_nodes - 1]
                assert pending[i].resolve(tree.tokens[0], 1 << 20) == DraftTree.chain(tree.tokens[0], list(tree.tokens[1:]), list(tree.scores[1:]))
    assert trees["draft"][2] is None
    assert [(t.tokens, t.parents) if t else None for t in trees["draft"]] == [(t.tokens, t.parents) if t else None for t in trees["launch"]]


def launched_chains(rows: list[list[int]], sizes: list[int], id_bound: int | None = None) -> LaunchedDraft:
    tokens = torch.tensor(rows)
    trees = [DraftTree.chain(0, row[: n - 1]) for row, n in zip(rows, sizes)]
    return LaunchedDraft(lambda: trees, list(range(len(rows))), sizes, tokens, id_bound)


def test_write_chains_puts_each_chain_in_its_rows():
    vocab = 100
    launched = launched_chains([[11, 12, 13], [21, 22, 23], [31, 32, 130]], [4, 4, 4])
    chains = launched.pending()
    # one launch's rows in order, evenly spaced (a padded tree: 5 rows each): the strided copy
    ids = torch.full((15,), -1)
    write_chains(ids, [0, 5, 10], chains, vocab)
    assert ids.tolist() == [-1, 11, 12, 13, -1, -1, 21, 22, 23, -1, -1, 31, 32, 99, -1]
    # after a prompt chunk, out of order, one request without a chain between: index lists
    ids = torch.full((14,), -1)
    write_chains(ids, [3, 10, 6], [chains[1], chains[2], chains[0]], vocab)
    want = [-1] * 14
    want[4:7], want[7:10], want[11:14] = [21, 22, 23], [11, 12, 13], [31, 32, 99]
    assert ids.tolist() == want
    # evenly spaced but the last sequence shorter than the spacing, at the batch's end: index lists, in bounds
    ids = torch.full((14,), -1)  # rows of 5, 5 and 4 tokens: a strided view of 15 would not fit
    write_chains(ids, [0, 5, 10], chains, vocab)
    assert ids.tolist() == [-1, 11, 12, 13, -1, -1, 21, 22, 23, -1, -1, 31, 32, 99]
    # a past-vocabulary draft is read back as written
    assert chains[2].resolve(5, vocab).tokens == (5, 31, 32, 99)
    # a drafter whose ids all fit the vocabulary (its bound at most the vocabulary) is copied as it is, unclamped;
    # one whose bound is past it is clamped, as one with no bound is
    for bound, last in ((vocab, 99), (vocab + 1, 99), (None, 99)):
        fitting = launched_chains([[11, 12, 13], [21, 22, 23], [31, 32, 99 if bound == vocab else 130]], [4, 4, 4], bound)
        ids = torch.full((12,), -1)
        write_chains(ids, [0, 4, 8], fitting.pending(), vocab)
        assert ids.tolist() == [-1, 11, 12, 13, -1, 21, 22, 23, -1, 31, 32, last]


def test_a_chain_whose_drafter_fails_to_finish_is_read_from_the_device(caplog):
    def broken():
        raise ValueError("bookkeeping")

    launched = LaunchedDraft(broken, [0, 1], [3, 3], torch.tensor([[4, 5], [6, 7]]))
    assert launched.pending()[1].resolve(9, 100).tokens == (9, 6, 7)
    assert "read from the device" in caplog.text


def test_a_chain_that_comes_back_as_another_tree_fails_loudly():
    trees = [DraftTree((1, 2, 3), (-1, 0, 0))]  # not the chain the verification was built around
    launched = LaunchedDraft(lambda: trees, [0], [3], torch.tensor([[2, 3]]))
    with pytest.raises(RuntimeError, match="launched chain"):
        launched.pending()[0].resolve(1, 100)
    assert isinstance(launched.pending()[0], PendingChain)


def test_a_launched_standalone_draft_gives_the_trees_draft_gives():
    """The same for a draft LM (STANDALONE) at top-1: equal trees, each chain's drafts on the device at launch."""
    from splitspec.drafter_svc.standalone import StandaloneDrafter
    from splitspec.runtime.runner import ModelRunner, RuntimeConfig

    trees = {}
    for how in ("draft", "launch"):
        runner = ModelRunner.load(RuntimeConfig(model_path=str(demo_model_dirs()["draft"]), dtype="float32", device="cpu",
                                                max_total_tokens=4096, page_size=4))
        drafter = StandaloneDrafter(runner, topk=1, num_steps=3, num_draft_tokens=4)
        generator = torch.Generator().manual_seed(5)
        ids = [f"r{i}" for i in range(3)]
        for i, n in enumerate((5, 17, 9)):
            drafter.open(ids[i], torch.randint(0, 4096, (n,), generator=generator).tolist())
        if how == "draft":
            trees[how] = drafter.draft(ids, [4, 4, 3])
            continue
        launched = drafter.launch(ids, [4, 4, 3])
        assert launched.sizes == [4, 4, 3]
        chains = launched.chain_tokens.tolist()
        trees[how] = launched.trees()
        for k, tree in enumerate(trees[how]):
            assert list(tree.tokens[1:]) == chains[k][: tree.num_nodes - 1]
    assert [(t.tokens, t.parents) for t in trees["draft"]] == [(t.tokens, t.parents) for t in trees["launch"]]


def test_served_top1_drafts_in_the_verifiers_process_equal_plain_over_http():
    """What `splitspec up` runs for EAGLE-3 on a GPU, here on the CPU: the head in the verifier's process
    (--drafters 0) drafting top-1 chains, so every verified draft takes the launched path. Through the gateway with the
    openai client, greedy completions of token prompts equal plain decoding's text, and the responses count drafts
    proposed and accepted; the verifier counts chains its head caught up on ahead; up stops cleanly."""
    from openai import OpenAI
    from test_launcher import Up
    from test_speculative import PROMPTS
    from transformers import AutoTokenizer

    from splitspec.generate import generate_ids
    from splitspec.runtime.runner import ModelRunner, RuntimeConfig
    from splitspec.runtime.sampling_params import SamplingParams

    target_dir = demo_model_dirs()["target"]
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompts = [tokenizer.encode(p) for p in PROMPTS[:4]]
    runner = ModelRunner.load(RuntimeConfig(model_path=str(target_dir), dtype="float32", device="cpu", max_total_tokens=4096))
    params = [SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)]
    plain = [tokenizer.decode(generate_ids(runner, [p], params, set())[0].output_ids, skip_special_tokens=True) for p in prompts]
    up = Up("--drafters", "0", "--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3",
            "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4", "--speculative-adaptive", "off",
            "--served-model-name", "demo", "--log-level", "warning")
    try:
        up.wait_for_line(r"serving demo at ")
        assert [name for name in up.service_pids().values()] == ["verifier", "gateway"]
        client = OpenAI(base_url=up.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        drafted = accepted = 0
        for prompt, want in zip(prompts, plain):
            response = client.completions.create(model="demo", prompt=prompt, max_tokens=24, temperature=0,
                                                 extra_body={"ignore_eos": True})
            assert response.choices[0].text == want and response.usage.completion_tokens == 24
            spec = response.model_extra["speculative"]
            assert spec["algorithm"] == "EAGLE3"
            drafted, accepted = drafted + spec["draft_tokens"], accepted + spec["accepted_tokens"]
        assert drafted > 0 and accepted > 0
        # the head caught up on verified chains before their acceptance reached the host (catch_up_ahead.py)
        import httpx
        metrics = httpx.get(f"http://127.0.0.1:{up.port + 2}/metrics", timeout=10).text
        ahead = [float(line.split()[-1]) for line in metrics.splitlines()
                 if line.startswith("splitspec:spec_catch_up_ahead_requests_total")]
        assert ahead and ahead[0] > 0, metrics
    finally:
        assert up.stop() == 0
