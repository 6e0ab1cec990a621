"""NGRAM drafting against SGLang's golden trees (test_ngram_cache.py / test_ngram_corpus.py).

SGLang emits a tree's nodes in libstdc++ unordered_map iteration order, an implementation artefact;
the tree itself (which token follows which) is the contract, so trees are compared as their sets of
root-to-node token paths."""

from __future__ import annotations

import pytest

import random

from splitspec.drafter_svc.ngram import NgramConfig, NgramDrafter, NgramTrie, draft_from_context
from splitspec.drafter_svc.ngram_native import NativeNgramTrie, native_available
from splitspec.runtime.tree import path_to

# the C trie and its Python twin; CI has a C compiler, so the C one must build there (not skipped quietly)
TRIES = [NgramTrie, NativeNgramTrie]

SGLANG_PARAMS = dict(branch_length=12, min_match_window_size=1, max_match_window_size=10, min_bfs_breadth=1,
                     max_bfs_breadth=8, capacity=100000)
DRAFT_TOKEN_NUM = 8
SEED = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 44, 55, 66, 77, 88, 99, 100]]
QUERY = [[1, 2, 3], [3, 44], [3, 6, 999]]
M0 = [[1, 0, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0, 0, 0], [1, 1, 0, 1, 0, 0, 0, 0],
      [1, 0, 1, 0, 1, 0, 0, 0], [1, 1, 0, 1, 0, 1, 0, 0], [1, 0, 1, 0, 1, 0, 1, 0], [1, 0, 1, 0, 1, 0, 1, 1]]
M1 = [[1, 0, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0],
      [1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1, 0], [1, 0, 0, 0, 0, 0, 0, 1]]
M2 = [[1] + [0] * 7] + [[1] + [0] * (i - 1) + [1] + [0] * (7 - i) for i in range(1, 8)]
EXPECTED = {
    "BFS": [([3, 4, 44, 5, 55, 6, 66, 77], M0), ([44, 55, 66, 77, 88, 99, 100, 0], M1), ([999, 0, 0, 0, 0, 0, 0, 0], M2)],
    "PROB": [([3, 44, 4, 55, 5, 66, 6, 7], M0), ([44, 55, 66, 77, 88, 99, 100, 0], M1), ([999, 0, 0, 0, 0, 0, 0, 0], M2)],
}


def sglang_paths(ids: list[int], mask: list[list[int]]) -> set[tuple[int, ...]]:
    """Root-to-node token paths of SGLang's (ids, ancestor mask), padding rows (id 0 seeing only the
    root and itself, beyond the real nodes) dropped."""
    paths = set()
    for i, row in enumerate(mask):
        ancestors = [j for j in range(len(row)) if row[j]]
        if i > 0 and ids[i] == 0 and ancestors == [0, i]:
            continue
        paths.add(tuple(ids[j] for j in ancestors))
    return paths


def our_paths(tree) -> set[tuple[int, ...]]:
    if tree is None:
        return set()
    return {tuple(tree.tokens[j] for j in path_to(tree.parents, i)) for i in range(tree.num_nodes)}


def test_the_c_trie_builds_and_is_the_default():
    assert native_available()
    assert isinstance(NgramDrafter().trie, NativeNgramTrie)


@pytest.mark.parametrize("trie_class", TRIES)
@pytest.mark.parametrize("match_type", ["BFS", "PROB"])
def test_sglang_golden_trees(match_type, trie_class):
    trie = trie_class(NgramConfig(match_type=match_type, **SGLANG_PARAMS))
    for sequence in SEED:
        trie.insert_window(sequence)
    for query, (ids, mask) in zip(QUERY, EXPECTED[match_type]):
        tree = draft_from_context(trie, query, DRAFT_TOKEN_NUM)
        expected = sglang_paths(ids, mask)
        if len(expected) == 1:  # only the root: SGLang pads, we propose nothing
            assert tree is None
        else:
            assert our_paths(tree) == expected, (query, tree)


