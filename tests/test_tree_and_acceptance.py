"""Tree index math and acceptance rules on tiny arrays, with SGLang's golden vectors (REFERENCES §3)."""

from __future__ import annotations

import pytest
import torch

from splitspec.runtime.tree import (DraftTree, child_links, depths, parents_from_mask, parents_from_selection, path_to,
                                    positions, tree_mask)
from splitspec.verifier_svc.acceptance import accept_target_tokens, accept_with_coins, inverse_cdf_sample

# sgl-kernel/tests/speculative/test_eagle_utils.py (REFERENCES §3.3): two requests of 6 nodes
CANDIDATES = [[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]]
NEXT_TOKEN = [[1, 2, -1, 4, 5, -1], [4, 2, 3, -1, 5, -1]]
NEXT_SIBLING = [[-1, 3, -1, -1, -1, -1], [-1, -1, -1, -1, 1, -1]]
TARGET_ARGMAX = [[3, 18, 18, 4, 5, 18], [11, 18, 18, 18, 12, 18]]
NUM_SPEC_STEP = 4  # accept_index has this many columns: the root plus up to 3 drafts


def as_sglang(results, num_nodes: int = 6):
    """Our per-request results in SGLang's flat layout: predicts [bs*N], accept_index [bs, S], accept_num."""
    predicts = [-1] * (num_nodes * len(results))
    accept_index, accept_num = [], []
    for b, result in enumerate(results):
        for node, token in zip(result.path, result.tokens):
            predicts[b * num_nodes + node] = token
        row = [b * num_nodes + node for node in result.path]
        accept_index.append(row + [-1] * (NUM_SPEC_STEP - len(row)))
        accept_num.append(result.num_accepted)
    return predicts, accept_index, accept_num


def test_tree_index_math_worked_example():
    parents = [-1, 0, 0, 1, 1]
    assert depths(parents) == [0, 1, 1, 2, 2]
    assert positions(parents, seq_len=7) == [7, 8, 8, 9, 9]
    assert child_links(parents) == ((1, 3, -1, -1, -1), (-1, 2, -1, 4, -1))
    assert tree_mask(parents).int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 0, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 1, 0, 0, 1],
    ]
    assert path_to(parents, 4) == [0, 1, 4]
    assert DraftTree.chain(9, [4, 5]).parents == (-1, 0, 1)
    with pytest.raises(ValueError, match="do not have a parent before them"):
        DraftTree((1, 2, 3), (-1, 2, 0))
    with pytest.raises(ValueError, match="root"):
        DraftTree((1,), (0,))


def test_build_eagle_tree_golden():
    """test/srt/test_build_eagle_tree.py: K=4, S=4, N=8, seq_lens [5, 10]; tokens and bookkeeping as
    organize_draft_results leaves them (flattened parent lists, sorted top-7 flat indices)."""
    verified_id = [29974, 13]
    parent_list = [[-1, 0, 1, 2, 3, 4, 8, 9, 10, 20, 24, 21, 28], [-1, 0, 1, 2, 3, 4, 5, 6, 7, 24, 28, 20, 21]]
    selected_index = [[0, 1, 4, 8, 20, 24, 36], [0, 4, 5, 6, 7, 24, 36]]
    drafts = [[29896, 29906, 29889, 29974, 29946, 29896, 29946], [13, 22550, 4136, 16492, 8439, 29871, 29941]]
    all_positions, draft_tokens, next_tokens, next_siblings = [], [], [], []
    for b, seq_len in enumerate([5, 10]):
        tree = DraftTree(tuple([verified_id[b], *drafts[b]]), tuple(parents_from_selection(selected_index[b], parent_list[b], 4)))
        all_positions += positions(tree.parents, seq_len)
        draft_tokens += tree.tokens
        next_token, next_sibling = child_links(tree.parents)
        next_tokens.append(list(next_token))  # child_links gives tuples (one pair per shape, shared)
        next_siblings.append(list(next_sibling))
    assert all_positions == [5, 6, 6, 7, 7, 8, 8, 9, 10, 11, 12, 12, 12, 12, 13, 14]
    assert next_tokens == [[1, 3, 4, 5, 6, 7, -1, -1], [1, 2, -1, 6, -1, -1, 7, -1]]
    assert next_siblings == [[-1, 2, -1, -1, -1, -1, -1, -1], [-1, -1, 3, 4, 5, -1, -1, -1]]
    assert draft_tokens == [29974, 29896, 29906, 29889, 29974, 29946, 29896, 29946,
                            13, 13, 22550, 4136, 16492, 8439, 29871, 29941]


def test_build_tree_hand_case_and_mask_reconstruction():
    # test/srt/cpu/test_spec_kernels.py: topk 2, steps 2, n 4
    parents = parents_from_selection([0, 1, 2], [-1, 0, 1], topk=2)
    assert child_links(parents) == ((1, 3, -1, -1), (-1, 2, -1, -1))
    assert positions(parents, 5) == [5, 6, 6, 7]
    assert tree_mask(parents).int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    # sgl-kernel/tests/speculative/test_ngram_utils.py: reconstruct_indices_from_tree_mask
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    parents = parents_from_mask(mask)
    assert child_links(parents) == ((1, -1, 3, -1), (-1, 2, -1, -1))
    assert positions(parents, 12) == [12, 13, 13, 14]
    assert torch.equal(tree_mask(parents), mask)


def test_links_of_the_golden_trees_follow_from_their_parents():
    """SGLang's golden links for request 0 are exactly what child_links derives (lowest index first);
    request 1 lists node 4 before node 1 under the root, which the walk honours as given."""
    assert [list(links) for links in child_links([-1, 0, 1, 0, 3, 4])] == [NEXT_TOKEN[0], NEXT_SIBLING[0]]


