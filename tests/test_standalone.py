"""STANDALONE (a small draft LLM): its trees are what the draft model says (every node's score is the
product of the draft model's probabilities along its path, computed here with transformers on the
path alone), greedy output equals plain at batch 1 and 8 with drafts accepted and no fallbacks, seeded
sampling is unchanged, SGLang's tree flags behave, and it runs as a `splitspec drafter` process."""

from __future__ import annotations

import argparse
import sys

import pytest
import torch
from helpers import assert_greedy_match, hf_model, spawn_service
from test_speculative import PROMPTS, run
from test_verifier_service import collect, scrape, start_verifier, stop, submit

from splitspec import lifeline
from splitspec import speculation
from splitspec.demo import demo_model_dirs
from splitspec.drafter_svc.standalone import StandaloneDrafter
from splitspec.protos import verifier_pb2 as pb
from splitspec.runtime.piecewise_graph import SIZES
from splitspec.runtime.runner import ModelRunner, RuntimeConfig
from splitspec.runtime.sampling_params import SamplingParams
from splitspec.runtime.tree import path_to
from splitspec.verifier_svc.drafter_client import InProcessDrafterClient
from splitspec.verifier_svc.engine import SpecConfig

NEW_TOKENS = 40


@pytest.fixture(scope="module")
def models():
    from transformers import AutoTokenizer

    dirs = demo_model_dirs()
    target = ModelRunner.load(RuntimeConfig(model_path=str(dirs["target"]), dtype="float32", device="cpu", max_total_tokens=16384))
    tokenizer = AutoTokenizer.from_pretrained(dirs["target"])
    return dirs, target, [tokenizer.encode(p) for p in PROMPTS], hf_model(dirs["target"])


def standalone(dirs, topk: int, steps: int, tokens: int) -> StandaloneDrafter:
    runner = ModelRunner.load(RuntimeConfig(model_path=str(dirs["draft"]), dtype="float32", device="cpu", max_total_tokens=16384))
    return StandaloneDrafter(runner, topk=topk, num_steps=steps, num_draft_tokens=tokens)


def test_tree_scores_are_the_draft_models_path_probabilities(models):
    """Each node's score = product over its path of the draft model's softmax, from an HF forward of
    prompt + path alone: the beam nodes' forest mask, positions and KV handling change nothing."""
    dirs, _, prompts, _ = models
    drafter = standalone(dirs, topk=3, steps=3, tokens=10)
    reference = hf_model(dirs["draft"])
    for i, prompt in enumerate(prompts[:3]):
        drafter.open(f"r{i}", prompt[:-4])
        drafter.extend(f"r{i}", prompt[-4:])  # the catch-up forward covers the reported tokens too
    trees = drafter.draft(["r0", "r1", "r2"], [10, 10, 10])
    for prompt, tree in zip(prompts[:3], trees):
        assert tree.num_nodes == 10 and tree.tokens[0] == prompt[-1]
        for node in range(1, tree.num_nodes):
            path = [tree.tokens[j] for j in path_to(tree.parents, node)[1:]]
            ids = torch.tensor([prompt + path])
            with torch.no_grad():
                probs = torch.softmax(reference(ids).logits[0].double(), -1)
            want = 1.0
            for k, token in enumerate(path):
                want *= float(probs[len(prompt) - 1 + k, token])
            assert tree.scores[node] == pytest.approx(want, rel=1e-3, abs=1e-6), (node, path)
    for i in range(3):
        drafter.release(f"r{i}")
    assert drafter.runner.kv_cache.allocator.num_used == 0


@pytest.mark.parametrize("batch, shape", [(1, (1, 3, 4)), (8, (1, 3, 4)), (8, (2, 4, 8))])
def test_greedy_standalone_is_lossless_and_speculates(models, batch, shape):
    dirs, target, prompts, reference = models
    topk, steps, tokens = shape
    chosen = prompts[:8]
    params = [SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)] * len(chosen)
    plain = run(target, chosen, params, batch=1)
    client = InProcessDrafterClient(standalone(dirs, topk, steps, tokens))
    spec = run(target, chosen, params, client, SpecConfig(num_draft_tokens=tokens if topk > 1 else steps + 1), batch=batch)
    for i, (p, s) in enumerate(zip(plain, spec)):
        assert_greedy_match(s.output_ids, p.output_ids, reference, chosen[i], f"standalone prompt {i} batch {batch}")
        assert s.stats.fallbacks == 0
    accepted = sum(s.stats.accepted_tokens for s in spec)
    steps_verified = sum(s.stats.verify_steps for s in spec)
    assert accepted > 0
    print(f"STANDALONE topk {topk} steps {steps} tokens {tokens} batch {batch}: accept length {1 + accepted / steps_verified:.2f}")
    assert client.drafter.runner.kv_cache.allocator.num_used == 0


