"""Lossless speculation (ARCHITECTURE §3): with NGRAM drafts, greedy output equals plain output and a
seeded request's text is the same with speculation on or off; a tree verified by the keyed rule
samples exactly the target's distribution, and the statistical test rejects a biased rule. Every
test also checks that speculation happened."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from helpers import assert_greedy_match, hf_model, make_hf_model, save_checkpoint

from splitspec import lifeline
from splitspec.demo import demo_model_dirs
from splitspec.drafter_svc.base import Drafter
from splitspec.drafter_svc.ngram import NgramConfig, NgramDrafter
from splitspec.generate import generate_ids
from splitspec.runtime.runner import ModelRunner, RuntimeConfig
from splitspec.runtime.sampling_params import SamplingParams
from splitspec.runtime.tree import DraftTree
from splitspec.verifier_svc.drafter_client import InProcessDrafterClient
from splitspec.verifier_svc.engine import SpecConfig

MEAN_ACCEPT_FLOOR = 2.0  # tokens per verify step on repetitive code, NGRAM, demo target (greedy)
NEW_TOKENS = 48

# 24 prompts: ordinary code and code that repeats itself (where NGRAM shines)
PROMPTS = [
    "def fibonacci(n):\n", "import os\nimport sys\n\n", "class Config:\n    def __init__(self, path):\n",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n", "def read(path):\n    with open(path) as f:\n",
    "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [", "try:\n    import json\nexcept ImportError:\n",
    "self.a = a\nself.b = b\nself.c = c\nself.", "if x is None:\n    return None\nif y is None:\n",
    "import re\n\n\ndef match(pattern, text):\n", "def __eq__(self, other):\n    return self.x == other.x and",
    "assert a == 1\nassert b == 2\nassert c == 3\nassert", "from collections import defaultdict\n\n",
    "def main():\n    import argparse\n    parser = argparse.ArgumentParser()\n    parser.add_argument(",
    "return self._data[key]\n\n    def __setitem__(self, key, value):\n", "while True:\n    line = f.readline()\n",
    "class Error(Exception):\n    pass\n\n\nclass", "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n",
    "__all__ = ['a', 'b', 'c', '", "    def get(self, key, default=None):\n        try:\n",
    "import os\nimport os\nimport os\n", "if __name__ == '__main__':\n", "# Copyright\n# Copyright\n#",
    "def f(x):\n    '''Return x.'''\n    return x\n\n\ndef g(x):\n    '''Return x.'''\n",
]
REPETITIVE = [3, 5, 7, 11, 20, 22]


@pytest.fixture(scope="module")
def demo():
    from transformers import AutoTokenizer

    target = demo_model_dirs()["target"]
    runner = ModelRunner.load(RuntimeConfig(model_path=str(target), dtype="float32", device="cpu",
                                            max_total_tokens=len(PROMPTS) * 160, page_size=16))
    tokenizer = AutoTokenizer.from_pretrained(target)
    return runner, tokenizer, [tokenizer.encode(p) for p in PROMPTS], hf_model(target)


@pytest.fixture(scope="module")
def plain_greedy(demo):
    """Every prompt's greedy output without speculation (batch 1): the reference of the lossless tests."""
    runner, _, prompts, _ = demo
    return run(runner, prompts, [SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)] * len(prompts),
               batch=1)


def ngram(match_type: str = "BFS") -> InProcessDrafterClient:
    return InProcessDrafterClient(NgramDrafter(NgramConfig(match_type=match_type)))


def run(runner, prompts, params, drafter=None, spec=None, batch=8):
    out = []
    for start in range(0, len(prompts), batch):
        out += generate_ids(runner, prompts[start : start + batch], params[start : start + batch], set(),
                            drafter=drafter, spec=spec)
    assert runner.kv_cache.allocator.num_used == 0  # every page back in the pool
    return out


