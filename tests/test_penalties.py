"""Penalties and logprobs under speculation.

- vLLM's golden vectors for a frequency penalty with drafts (REFERENCES §4) through our penalised tree
  acceptance;
- the batched per-node penalties equal a per-position reference built by hand from vLLM's formula;
- on the demo target, plain decoding with penalties equals an independent loop (transformers' full
  forward + the formula), and speculative decoding with NGRAM trees (BFS and PROB) equals plain,
  greedy and seeded sampling, with drafts accepted;
- logprobs: the emitted token's and the top-k, equal to transformers' log-softmax at each position,
  the same with speculation on or off.
"""

from __future__ import annotations

import pytest
import torch
from helpers import hf_model
from test_speculative import PROMPTS, ngram, run

from splitspec.demo import demo_model_dirs
from splitspec.runtime.penalties import PenaltyCounts, apply_penalties, path_tokens
from splitspec.runtime.runner import ModelRunner, RuntimeConfig
from splitspec.runtime.sampling_params import SamplingParams
from splitspec.runtime.tree import child_links
from splitspec.verifier_svc.acceptance import accept_target_tokens
from splitspec.verifier_svc.engine import SpecConfig

NEW_TOKENS = 32


def reference_penalties(logits: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams) -> torch.Tensor:
    """vLLM's apply_penalties for one position, written out token by token."""
    logits = logits.clone().float()
    for token in set(prompt) | set(output):
        if logits[token] > 0:
            logits[token] /= params.repetition_penalty
        else:
            logits[token] *= params.repetition_penalty
    for token in set(output):
        logits[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    return logits


def test_vllm_frequency_penalty_golden_vectors():
    """vLLM test_rejection_sampler `test_frequency_penalties`: argmax ids get logit 100, token 15 gets 99
    everywhere; tokens accepted earlier in a row count towards the penalty."""
    spec_tokens = [[1, 1, 1], [], [1, 1, 1]]
    argmax = [[1, 1, 1, 1], [7], [1, 1, 1, 1]]
    prior_outputs = [[2], [3], [4]]
    prompts = [[5, 6, 7], [6, 7, 8], [7, 8, 9]]
    penalties = [1.5, 1.5, 0.7]
    expected = [[1, 15], [7], [1, 1, 15]]  # vLLM's rows without the -1 placeholders
    vocab = 32
    for row in range(3):
        logits = torch.full((len(argmax[row]), vocab), -100.0)
        logits[:, 15] = 99.0
        for i, token in enumerate(argmax[row]):
            logits[i, token] = 100.0
        tokens = [prior_outputs[row][-1], *spec_tokens[row]]  # root = the last output token, then the chain
        parents = [-1, *range(len(spec_tokens[row]))]
        params = SamplingParams(temperature=0.0, frequency_penalty=penalties[row])
        penalised = apply_penalties(logits, params, prompts[row], prior_outputs[row], path_tokens(parents, tokens))
        first_child, next_sibling = child_links(parents)
        acceptance = accept_target_tokens(tokens, first_child, next_sibling, penalised.argmax(-1).tolist())
        assert acceptance.tokens == expected[row], (row, acceptance.tokens)


def test_tree_penalties_equal_per_position_reference():
    torch.manual_seed(0)
    vocab = 50
    tokens = [3, 7, 3, 9, 7, 7, 3, 1]
    parents = [-1, 0, 0, 1, 1, 3, 5, 2]
    prompt, output = [1, 2, 3, 4, 4], [7, 9, 9, 3]
    logits = torch.randn(len(tokens), vocab) * 3
    params = SamplingParams(temperature=0.0, frequency_penalty=0.8, presence_penalty=-0.4, repetition_penalty=1.7)
    got = apply_penalties(logits, params, prompt, output, path_tokens(parents, tokens))
    for node, path in enumerate(path_tokens(parents, tokens)):
        assert torch.allclose(got[node], reference_penalties(logits[node], prompt, output + path, params), atol=1e-5), node
    assert apply_penalties(logits, SamplingParams(), prompt, output) is logits  # off: untouched


def test_running_counts_penalise_as_counting_the_whole_output_each_step():
    """A request's PenaltyCounts, kept across its steps (the verifier's), gives every step's penalised tree the
    logits that counting its whole output (and prompt) afresh gives, as the output grows by several tokens a step."""
    generator = torch.Generator().manual_seed(3)
    vocab, prompt = 40, [1, 2, 3, 4, 4, 39]
    params = SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.4)
    running, output = PenaltyCounts(), []
    parents = [-1, 0, 0, 1, 3]
    for step in range(12):
        tokens = torch.randint(0, vocab, (len(parents),), generator=generator).tolist()
        logits = torch.randn(len(parents), vocab, generator=generator) * 3
        paths = path_tokens(parents, tokens)
        fresh = apply_penalties(logits, params, prompt, output, paths)
        assert torch.equal(apply_penalties(logits, params, prompt, output, paths, running), fresh), step
        output += torch.randint(0, vocab, (1 + step % 3,), generator=generator).tolist()  # the step's accepted tokens
    assert running.counted == len(output) - (1 + 11 % 3)  # brought up to date at each call, not recounted
    assert torch.equal(running.output_counts(output, vocab, "cpu"), torch.bincount(torch.tensor(output), minlength=vocab).float())