def test_catch_ups_padded_to_a_ladder_size_draft_the_same_trees(models):
    """On a GPU a catch-up forward of the draft model (any count of rows: accept lengths, prompts) is padded to a ladder
    size (runner.forward_padded: its GEMMs at row counts cuBLAS has met). Forced here on a CPU: the forwards were padded,
    every request accepts what it accepts unpadded (the same trees), the output is plain decoding's, no page is held."""
    dirs, target, prompts, _ = models
    chosen = prompts[:8]
    params = [SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)] * len(chosen)
    plain = run(target, chosen, params, batch=8)
    stats, rows = {}, {}
    for padded in (False, True):
        drafter = standalone(dirs, 1, 3, 4)
        drafter.runner.pad_eager = padded
        forward, rows[padded] = drafter.runner.forward, []
        drafter.runner.forward = lambda batch, *a, _r=rows[padded], **k: _r.append(batch.input_ids.shape[0]) or forward(batch, *a, **k)
        spec = run(target, chosen, params, InProcessDrafterClient(drafter), SpecConfig(num_draft_tokens=4), batch=8)
        assert [s.output_ids for s in spec] == [p.output_ids for p in plain]
        stats[padded] = [(s.stats.draft_tokens, s.stats.accepted_tokens, s.stats.fallbacks) for s in spec]
        assert drafter.runner.kv_cache.allocator.num_used == 0
    assert stats[True] == stats[False] and sum(a for _, a, _ in stats[True]) > 0
    assert all(n in SIZES for n in rows[True]) and rows[True] != rows[False], rows


def test_seeded_sampling_is_unchanged_by_standalone(models):
    dirs, target, prompts, _ = models
    chosen = prompts[:4]
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=11 + i, max_new_tokens=NEW_TOKENS, ignore_eos=True)
              for i in range(len(chosen))]
    plain = run(target, chosen, params)
    spec = run(target, chosen, params, InProcessDrafterClient(standalone(dirs, 2, 3, 6)), SpecConfig(num_draft_tokens=6))
    assert [s.output_ids for s in spec] == [p.output_ids for p in plain]
    assert sum(s.stats.accepted_tokens for s in spec) > 0 and all(s.stats.fallbacks == 0 for s in spec)


def _flags(**values) -> argparse.Namespace:
    base = {"speculative_algorithm": "STANDALONE", "speculative_num_steps": None, "speculative_eagle_topk": None,
            "speculative_num_draft_tokens": None, "speculative_ngram_max_match_window_size": 12}
    return argparse.Namespace(**{**base, **values})