@pytest.mark.parametrize("trie_class", TRIES)
def test_recency_decides_bfs_and_frequency_decides_prob(trie_class):
    small = dict(min_bfs_breadth=1, max_bfs_breadth=1, max_match_window_size=3, branch_length=5)
    bfs = trie_class(NgramConfig(match_type="BFS", **small))
    bfs.insert_window([1, 2, 3, 10, 11])
    bfs.insert_window([1, 2, 3, 20, 21])
    assert draft_from_context(bfs, [1, 2, 3], 2).tokens[1] == 20
    prob = trie_class(NgramConfig(match_type="PROB", **small))
    for _ in range(10):
        prob.insert_window([1, 2, 3, 20, 21])
    prob.insert_window([1, 2, 3, 10, 11])  # most recent, but rarer
    assert draft_from_context(prob, [1, 2, 3], 2).tokens[1] == 20
    assert draft_from_context(bfs, [999, 888, 777], 8) is None


@pytest.mark.parametrize("trie_class", TRIES)
def test_capacity_evicts_least_recent_leaves(trie_class):
    trie = trie_class(NgramConfig(capacity=12, branch_length=4, max_match_window_size=3))
    trie.insert_window([1, 2, 3, 4, 5])
    trie.insert_window([7, 8, 9, 7, 8, 9])
    assert trie.num_nodes <= 12
    assert draft_from_context(trie, [7, 8], 4) is not None  # the recent path survives


def test_drafter_follows_a_request():
    drafter = NgramDrafter(NgramConfig(max_match_window_size=4))
    drafter.open("a", [5, 6, 7, 8, 5, 6])
    assert drafter.draft(["a"], [4])[0] is None  # a prompt is context only (SGLang inserts no prompt)
    drafter.extend("a", [7, 8, 5])  # accepted drafts and bonus: the window [5, 6, 7, 8, 5, 6, 7, 8, 5]
    assert drafter.draft(["a"], [3])[0] is None  # the newest ask's window waits for the next draft (asynchronous insert)
    drafter.extend("a", [6])
    tree = drafter.draft(["a"], [4])[0]
    assert tree.tokens[:3] == (6, 7, 8)
    drafter.release("a")
    assert "a" not in drafter.contexts
    with pytest.raises(ValueError, match="match-type"):
        NgramConfig(match_type="DFS")


@pytest.mark.parametrize("match_type", ["BFS", "PROB"])
@pytest.mark.parametrize("capacity", [10_000_000, 300])
def test_the_c_trie_drafts_the_python_twins_trees(match_type, capacity):
    """Random traffic over a small vocabulary (wide branching, frequency ties), with and without eviction: the
    C trie's every tree equals the Python trie's, node for node and in order, and so does its size; so do a batch's
    trees drafted in one call."""
    rng = random.Random(f"{match_type}{capacity}")
    config = NgramConfig(match_type=match_type, capacity=capacity, max_match_window_size=6, branch_length=9,
                         min_bfs_breadth=1, max_bfs_breadth=5)
    twin, native = NgramTrie(config), NativeNgramTrie(config)
    text = [rng.randrange(12) for _ in range(400)]
    drafted = 0
    for step in range(300):
        start = rng.randrange(len(text) - 12)
        windows = [text[start : start + rng.randint(1, 12)] if rng.random() < 0.8
                   else [rng.randrange(12) for _ in range(rng.randint(1, 12))] for _ in range(rng.randint(1, 3))]
        twin.insert_windows(windows)
        native.insert_windows(windows)
        assert native.num_nodes == twin.num_nodes
        contexts, budgets, trees = [], (2, 5, 12, 40, 1), []
        for budget in budgets:
            context = text[rng.randrange(len(text) - 8):][: rng.randint(1, 8)]
            expected = draft_from_context(twin, context, budget)
            assert draft_from_context(native, context, budget) == expected, (step, context, budget)
            drafted += expected is not None
            contexts.append(context)
            trees.append(expected)
        # a step's batch in one call: the same trees (budget 1: none)
        assert native.draft_batch(contexts, list(budgets)) == trees == twin.draft_batch(contexts, list(budgets))
    assert twin.num_nodes <= capacity
    assert drafted > 500  # the traffic exercised the trees, not only empty drafts