@pytest.fixture(scope="module")
def demo():
    from transformers import AutoTokenizer

    target = demo_model_dirs()["target"]
    runner = ModelRunner.load(RuntimeConfig(model_path=str(target), dtype="float32", device="cpu",
                                            max_total_tokens=8 * 160, page_size=16))
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = [tokenizer.encode(p) for p in (PROMPTS[3], PROMPTS[7], PROMPTS[11], PROMPTS[20], PROMPTS[0], PROMPTS[13])]
    return runner, prompts, hf_model(target)


PENALTIES = [dict(frequency_penalty=0.6), dict(presence_penalty=1.0), dict(repetition_penalty=1.3),
             dict(frequency_penalty=0.3, presence_penalty=0.3, repetition_penalty=1.1)]


@pytest.mark.parametrize("penalty", PENALTIES, ids=["frequency", "presence", "repetition", "all"])
def test_greedy_penalties_equal_reference_and_speculation_is_lossless(demo, penalty):
    runner, prompts, reference = demo
    params = [SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True, **penalty)] * len(prompts)
    plain = run(runner, prompts, params)
    unpenalised = run(runner, prompts, [SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)]
                      * len(prompts))
    assert any(p.output_ids != u.output_ids for p, u in zip(plain, unpenalised))  # the penalty changed the text
    for prompt, request in zip(prompts[:3], plain[:3]):  # an independent loop: full forward, the formula, argmax
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(NEW_TOKENS):
                logits = reference(torch.tensor([ids])).logits[0, -1]
                ids.append(int(reference_penalties(logits, prompt, ids[len(prompt):], params[0]).argmax()))
        assert request.output_ids == ids[len(prompt):]
    for drafter in (ngram("BFS"), ngram("PROB")):  # NGRAM trees branch where the trie does
        spec = run(runner, prompts, params, drafter, SpecConfig(num_draft_tokens=8))
        assert [s.output_ids for s in spec] == [p.output_ids for p in plain]
        assert sum(s.stats.accepted_tokens for s in spec) > 0 and all(s.stats.fallbacks == 0 for s in spec)


def test_logit_bias_forces_and_forbids_tokens_and_speculation_is_lossless(demo):
    """OpenAI's logit_bias on the target's logits: +100 on a token makes greedy decoding emit it at every
    position; -100 on every token greedy decoding chose makes it choose others; with NGRAM drafts (which know
    nothing of the bias) the outputs equal plain decoding's with the same bias, greedy and seeded."""
    runner, prompts, _ = demo
    greedy = dict(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    forced = run(runner, prompts[:2], [SamplingParams(**greedy, logit_bias=((42, 100.0),))] * 2)
    assert all(r.output_ids == [42] * NEW_TOKENS for r in forced)
    unbiased = run(runner, prompts, [SamplingParams(**greedy)] * len(prompts))
    banned = tuple(sorted({(t, -100.0) for r in unbiased[:2] for t in r.output_ids}))
    accepted = 0
    for bias in (banned, ((13, 4.0), (198, -2.5), (11, 3.0))):
        for params in ([SamplingParams(**greedy, logit_bias=bias)] * len(prompts),
                       [SamplingParams(temperature=0.8, top_p=0.95, seed=3 + i, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                       logit_bias=bias) for i in range(len(prompts))]):
            plain = run(runner, prompts, params)
            if bias is banned and params[0].is_greedy:
                forbidden = {t for t, _ in banned}
                assert all(not forbidden & set(r.output_ids) for r in plain[:2])
            for drafter in (ngram("BFS"), ngram("PROB")):
                spec = run(runner, prompts, params, drafter, SpecConfig(num_draft_tokens=8))
                assert [s.output_ids for s in spec] == [p.output_ids for p in plain]
                assert all(s.stats.fallbacks == 0 for s in spec) and sum(s.stats.draft_tokens for s in spec) > 0
                accepted += sum(s.stats.accepted_tokens for s in spec)
    assert accepted > 0  # drafts were accepted under the bias, not only proposed
    assert any(p.output_ids != u.output_ids for p, u in zip(run(runner, prompts, [SamplingParams(
        **greedy, logit_bias=((13, 4.0), (198, -2.5), (11, 3.0)))] * len(prompts)), unbiased))  # the bias mattered
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=((5, 101.0),))


def test_seeded_sampling_with_penalties_is_identical_under_speculation(demo):
    runner, prompts, _ = demo
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=7 + i, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                             frequency_penalty=0.4, presence_penalty=0.2, repetition_penalty=1.2)
              for i in range(len(prompts))]
    plain = run(runner, prompts, params)
    for drafter in (ngram("BFS"), ngram("PROB")):  # NGRAM trees branch where the trie does
        spec = run(runner, prompts, params, drafter, SpecConfig(num_draft_tokens=8))
        assert [s.output_ids for s in spec] == [p.output_ids for p in plain]
        assert sum(s.stats.accepted_tokens for s in spec) > 0