def test_tree_flags_follow_sglangs_rules():
    assert speculation.tree_shape(_flags(), (3, 1, 4)) == (3, 1, 4)  # all three unset: the automatic choice
    assert speculation.tree_shape(_flags(speculative_num_steps=4, speculative_eagle_topk=2,
                                         speculative_num_draft_tokens=8), (3, 1, 4)) == (4, 2, 8)
    # topk 1: a chain of num_steps + 1 nodes whatever num_draft_tokens says
    assert speculation.tree_shape(_flags(speculative_num_steps=5, speculative_eagle_topk=1,
                                         speculative_num_draft_tokens=3), (3, 1, 4)) == (5, 1, 6)
    with pytest.raises(speculation.FlagError, match="--speculative-eagle-topk"):
        speculation.tree_shape(_flags(speculative_num_steps=4), (3, 1, 4))
    with pytest.raises(speculation.FlagError, match="need at least"):
        speculation.tree_shape(_flags(speculative_num_steps=0, speculative_eagle_topk=2, speculative_num_draft_tokens=4),
                               (3, 1, 4))
    result = lifeline.run([sys.executable, "-P", "-m", "splitspec", "generate", "--prompt", "x", "--speculative-algorithm",
                             "STANDALONE", "--speculative-draft-model-path", str(demo_model_dirs()["draft"]),
                             "--speculative-num-draft-tokens", "6"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "set all of --speculative-num-steps" in result.stderr
    result = lifeline.run([sys.executable, "-P", "-m", "splitspec", "generate", "--prompt", "x", "--speculative-algorithm",
                             "STANDALONE"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "needs --speculative-draft-model-path" in result.stderr


def test_standalone_drafter_process_over_tcp_equals_plain():
    """verifier + a `splitspec drafter` STANDALONE process at batch 1 and 8."""
    import socket

    from splitspec.generate import generate_ids

    dirs = demo_model_dirs()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    shape = ["--speculative-num-steps", "4", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "8"]
    drafter = spawn_service([sys.executable, "-P", "-m", "splitspec", "drafter", "--verifier-drafter-addr", address,
                                "--drafter-name", "small-llm", "--speculative-algorithm", "STANDALONE", "--dtype", "float32",
                                "--speculative-draft-model-path", str(dirs["draft"]), *shape, "--log-level", "warning"])
    process, stub = start_verifier("--max-total-tokens", "8192", "--drafter-bind-addr", address, "--wait-for-drafters", "1",
                                   "--drafter-timeout-ms", "10000", "--speculative-algorithm", "STANDALONE",
                                   "--speculative-draft-model-path", str(dirs["draft"]), *shape)
    try:
        prompts = [[13, 290, 350 + i, 13, 290, 350 + i, 13, 900 + i] for i in range(8)]
        target = ModelRunner.load(RuntimeConfig(model_path=str(dirs["target"]), dtype="float32", device="cpu", max_total_tokens=4096))
        plain = generate_ids(target, prompts, [SamplingParams(temperature=0.0, max_new_tokens=32)] * 8, set())
        reference = hf_model(dirs["target"])
        for batch in (1, 8):
            results = {}
            for start in range(0, 8, batch):
                group = range(start, start + batch)
                results.update(collect(stub, [submit(f"b{batch}-{i}", prompts[i]) for i in group], batch))
            for i in range(8):
                r = results[f"b{batch}-{i}"]
                assert r["finish"] == pb.FINISH_REASON_LENGTH and r["spec"].fallbacks == 0, r
                assert_greedy_match(r["tokens"], plain[i].output_ids, reference, prompts[i], f"tcp standalone b{batch} {i}")
            accepted = sum(r["spec"].accepted_tokens for r in results.values())
            steps = sum(r["spec"].verify_steps for r in results.values())
            assert accepted > 0
            print(f"STANDALONE over tcp, batch {batch}: accept length {1 + accepted / steps:.2f}")
        assert scrape(stub.metrics_url)[("splitspec:drafter_accepted_tokens_total", (("drafter", "small-llm"),))] > 0
        info = stub.GetModelInfo(pb.ModelInfoRequest())
        assert info.speculative_algorithm == "STANDALONE" and info.speculative_num_draft_tokens == 8
    finally:
        stop(process, stub)
        drafter.kill()
        drafter.wait(timeout=30)


def test_a_prefix_cache_hit_keeps_the_accept_length(models):
    """The same long prompt twice with the radix cache on: the second reuses the cached pages and its
    accept length equals the cold request's (the draft model sees the whole sequence either way)."""
    from splitspec.verifier_svc.engine import Engine
    from splitspec.verifier_svc.prefix_cache import PrefixCache

    dirs, target, prompts, _ = models
    engine = Engine(target, InProcessDrafterClient(standalone(dirs, 2, 4, 8)), SpecConfig(num_draft_tokens=8), set(),
                    prefix_cache=PrefixCache(target.kv_cache.allocator, target.kv_cache.page_size))
    prompt = prompts[13] + prompts[3]
    params = SamplingParams(temperature=0.0, max_new_tokens=64, ignore_eos=True)
    cold = engine.run([prompt], [params])[0]
    warm = engine.run([prompt], [params])[0]
    assert warm.cached_tokens > 0 and warm.output_ids == cold.output_ids
    assert cold.stats.accepted_tokens > 0 and warm.stats.mean_accept_length == cold.stats.mean_accept_length
    engine.prefix_cache.evict(target.kv_cache.num_pages)