@pytest.mark.parametrize("batch, match_type", [(1, "BFS"), (8, "BFS"), (8, "PROB")])
def test_greedy_speculation_is_lossless_and_speculates(demo, plain_greedy, batch, match_type):
    runner, _, prompts, reference = demo
    params = [SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)] * len(prompts)
    plain = plain_greedy
    spec = run(runner, prompts, params, ngram(match_type), SpecConfig(num_draft_tokens=8), batch=batch)
    for i, (p, s) in enumerate(zip(plain, spec)):
        assert_greedy_match(s.output_ids, p.output_ids, reference, prompts[i], f"prompt {i} batch {batch} {match_type}")
        assert s.stats.fallbacks == 0
    drafts = sum(s.stats.draft_tokens for s in spec)
    accepted = sum(s.stats.accepted_tokens for s in spec)
    assert drafts > 0 and accepted > 0
    repetitive = [spec[i].stats for i in REPETITIVE]
    accept_length = 1 + sum(st.accepted_tokens for st in repetitive) / sum(st.verify_steps for st in repetitive)
    print(f"batch {batch} {match_type}: drafts {drafts}, accepted {accepted}, "
          f"accept length on repetitive code {accept_length:.2f}")
    assert accept_length >= MEAN_ACCEPT_FLOOR


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, -1, 1.0), (0.7, -1, 0.9), (0.5, 20, 1.0), (1.2, 40, 0.95)])
def test_seeded_sampling_is_identical_with_and_without_speculation(demo, temperature, top_k, top_p):
    runner, _, prompts, _ = demo
    chosen = [prompts[i] for i in REPETITIVE]
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=100 + i,
                             max_new_tokens=NEW_TOKENS, ignore_eos=True) for i in range(len(chosen))]
    plain = run(runner, chosen, params)
    spec = run(runner, chosen, params, ngram(), SpecConfig(num_draft_tokens=8))
    assert [s.output_ids for s in spec] == [p.output_ids for p in plain]
    assert sum(s.stats.accepted_tokens for s in spec) > 0 and all(s.stats.fallbacks == 0 for s in spec)
    greedy = run(runner, chosen[:1], [SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)])
    assert greedy[0].output_ids != plain[0].output_ids or temperature < 0.6  # it really sampled


