"""vLLM's and SGLang's sampling extensions in the verifier: min_p and min_tokens, on the demo target, lossless under
speculation (NGRAM trees, BFS and PROB, greedy and seeded), drafts accepted; min_p's rule against the probabilities."""

from __future__ import annotations

import math

import pytest
import torch
import test_penalties
from test_speculative import ngram, run

from splitspec.runtime.sampling import process_logits
from splitspec.runtime.sampling_params import SamplingParams
from splitspec.verifier_svc.engine import SpecConfig

NEW_TOKENS = 32
demo = test_penalties.demo  # the fixture: the demo target, its prompts, a transformers twin


def assert_lossless(runner, prompts, params) -> list:
    """Plain decoding's outputs; NGRAM's (BFS and PROB trees) equal them, drafts accepted, no fallbacks."""
    plain = run(runner, prompts, params)
    accepted = 0
    for drafter in (ngram("BFS"), ngram("PROB")):
        spec = run(runner, prompts, params, drafter, SpecConfig(num_draft_tokens=8))
        assert [s.output_ids for s in spec] == [p.output_ids for p in plain]
        assert all(s.stats.fallbacks == 0 for s in spec) and sum(s.stats.draft_tokens for s in spec) > 0
        accepted += sum(s.stats.accepted_tokens for s in spec)
    assert accepted > 0
    return plain


def test_min_p_keeps_tokens_at_least_min_p_times_the_most_likely():
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    temperature, min_p = 0.7, torch.tensor([0.0, 0.05, 0.3, 1.0])
    args = torch.full((4,), temperature), torch.full((4,), -1), torch.full((4,), 0.9)
    processed, before = process_logits(logits, *args, min_p), process_logits(logits, *args)
    probs = (logits / temperature).softmax(-1)
    for row in range(4):  # after top-p (0.9 here), the tokens at least min_p x the most likely one's probability
        kept = torch.isfinite(before[row]) & (probs[row] >= min_p[row] * probs[row].max() * (1 - 1e-5))
        assert torch.equal(torch.isfinite(processed[row]), kept), row
    assert torch.isfinite(processed[3]).sum() == 1  # min_p 1: only the most likely token
    assert math.isinf(process_logits(torch.tensor([[0.0, -5.0]]), torch.ones(1), torch.full((1,), -1), torch.ones(1),
                                     torch.tensor([0.01]))[0, 1])  # e^-5 < 0.01


def test_min_p_sampling_is_lossless_and_min_p_one_is_greedy(demo):
    runner, prompts, _ = demo
    sampled = [SamplingParams(temperature=1.0, seed=11 + i, max_new_tokens=NEW_TOKENS, ignore_eos=True, min_p=0.1)
               for i in range(len(prompts))]
    with_min_p = assert_lossless(runner, prompts, sampled)
    without = run(runner, prompts, [SamplingParams(temperature=1.0, seed=11 + i, max_new_tokens=NEW_TOKENS,
                                                   ignore_eos=True) for i in range(len(prompts))])
    assert any(a.output_ids != b.output_ids for a, b in zip(with_min_p, without))  # min_p changed the samples
    greedy = run(runner, prompts, [SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)]
                 * len(prompts))
    only_top = assert_lossless(runner, prompts, [SamplingParams(temperature=1.0, seed=5 + i, max_new_tokens=NEW_TOKENS,
                                                                ignore_eos=True, min_p=1.0) for i in range(len(prompts))])
    assert [r.output_ids for r in only_top] == [r.output_ids for r in greedy]
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.5)


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.8, top_p=0.95)], ids=["greedy", "seeded"])
def test_min_tokens_holds_back_the_stop_tokens_and_speculation_is_lossless(demo, sampling):
    """Each request's third free-running token is made its stop token: without min_tokens the request ends there;
    with min_tokens 12 that token never appears among the first 12, and the request ends at its first later
    occurrence (or at max_new_tokens); with NGRAM drafts (which know nothing of it) the outputs are plain's."""
    runner, prompts, _ = demo

    def params(i, **extra):
        seed = {"seed": 21 + i} if sampling["temperature"] else {}
        return SamplingParams(**sampling, **seed, max_new_tokens=NEW_TOKENS, ignore_eos=True, **extra)

    free = run(runner, prompts, [params(i) for i in range(len(prompts))])
    stops = [r.output_ids[2] for r in free]
    short = run(runner, prompts, [params(i, stop_token_ids=(stops[i],)) for i in range(len(prompts))])
    assert all(len(r.output_ids) <= 3 and r.output_ids[-1] == stops[i] for i, r in enumerate(short))
    held = assert_lossless(runner, prompts, [params(i, stop_token_ids=(stops[i],), min_tokens=12)
                                             for i in range(len(prompts))])
    for i, r in enumerate(held):
        assert len(r.output_ids) >= 12 and stops[i] not in r.output_ids[:12], (i, r.output_ids)
        assert r.output_ids[-1] == stops[i] or len(r.output_ids) == NEW_TOKENS
        assert stops[i] not in r.output_ids[:-1]  # it ended at the first stop token it was allowed
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_new_tokens=4, min_tokens=5)