def test_logprobs_match_transformers_with_and_without_speculation(demo):
    runner, prompts, reference = demo
    k = 5
    params = [SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=k)] * len(prompts)
    plain = run(runner, prompts, params)
    spec = run(runner, prompts, params, ngram(), SpecConfig(num_draft_tokens=8))
    assert sum(s.stats.accepted_tokens for s in spec) > 0
    for prompt, p, s in zip(prompts, plain, spec):
        assert s.output_ids == p.output_ids and len(p.logprobs) == len(s.logprobs) == NEW_TOKENS
        with torch.no_grad():
            full = reference(torch.tensor([prompt + p.output_ids[:-1]])).logits[0, len(prompt) - 1 :].log_softmax(-1)
        for j, (token, a, b) in enumerate(zip(p.output_ids, p.logprobs, s.logprobs)):
            assert abs(a.logprob - full[j, token].item()) < 1e-3 and abs(b.logprob - a.logprob) < 1e-3, j
            top_values, top_ids = full[j].topk(k)
            assert [t for t, _ in a.top] == top_ids.tolist() or torch.allclose(
                torch.tensor([v for _, v in a.top]), top_values, atol=1e-3)  # ties may order differently
            assert len(b.top) == k and b.top[0][0] == token  # greedy: the chosen token is the likeliest
    unasked = run(runner, prompts[:1], [SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)])
    assert unasked[0].logprobs == []
    # one batch, each request its own k (none, the chosen token's alone, 2, 5): a step's logprobs come from one top-k
    # at the largest k asked, each request given its own
    ks = [None, 0, 2, 5] * (len(prompts) // 4) + [5] * (len(prompts) % 4)
    mixed = run(runner, prompts, [SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=k)
                                  for k in ks], ngram(), SpecConfig(num_draft_tokens=8), batch=len(prompts))
    for k, m, p in zip(ks, mixed, plain):
        assert m.output_ids == p.output_ids
        if k is None:
            assert m.logprobs == []
            continue
        assert len(m.logprobs) == NEW_TOKENS and all(len(e.top) == k for e in m.logprobs)
        for a, b in zip(m.logprobs, p.logprobs):
            assert abs(a.logprob - b.logprob) < 1e-3 and [t for t, _ in a.top] == [t for t, _ in b.top[:k]]


def test_prompt_logprobs_match_transformers_across_chunks_and_the_prefix_cache(demo):
    """vLLM's prompt_logprobs: every prompt token after the first, from the target's raw logits, equal to a
    transformers forward's log-softmax within 1e-4 (fp32), with its top alternatives, when the prompt is prefilled
    in several chunks (--chunked-prefill-size 8) and when the prefix cache holds it (such a prompt is computed
    afresh); with NGRAM drafting the outputs are plain's; max_new_tokens 0 gives the prompt's logprobs alone."""
    from splitspec.verifier_svc.prefix_cache import PrefixCache
    from splitspec.verifier_svc.engine import Engine, SchedulerConfig

    runner, prompts, reference = demo
    cache = PrefixCache(runner.kv_cache.allocator, runner.kv_cache.page_size)
    k = 3
    for drafter, budget in ((None, 0), (ngram(), 8)):
        engine = Engine(runner, drafter, SpecConfig(num_draft_tokens=budget) if budget else SpecConfig(), set(),
                        SchedulerConfig(chunked_prefill_size=8 + budget), prefix_cache=cache)
        warm = engine.add_request(prompts[0], SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True))
        while engine.has_work:
            engine.step()
        asked = [engine.add_request(p, SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True,
                                                      prompt_logprobs=k)) for p, n in zip(prompts[:3], (6, 0, 6))]
        plain = [engine.add_request(p, SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True))
                 for p in prompts[:3]]
        events = []
        while engine.has_work:
            events += engine.step()
        assert warm.output_ids and asked[0].cached_tokens == 0 and plain[0].cached_tokens > 0
        for prompt, request in zip(prompts, asked):
            with torch.no_grad():
                full = reference(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
            assert len(request.prompt_logprobs) == len(prompt) - 1
            for j, entry in enumerate(request.prompt_logprobs):
                assert abs(entry.logprob - full[j, prompt[j + 1]].item()) < 1e-4, j
                assert len(entry.top) == k and abs(entry.top[0][1] - full[j].max().item()) < 1e-4
            sent = [e.prompt_logprobs for e in events if e.request_id == request.request_id and e.prompt_logprobs]
            assert sent == [request.prompt_logprobs]  # on the request's first event only
        assert asked[1].output_ids == [] and asked[1].finish_reason == "length"
        assert asked[0].output_ids == plain[0].output_ids and asked[2].output_ids == plain[2].output_ids
        if drafter is not None:
            assert sum(r.stats.accepted_tokens for r in asked + plain) > 0 and all(
                r.stats.fallbacks == 0 for r in asked + plain)
    cache.evict(cache.num_evictable)
    assert runner.kv_cache.allocator.num_used == 0  # every page back in the pool for the module's other tests