def test_a_batch_mixing_greedy_sampled_and_penalized_requests_keeps_each_ones_output(demo):
    """The verify step takes every request's target tokens from one sampling kernel over the batch (each row
    with its own request's parameters and output position); penalized requests use their own rows. Mixed in
    one speculative batch, each request's output equals its own plain decoding alone."""
    runner, _, prompts, _ = demo
    chosen = [prompts[i] for i in REPETITIVE[:5]]
    params = [SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS // 2, ignore_eos=True),
              SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_new_tokens=NEW_TOKENS // 2, ignore_eos=True),
              SamplingParams(temperature=0.6, top_k=20, seed=8, max_new_tokens=NEW_TOKENS // 2, ignore_eos=True),
              SamplingParams(temperature=0.0, repetition_penalty=1.3, max_new_tokens=NEW_TOKENS // 2, ignore_eos=True),
              SamplingParams(temperature=1.1, seed=9, frequency_penalty=0.5, max_new_tokens=NEW_TOKENS // 2, ignore_eos=True)]
    alone = [run(runner, [prompt], [p], batch=1)[0].output_ids for prompt, p in zip(chosen, params)]
    mixed = run(runner, chosen, params, ngram(), SpecConfig(num_draft_tokens=8), batch=len(chosen))
    assert [m.output_ids for m in mixed] == alone
    assert all(m.stats.fallbacks == 0 for m in mixed)
    assert sum(m.stats.accepted_tokens for m in mixed[:3]) > 0  # the batched rows did accept drafts


def test_trees_padded_to_one_shape_keep_outputs(demo, plain_greedy):
    """NGRAM's trees differ in size (and a request without a match verifies its root alone); on a GPU the
    batch is padded with filler nodes to the smallest captured tree size so that it replays one graph. The
    padding forced here on the CPU (eagerly) leaves every output as plain decoding's, and the fillers are
    counted."""
    from splitspec.verifier_svc.engine import Engine

    runner, _, prompts, reference = demo
    chosen = [prompts[i] for i in range(8)]
    params = [SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)] * len(chosen)
    runner.tree_pad_sizes = (8,)
    try:
        engine = Engine(runner, ngram(), SpecConfig(num_draft_tokens=8), set())
        requests = [engine.add_request(p, sp) for p, sp in zip(chosen, params)]
        padding = 0
        while engine.has_work:
            engine.step()
            padding += engine.report.padding_tokens
            if engine.report.padding_tokens:  # every tree of the step has 8 nodes in the forward
                assert engine.report.forward_tokens % 8 == 0 and engine.report.prefill_tokens == 0
    finally:
        runner.tree_pad_sizes = ()
    assert runner.kv_cache.allocator.num_used == 0
    for i, r in enumerate(requests):
        assert_greedy_match(r.output_ids, plain_greedy[i].output_ids, reference, chosen[i], f"padded prompt {i}")
        assert r.stats.fallbacks == 0
    assert padding > 0 and sum(r.stats.accepted_tokens for r in requests) > 0


def test_prompt_steps_padded_to_one_shape_keep_outputs(demo, plain_greedy):
    """On a GPU a step that only prefills has its chunks padded with filler tokens to a captured prompt graph's shape
    (runtime.prompt_graph): arrivals into a speculating batch (at most 3 running, so each finish lets one in), prompts
    prefilled in chunks of 24 (the last prompt is two joined). The padding forced here on the CPU (eagerly) leaves every output
    as plain decoding's; the fillers' KV slots are never committed (every page returns to the pool)."""
    from splitspec.verifier_svc.engine import Engine, SchedulerConfig

    runner, _, prompts, reference = demo
    chosen = [prompts[i] for i in range(10)] + [prompts[13] + prompts[0]]
    params = [SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)] * len(chosen)
    runner.prompt_pad_sizes = (16, 32)
    padded_before, fillers = runner.padded_prompt_steps, 0
    try:
        engine = Engine(runner, ngram(), SpecConfig(num_draft_tokens=8), set(),
                        SchedulerConfig(max_running_requests=3, chunked_prefill_size=24))
        requests = [engine.add_request(p, sp) for p, sp in zip(chosen, params)]
        while engine.has_work:
            padded = runner.padded_prompt_steps
            engine.step()
            if runner.padded_prompt_steps > padded:  # every chunk of the step has 16 or 32 tokens in the forward
                assert engine.report.forward_tokens in (16, 32, 48, 64, 96) and engine.report.prefill_tokens > 0
                # the fillers are counted (the verifier's prompt_padding_tokens metric): the forward less the real tokens
                assert engine.report.prompt_padding_tokens == engine.report.forward_tokens - engine.report.prefill_tokens
                fillers += engine.report.prompt_padding_tokens
            else:
                assert engine.report.prompt_padding_tokens == 0
    finally:
        runner.prompt_pad_sizes = ()
    assert runner.kv_cache.allocator.num_used == 0
    for i, r in enumerate(requests[:10]):
        assert_greedy_match(r.output_ids, plain_greedy[i].output_ids, reference, chosen[i], f"padded prompt {i}")
    alone = run(runner, [chosen[-1]], params[:1], batch=1)[0]
    assert_greedy_match(requests[-1].output_ids, alone.output_ids, reference, chosen[-1], "a prompt of two chunks")
    assert runner.padded_prompt_steps - padded_before >= len(chosen) - 3  # every arrival's but the first batch's
    assert fillers > 0
    assert all(r.stats.fallbacks == 0 for r in requests) and sum(r.stats.accepted_tokens for r in requests) > 0


class FixedTreeDrafter(Drafter):
    """Proposes the same branching tree after every root: 3 children of the root, 2 under each."""

    name = "FIXED"
    CHILDREN, GRANDCHILDREN = (6, 0, 2), (6, 3)  # 6 is the model's likeliest token

    def __init__(self):
        self.last: dict[str, int] = {}

    def open(self, request_id, prompt_ids):
        self.last[request_id] = prompt_ids[-1]

    def extend(self, request_id, tokens):
        self.last[request_id] = tokens[-1]

    def draft(self, request_ids, max_nodes):
        trees = []
        for request_id in request_ids:
            tokens, parents = [self.last[request_id]], [-1]
            for child in self.CHILDREN:
                tokens.append(child)
                parents.append(0)
                here = len(tokens) - 1
                for grandchild in self.GRANDCHILDREN:
                    tokens.append(grandchild)
                    parents.append(here)
            trees.append(DraftTree(tuple(tokens), tuple(parents)))
        return trees

    def release(self, request_id):
        self.last.pop(request_id, None)


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory):
    """Vocabulary 8; next-token distributions spread (about 0.46 on token 6, 0.04-0.11 elsewhere)."""
    model = make_hf_model("llama-gqa-llama3", seed=3, vocab_size=8)
    return save_checkpoint(model, tmp_path_factory.mktemp("v8") / "m"), model


def exact_joint(model, prompt: list[int]) -> torch.Tensor:
    """P(t0, t1, t2) [8, 8, 8] of the target alone, by enumeration."""
    with torch.no_grad():
        def next_probs(ids):
            return torch.softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)

        joint = torch.zeros(8, 8, 8)
        p0 = next_probs(prompt)
        for a in range(8):
            p1 = next_probs(prompt + [a])
            for b in range(8):
                joint[a, b] = p0[a] * p1[b] * next_probs(prompt + [a, b])
    return joint