def test_greedy_verify_golden():
    results = [
        accept_target_tokens(CANDIDATES[b], NEXT_TOKEN[b], NEXT_SIBLING[b], TARGET_ARGMAX[b], NUM_SPEC_STEP - 1)
        for b in range(2)
    ]
    predicts, accept_index, accept_num = as_sglang(results)
    assert predicts == [3, -1, -1, 4, 5, 18, 11, -1, -1, -1, 12, 18]
    assert accept_index == [[0, 3, 4, 5], [6, 10, 11, -1]]
    assert accept_num == [3, 2]


def target_probs(argmax_row: list[int], vocab: int = 20, temperature: float = 0.01) -> torch.Tensor:
    logits = torch.zeros(len(argmax_row), vocab)
    logits[torch.arange(len(argmax_row)), torch.tensor(argmax_row)] = 1.0
    return torch.softmax(logits / temperature, dim=-1)


@pytest.mark.parametrize("thresholds, expected", [
    ((1.0, 1.0), ([3, -1, -1, 4, 5, 18, 11, -1, -1, -1, 12, 18], [[0, 3, 4, 5], [6, 10, 11, -1]], [3, 2])),
    ((0.0, 0.0), ([1, 2, 18, -1, -1, -1, 11, -1, -1, -1, 12, 18], [[0, 1, 2, -1], [6, 10, 11, -1]], [2, 2])),
])
def test_coin_rule_golden(thresholds, expected):
    generator = torch.Generator().manual_seed(0)
    results = []
    for b in range(2):
        coins = torch.rand(6, generator=generator).clamp(min=1e-3).tolist()
        results.append(accept_with_coins(
            CANDIDATES[b], NEXT_TOKEN[b], NEXT_SIBLING[b], target_probs(TARGET_ARGMAX[b]), coins,
            final_coins=[float(torch.rand(1, generator=generator))] * 6, threshold_single=thresholds[0],
            threshold_acc=thresholds[1], max_accepted=NUM_SPEC_STEP - 1,
        ))
    assert as_sglang(results) == expected


def test_coin_rule_bonus_excludes_rejected_siblings():
    """Root's children are tokens 1 and 2, both rejected; the bonus is drawn from the rest only."""
    probs = torch.tensor([[0.1, 0.45, 0.45, 0.0], [0.25] * 4, [0.25] * 4])
    for coin in (0.0, 0.5, 0.999):
        result = accept_with_coins([0, 1, 2], [1, -1, -1], [-1, 2, -1], probs, coins=[1.0, 0.5, 0.5], final_coins=[coin] * 3)
        assert result.path == [0] and result.tokens == [0]


def test_inverse_cdf_sample():
    weights = torch.tensor([0.0, 2.0, 0.0, 1.0, 1.0])
    assert [inverse_cdf_sample(weights, c) for c in (0.0, 0.49, 0.5, 0.74, 0.75, 0.9999)] == [1, 1, 3, 3, 4, 4]


def _toy_model(path: tuple[int, ...], vocab: int = 23) -> torch.Tensor:
    """A fixed, path-dependent next-token distribution (a stand-in for a draft model)."""
    generator = torch.Generator().manual_seed(hash(path) % (2**31))
    return torch.softmax(torch.randn(vocab, generator=generator) * 3, -1)


def _reference_beam_paths(root: int, topk: int, steps: int, n: int) -> dict[tuple[int, ...], float]:
    """REFERENCES §3.1 written out on paths: every scored candidate with its path and score; the best
    n-1 by score are the drafts."""
    pool: list[tuple[float, tuple[int, ...]]] = []
    probs = _toy_model((root,))
    top = probs.topk(topk)
    beams = [(float(p), (t,)) for p, t in zip(top.values.tolist(), top.indices.tolist())]
    pool += beams
    for _ in range(1, steps):
        candidates = []
        for score, path in beams:
            top = _toy_model((root, *path)).topk(topk)
            candidates += [(score * p, (*path, t)) for p, t in zip(top.values.tolist(), top.indices.tolist())]
        pool += candidates
        beams = sorted(candidates, key=lambda c: -c[0])[:topk]
    best = sorted(pool, key=lambda c: -c[0])[: n - 1]
    return {path: score for score, path in best}


@pytest.mark.parametrize("topk,steps,n", [(1, 3, 4), (2, 3, 6), (4, 4, 8), (3, 5, 12), (4, 2, 20)])
def test_beam_draft_builds_sglangs_tree(topk, steps, n):
    from splitspec.runtime.beam_draft import BeamDraft

    root = 5
    beam = BeamDraft(root, topk, steps, n)
    beam.first(_toy_model((root,)))
    while (frontier := beam.beams()) is not None:
        paths = []
        for node in frontier:  # the beam's tokens from the root down
            path = []
            while node != -1:
                path.append(beam.beam_tokens[node])
                node = beam.beam_parents[node]
            paths.append((root, *reversed(path)))
        beam.expand(torch.stack([_toy_model(p) for p in paths]))
    tree = beam.tree()
    got = {}
    for i in range(1, tree.num_nodes):
        got[tuple(tree.tokens[j] for j in path_to(tree.parents, i)[1:])] = tree.scores[i]
    want = _reference_beam_paths(root, topk, steps, n)
    assert set(got) == set(want)
    assert all(abs(got[p] - want[p]) < 1e-6 for p in want)
    assert tree.tokens[0] == root and tree.num_nodes == min(n, topk + (steps - 1) * topk * topk + 1)