def chi_square(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson statistic over cells with enough expected mass (the rest pooled into one cell)."""
    expected = probs.flatten() * counts.sum()
    counts = counts.flatten().float()
    big = expected >= min_expected
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    expect = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = expect > 0
    return (((observed - expect) ** 2)[keep] / expect[keep]).sum().item(), int(keep.sum()) - 1


@pytest.mark.parametrize("rule, should_match", [("lossless", True), ("biased", False)])
def test_tree_sampling_matches_the_target_distribution(small_vocab_model, rule, should_match):
    path, model = small_vocab_model
    prompt = [5, 6, 7]
    runner = ModelRunner.load(RuntimeConfig(model_path=str(path), dtype="float32", device="cpu",
                                            max_total_tokens=500 * 32, page_size=4))
    spec = SpecConfig(num_draft_tokens=10) if rule == "lossless" else \
        SpecConfig(num_draft_tokens=10, accept_threshold_single=0.0, accept_threshold_acc=1.0)
    num = 2000  # the biased rule scores ~7000 against a critical ~200 here; the lossless one ~dof
    counts = torch.zeros(8, 8, 8)
    accepted = 0
    for start in range(0, num, 500):
        params = [SamplingParams(temperature=1.0, seed=s, max_new_tokens=3, ignore_eos=True) for s in range(start, start + 500)]
        for r in generate_ids(runner, [prompt] * 500, params, set(), drafter=InProcessDrafterClient(FixedTreeDrafter()), spec=spec):
            counts[tuple(r.output_ids)] += 1
            accepted += r.stats.accepted_tokens
            assert r.stats.fallbacks == 0 and r.stats.draft_tokens == 9 * r.stats.verify_steps > 0
    assert accepted > 0  # drafts were accepted
    statistic, dof = chi_square(counts, exact_joint(model, prompt))
    critical = dof + 5 * (2 * dof) ** 0.5 + 10  # far beyond the 99.9% quantile for these dof
    print(f"{rule}: chi-square {statistic:.1f} on {dof} dof (critical {critical:.1f}), accepted {accepted}")
    assert (statistic < critical) == should_match


def test_generate_cli_reports_speculation():
    result = lifeline.run(
        [sys.executable, "-P", "-m", "splitspec", "generate", "--prompt", "import os\nimport os\nimport os\n",
         "--max-new-tokens", "24", "--ignore-eos", "--json", "--speculative-algorithm", "NGRAM",
         "--speculative-num-draft-tokens", "6", "--log-level", "warning"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    spec = json.loads(result.stdout)["speculative"]
    assert spec["algorithm"] == "NGRAM" and spec["draft_tokens"] > 0 and spec["accepted_tokens"] > 0
    assert spec["mean_accept_length"] == pytest.approx(1 + spec["accepted_tokens"] / spec["verify_steps"], abs=1e-3)
    assert spec["fallbacks"] == 0


def test_requests_join_and_leave_between_steps(demo):
    """Continuous batching: a request added while others run gets the same output as alone."""
    from splitspec.verifier_svc.engine import Engine

    runner, _, prompts, reference = demo
    greedy = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    short = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    engine = Engine(runner, ngram(), SpecConfig(num_draft_tokens=6), set())
    first = [engine.add_request(prompts[i], greedy if i != 5 else short) for i in (3, 5)]
    for _ in range(4):
        engine.step()
    late = engine.add_request(prompts[11], greedy)
    while engine.has_work:
        engine.step()
    assert first[1].finish_reason == "length" and len(first[1].output_ids) == 10  # left early
    for request, i in zip([*first, late], (3, 5, 11)):
        alone = run(runner, [prompts[i]], [request.params])[0]
        assert_greedy_match(request.output_ids, alone.output_ids, reference, prompts[i], f"join/leave prompt {i}")
    assert sum(r.stats.accepted_tokens for r in [*first, late]) > 0
    assert runner.kv_cache.allocator.num_used == 0


def test_force_greedy_verify_environment_variable():
    """SGLANG_NGRAM_FORCE_GREEDY_VERIFY=True makes NGRAM verify by argmax, as SGLang's flag does:
    a sampled request then decodes exactly as a greedy one."""
    import os

    base = [sys.executable, "-P", "-m", "splitspec", "generate", "--prompt", "import os\nimport os\n", "--max-new-tokens", "24",
            "--ignore-eos", "--json", "--speculative-algorithm", "NGRAM", "--log-level", "warning"]
    env = {**os.environ, "SGLANG_NGRAM_FORCE_GREEDY_VERIFY": "True"}
    forced = lifeline.run(base + ["--temperature", "1.0", "--seed", "3"], capture_output=True, text=True, env=env, timeout=300)
    greedy = lifeline.run(base + ["--temperature", "0"], capture_output=True, text=True, timeout=300)
    sampled = lifeline.run(base + ["--temperature", "1.0", "--seed", "3"], capture_output=True, text=True, timeout=300)
    for r in (forced, greedy, sampled):
        assert r.returncode == 0, r.stderr
    outputs = [json.loads(r.stdout)["output_ids"] for r in (forced, greedy, sampled)]
    assert outputs[0] == outputs[1] != outputs[2]


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed-chunk", "prefill-first"])
def test_chunked_prefill_and_running_limit_keep_outputs(demo, plain_greedy, mixed):
    """At most 2 requests running and 14 tokens per step: a step mixing prompt chunks and trees counts each decoding
    request's tree (6 tokens) first and chunks prompts into what is left; with --enable-mixed-chunk every step with a
    chunk is mixed; without it, a backlog that fits the step (the last chunk of a prompt) prefills alone while the
    decoding requests wait, and a longer one is mixed: same outputs."""
    from splitspec.verifier_svc.engine import Engine, SchedulerConfig

    runner, _, prompts, reference = demo
    chosen = [prompts[i] for i in (0, 3, 13, 18, 23, 5)]
    params = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    plain = [plain_greedy[i].output_ids[:16] for i in (0, 3, 13, 18, 23, 5)]  # greedy: the first 16 of 48
    engine = Engine(runner, ngram(), SpecConfig(num_draft_tokens=6), set(),
                    SchedulerConfig(max_running_requests=2, chunked_prefill_size=14,
                                    mixed_chunk="always" if mixed else "prefill-first"))
    requests = [engine.add_request(p, params) for p in chosen]
    most_running, prefill_steps, mixed_steps, paused_steps = 0, 0, 0, 0
    while engine.has_work:
        decoding = sum(r.decoding for r in engine.running)
        engine.step()
        most_running = max(most_running, len(engine.running))
        prefill_steps += engine.report.prefill_tokens > 0
        verified = engine.report.forward_tokens - engine.report.prefill_tokens
        mixed_steps += engine.report.prefill_tokens > 0 and verified > 0
        paused_steps += engine.report.prefill_tokens > 0 and decoding > 0 and verified == 0
        if verified:
            assert engine.report.prefill_tokens + 6 * decoding <= 14
        else:
            assert engine.report.prefill_tokens <= 14
    assert most_running == 2 and prefill_steps >= sum(len(p) for p in chosen) // 14 and mixed_steps > 0
    assert paused_steps == 0 if mixed else paused_steps > 0
    for i, (request, p) in enumerate(zip(requests, plain)):
        assert_greedy_match(request.output_ids, p, reference, chosen[i], f"chunked prompt {i}")
    assert sum(r.stats.accepted_tokens for r in requests) > 0
    assert runner.kv_cache.allocator.num_used == 0


@pytest.mark.parametrize("mode", ["auto", "auto-graphed", "prefill-first"])
def test_a_request_joining_a_running_batch_is_prefilled_beside_it(demo, plain_greedy, mode, request):
    """By default a step mixes its prompt chunks with the decoding requests when those outnumber the arrivals and
    verify no drafts: one request joining a batch of 6 that is not drafting (plain requests opted out, as a drafting-off
    batch) is prefilled in a step in which the 6 decode too, not one that pauses them (in a speculating batch requests
    end at different steps, so their successors arrive one by one). A wave of 4 arriving beside 2 decoding requests
    prefills alone and joins one batch, and so does a request joining a batch that verifies trees (their rows would
    run outside the captured graphs in a mixed step). --disable-mixed-chunk (prefill-first, SGLang's default) pauses
    the batch every time, and so does the default where the prompts alone replay a captured prompt graph
    (auto-graphed: the padding to prompt graphs' sizes forced on the CPU). Outputs equal plain decoding's; the
    speculating requests accepted drafts."""
    from splitspec.verifier_svc.engine import Engine, SchedulerConfig

    runner, _, prompts, reference = demo
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    if mode == "auto-graphed":
        runner.prompt_pad_sizes = (16, 32, 64, 128)
        request.addfinalizer(lambda: setattr(runner, "prompt_pad_sizes", ()))
    engine = Engine(runner, ngram(), SpecConfig(num_draft_tokens=6), set(),
                    SchedulerConfig(mixed_chunk=mode.removesuffix("-graphed")))
    requests = {}

    def add_and_step(indices: list[int], speculate: bool) -> tuple[int, int, int]:
        """Adds these prompts, runs the step that prefills them: (decoding before, prefill tokens, decoding requests
        that got tokens in that step: verified beside the prompts)."""
        for i in indices:
            requests[i] = engine.add_request(prompts[i], params, speculate=speculate)
        decoding = [(r, len(r.output_ids)) for r in engine.running if r.decoding]
        engine.step()
        return len(decoding), engine.report.prefill_tokens, sum(len(r.output_ids) > n for r, n in decoding)

    assert add_and_step([3, 5], False)[2] == 0  # the first two alone: nothing decodes yet
    engine.step()
    decoding, prefilled, verified = add_and_step([7, 11, 20, 0], False)  # a wave of 4 beside 2: prefilled alone
    assert (decoding, verified) == (2, 0) and prefilled == sum(len(prompts[i]) for i in (7, 11, 20, 0))
    engine.step()
    padded = runner.padded_prompt_steps
    decoding, prefilled, verified = add_and_step([13], True)  # one joining 6 plain decodes
    assert decoding == 6 and prefilled == len(prompts[13])
    assert verified == (6 if mode == "auto" else 0)
    assert runner.padded_prompt_steps == padded + (mode == "auto-graphed")  # prefilled alone, padded to a graph's size
    engine.step()
    decoding, prefilled, verified = add_and_step([18, 22], False)  # two joining 7, of which 13 verifies a tree
    assert decoding == 7 and prefilled == len(prompts[18]) + len(prompts[22]) and verified == 0
    while engine.has_work:
        engine.step()
    for i, joined in requests.items():
        assert_greedy_match(joined.output_ids, plain_greedy[i].output_ids[:24], reference, prompts[i], f"joined {i}")
    assert requests[13].stats.accepted_tokens > 0 and requests[13].stats.fallbacks == 0
    assert runner.kv_cache.allocator.num_used == 0


def test_preemption_under_a_tiny_kv_budget_keeps_outputs(demo):
    """16 requests (greedy and seeded sampling) on a pool with room for a few at a time: the newest
    are preempted and re-prefilled (from the prefix cache where their pages survived, or recomputed),
    and every output equals the output with ample KV. Speculation still happened."""
    from splitspec.verifier_svc.engine import Engine
    from splitspec.verifier_svc.prefix_cache import PrefixCache

    _, _, prompts, reference = demo
    chosen = prompts[:16]
    params = [SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True) if i % 4 else
              SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, max_new_tokens=40, ignore_eos=True)
              for i in range(len(chosen))]
    target = demo_model_dirs()["target"]
    roomy = ModelRunner.load(RuntimeConfig(model_path=str(target), dtype="float32", device="cpu", max_total_tokens=4096))
    expected = Engine(roomy, ngram(), SpecConfig(num_draft_tokens=8), set()).run(chosen, params)
    for with_cache in (True, False):
        tiny = ModelRunner.load(RuntimeConfig(model_path=str(target), dtype="float32", device="cpu", max_total_tokens=320))
        cache = PrefixCache(tiny.kv_cache.allocator, tiny.kv_cache.page_size) if with_cache else None
        engine = Engine(tiny, ngram(), SpecConfig(num_draft_tokens=8), set(), prefix_cache=cache)
        requests = engine.run(chosen, params)
        assert sum(r.num_preemptions for r in requests) > 0, "the budget should have forced preemption"
        for i, (got, want) in enumerate(zip(requests, expected)):
            assert got.finish_reason == "length"
            if params[i].is_greedy:
                assert_greedy_match(got.output_ids, want.output_ids, reference, chosen[i], f"preempted prompt {i}")
            else:
                assert got.output_ids == want.output_ids, f"seeded prompt {i} changed through preemption"
        assert sum(r.stats.accepted_tokens for r in requests) > 0
        assert all(r.stats.fallbacks == 0 for r in requests)
        held = cache.num_pages if cache is not None else 0
        assert tiny.kv_cache.allocator.num_used == held
        if cache is not None:
            assert all(tiny.kv_cache.allocator.refcount(n.page) == 1 for n in cache._nodes())


def test_a_request_too_big_for_the_cache_ends_with_an_error_and_others_finish(demo):
    """Offline there is no validator in front: a request that cannot fit even alone ends with an
    error naming the shortage; the engine keeps serving the rest."""
    from splitspec.verifier_svc.engine import Engine

    target = demo_model_dirs()["target"]
    tiny = ModelRunner.load(RuntimeConfig(model_path=str(target), dtype="float32", device="cpu", max_total_tokens=64))
    engine = Engine(tiny, None, SpecConfig(), set())
    small = engine.add_request([13, 290, 350], SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True))
    big = engine.add_request(list(range(100, 160)), SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True))
    errors = []
    while engine.has_work:
        errors += [e.error for e in engine.step() if e.finish_reason == "error"]
    assert small.finish_reason == "length" and len(small.output_ids) == 8
    assert big.finish_reason == "error" and len(errors) == 1 and errors[0].startswith("RESOURCE_EXHAUSTED")
    assert tiny.kv_cache.allocator.num_used == 0


def test_prefix_cache_reuses_pages_and_keeps_outputs(demo):
    """A request sharing a long prompt prefix with a finished one starts from its cached pages; under
    a budget too small for everything, the cache evicts and every output stays the same."""
    from splitspec.verifier_svc.engine import Engine
    from splitspec.verifier_svc.prefix_cache import PrefixCache

    runner, tokenizer, _, reference = demo
    shared = tokenizer.encode("import os\nimport sys\n\n\ndef main(argv=None):\n    parser = argparse.ArgumentParser("
                              "description='tool')\n    parser.add_argument('--path')\n    args = parser.parse_args(argv)\n")
    prompts = [shared + tokenizer.encode(tail) for tail in ("    print(args.path)\n", "    return 0\n", "    os.")]
    params = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    plain = run(runner, prompts, [params] * 3, batch=1)
    cache = PrefixCache(runner.kv_cache.allocator, runner.kv_cache.page_size)
    engine = Engine(runner, ngram(), SpecConfig(num_draft_tokens=6), set(), prefix_cache=cache)
    outputs = []
    for prompt in prompts:
        request = engine.add_request(prompt, params)
        while engine.has_work:
            engine.step()
        outputs.append(request)
    page = runner.kv_cache.page_size
    assert outputs[0].cached_tokens == 0
    assert outputs[1].cached_tokens == outputs[2].cached_tokens == (len(shared) // page) * page > 0
    for i, (request, p) in enumerate(zip(outputs, plain)):
        assert_greedy_match(request.output_ids, p.output_ids, reference, prompts[i], f"prefix-cache prompt {i}")
    allocator = runner.kv_cache.allocator
    assert allocator.num_used == cache.num_pages  # every page in use is held by the cache alone
    assert all(allocator.refcount(n.page) == 1 for n in cache._nodes())
    held = cache.num_pages
    assert held > 0 and cache.evict(allocator.num_pages) == held and allocator.num_used == 0


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "lof"])
def test_the_schedule_policy_orders_admission_and_keeps_outputs(demo, policy):
    """--schedule-policy with one running slot (--max-running-requests 1), two requests waiting: fcfs admits them by
    arrival, lpm first the one whose prompt's prefix the cache holds (a finished request's), lof first the one asking
    the most tokens; every output equals plain decoding's and the cached prefix is used either way."""
    from splitspec.verifier_svc.engine import Engine
    from splitspec.verifier_svc.prefix_cache import PrefixCache
    from splitspec.verifier_svc.step_types import SchedulerConfig

    runner, tokenizer, _, reference = demo
    shared = tokenizer.encode("import os\nimport sys\n\n\ndef main(argv=None):\n    parser = argparse.ArgumentParser("
                              "description='tool')\n    parser.add_argument('--path')\n    args = parser.parse_args(argv)\n")
    warm, sharing = shared + tokenizer.encode("    print(args.path)\n"), shared + tokenizer.encode("    return 0\n")
    other = tokenizer.encode("class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n")
    short, long_ = (SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in (6, 12))
    cache = PrefixCache(runner.kv_cache.allocator, runner.kv_cache.page_size)
    engine = Engine(runner, ngram(), SpecConfig(num_draft_tokens=6), set(),
                    SchedulerConfig(max_running_requests=1, schedule_policy=policy), prefix_cache=cache)
    engine.add_request(warm, short)
    while engine.has_work:
        engine.step()
    first, second = engine.add_request(other, short), engine.add_request(sharing, long_)
    admitted = []
    while engine.has_work:
        engine.step()
        admitted += [r for r in engine.running if r not in admitted]
    assert admitted == ([first, second] if policy == "fcfs" else [second, first])
    assert second.cached_tokens == (len(shared) // runner.kv_cache.page_size) * runner.kv_cache.page_size > 0
    cache.evict(runner.kv_cache.allocator.num_pages)  # the module's runner empty again
    plain = run(runner, [other, sharing], [short, long_], batch=1)
    for request, p, prompt in zip((first, second), plain, (other, sharing)):
        assert_greedy_match(request.output_ids, p.output_ids, reference, prompt, f"{policy} admission")


def test_prefix_cache_evicts_under_a_small_budget(demo):
    from splitspec.verifier_svc.engine import Engine
    from splitspec.verifier_svc.prefix_cache import PrefixCache

    _, _, prompts, reference = demo
    small = ModelRunner.load(RuntimeConfig(model_path=str(demo_model_dirs()["target"]), dtype="float32", device="cpu",
                                           max_total_tokens=12 * 16, page_size=16))
    chosen = [p for p in prompts if 16 < len(p) <= 40][:6]
    params = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    plain = run(small, chosen, [params] * len(chosen), batch=1)
    cache = PrefixCache(small.kv_cache.allocator, small.kv_cache.page_size)
    engine = Engine(small, ngram(), SpecConfig(num_draft_tokens=6), set(), prefix_cache=cache)
    assert len(chosen) == 6
    for prompt, p in zip(chosen, plain):
        request = engine.add_request(prompt, params)
        while engine.has_work:
            engine.step()
        assert_greedy_match(request.output_ids, p.output_ids, reference, prompt, "under a small budget")
    assert cache.evicted_pages > 0  # the pool was too small to keep everything: the cache gave pages back
    assert small.kv_cache.allocator.num_used == cache.num_pages <= 12


def test_a_drafter_failing_on_one_request_does_not_cost_the_others_their_drafts(demo, plain_greedy):
    """The drafter raises whenever a particular request is in its batch: that request decodes plainly
    (fallbacks counted), the others still get their trees, and every output is the target's."""
    runner, _, prompts, reference = demo
    chosen = [prompts[i] for i in REPETITIVE[:4]]

    class Picky(NgramDrafter):
        def draft(self, request_ids, max_nodes):
            if self.victim in request_ids:
                raise RuntimeError("simulated drafter bug")
            return super().draft(request_ids, max_nodes)

    picky = Picky(NgramConfig())
    client = InProcessDrafterClient(picky)
    from splitspec.verifier_svc.engine import Engine

    engine = Engine(runner, client, SpecConfig(num_draft_tokens=8), set())
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    requests = [engine.add_request(p, params) for p in chosen]
    picky.victim = requests[0].request_id
    while engine.has_work:
        engine.step()
    plain = [plain_greedy[i] for i in REPETITIVE[:4]]
    for i, (r, p) in enumerate(zip(requests, plain)):
        assert_greedy_match(r.output_ids, p.output_ids, reference, chosen[i], f"picky {i}")
    assert requests[0].stats.fallbacks > 0 and requests[0].stats.accepted_tokens == 0
    assert all(r.stats.fallbacks == 0 and r.stats.accepted_tokens > 0 for r in requests[1:])


def test_a_request_run_to_the_context_end_stays_within_a_rope_cache_fixed_for_graphs(tmp_path):
    """A request that decodes up to the model's context verifies, in its last steps, trees whose nodes lie past it
    (their tokens past its limit are dropped at emit). On a GPU the RoPE cache is made before the CUDA graphs capture
    it and never moves (RotaryEmbedding.reserve_for_graphs); before, those nodes grew it and the graphs read the freed
    cache from then on. Here it is fixed the same way, so a forward asking past it would raise: the run ends at the
    context with plain decoding's output, having speculated, and the positions asked did pass the context."""
    from helpers import load_runner

    context = 48
    path = save_checkpoint(make_hf_model("llama-gqa-llama3", seed=3, vocab_size=8, max_position_embeddings=context),
                           tmp_path / "m")
    runner = load_runner(path)
    rope = runner.model.rotary_emb
    rope.reserve_for_graphs(context, runner.device)
    asked, reserve = [], rope.reserve
    rope.reserve = lambda n, device: (asked.append(n), reserve(n, device))[1]
    prompt = [3, 5, 6, 1] * 4
    params = [SamplingParams(temperature=0.0, max_new_tokens=context - len(prompt), ignore_eos=True)]
    plain = run(runner, [prompt], params, batch=1)[0]
    spec = run(runner, [prompt], params, InProcessDrafterClient(FixedTreeDrafter()), SpecConfig(num_draft_tokens=10),
               batch=1)[0]
    assert spec.output_ids == plain.output_ids and len(spec.output_ids) == context - len(prompt)
    assert spec.finish_reason == "length" and spec.stats.accepted_tokens > 0 and spec.stats.fallbacks == 0
    assert max(asked) > context, asked  # the last trees' nodes past the context were rotated
    with pytest.raises(RuntimeError, match="fixed at"):  # and past the fixed cache nothing moves it
        rope.reserve(rope.num_cached_positions + 1, runner.device)
