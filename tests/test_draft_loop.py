"""The device draft loop (runtime.draft_loop) against the host reference (runtime.beam_draft.BeamDraft with
forest-masked forwards, drafter_svc.beam_steps.host_beam_draft): the same trees, node for node, for an
EAGLE-3 head (its draft vocabulary mapped through d2t, fed its own outputs) and a standalone draft LM, at
several tree shapes, a batch of prompts of different lengths and a smaller budget for one request. The
loop's cascade attention (cached prefix merged with the beam's own ancestors) is checked against the
torch backend's masked attention on its own too."""

from __future__ import annotations

import pytest
import torch
from test_draft_loading import eagle3_flags

from splitspec.demo import demo_model_dirs
from splitspec.draft_models import build_drafter
from splitspec.speculation import resolve
from splitspec.drafter_svc.standalone import StandaloneDrafter
from splitspec.runtime.attention.base import AttentionBatch, merge_attention
from splitspec.runtime.attention.torch_backend import dense_attention
from splitspec.runtime.kv_cache import BlockTable
from splitspec.runtime.runner import ModelRunner, RuntimeConfig

SHAPES = [(1, 3, 4), (2, 4, 8), (4, 3, 10), (3, 5, 16), (2, 1, 3)]  # topk, steps, tree nodes (steps 1: roots alone)
PROMPT_LENGTHS = (5, 17, 33)


def compare(drafter, ids: list[str], budgets: list[int]) -> None:
    """Draft with the loop, then again (nothing new: the same roots) with the host reference."""
    assert drafter.loop is not None
    fast = drafter.draft(ids, budgets)
    loop, drafter.loop = drafter.loop, None
    try:
        slow = drafter.draft(ids, budgets)
    finally:
        drafter.loop = loop
    for a, b, budget in zip(fast, slow, budgets):
        assert a.num_nodes == b.num_nodes == min(budget, drafter.num_draft_tokens, 1 + loop.num_candidates)
        assert (a.tokens, a.parents) == (b.tokens, b.parents)
        assert a.scores == pytest.approx(b.scores, rel=1e-4, abs=1e-7)


@pytest.mark.parametrize("topk, steps, tokens", SHAPES)
def test_eagle3_loop_trees_equal_the_host_reference(topk, steps, tokens):
    drafter = build_drafter(resolve(eagle3_flags(demo_model_dirs(heads=True)["eagle3"], "--speculative-num-steps", str(steps),
                                         "--speculative-eagle-topk", str(topk),
                                         "--speculative-num-draft-tokens", str(tokens))))
    assert drafter.token_map is not None and drafter.loop.token_map is not None  # draft ids map through d2t
    assert drafter.loop.id_bound == int(drafter.loop.token_map.max()) + 1 <= 4096  # what write_chains copies unclamped
    width = drafter.runner.model.fc_input_size
    generator = torch.Generator().manual_seed(topk * 100 + steps)
    ids = []
    for i, n in enumerate(PROMPT_LENGTHS):
        drafter.open(f"r{i}", [7 + i])
        drafter.extend(f"r{i}", torch.randint(0, 4096, (n,), generator=generator).tolist(),
                       torch.randn(n, width, generator=generator))
        ids.append(f"r{i}")
    compare(drafter, ids, [tokens, tokens, 3])
    for r in ids:
        drafter.release(r)
    assert drafter.runner.kv_cache.allocator.num_used == 0  # the loop writes nothing to the paged cache


@pytest.mark.parametrize("topk, steps, tokens", SHAPES[1:3])
def test_standalone_loop_trees_equal_the_host_reference(topk, steps, tokens):
    runner = ModelRunner.load(RuntimeConfig(model_path=str(demo_model_dirs()["draft"]), dtype="float32", device="cpu",
                                            max_total_tokens=4096, page_size=4))
    drafter = StandaloneDrafter(runner, topk=topk, num_steps=steps, num_draft_tokens=tokens)
    assert drafter.loop.id_bound == runner.model.logits(torch.zeros(1, runner.config.hidden_size)).shape[-1]
    generator = torch.Generator().manual_seed(steps)
    ids = []
    for i, n in enumerate(PROMPT_LENGTHS):
        drafter.open(f"r{i}", torch.randint(0, 4096, (n,), generator=generator).tolist())
        ids.append(f"r{i}")
    compare(drafter, ids, [tokens, 2, tokens])


def test_cascade_attention_equals_masked_attention():
    """Prefix attention (paged, nothing written) merged with attention over the rows' own keys equals one
    masked attention over both (the torch backend's run, with the own keys written as a tree's)."""
    runner = ModelRunner.load(RuntimeConfig(model_path=str(demo_model_dirs()["draft"]), dtype="float32", device="cpu",
                                            max_total_tokens=512, page_size=4))
    kv, backend, config = runner.kv_cache, runner.backend, runner.config
    hq, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    generator = torch.Generator().manual_seed(0)
    prefix, own = 11, 3  # a chain of 3 new keys: row j sees the prefix and own keys 0..j
    table = BlockTable()
    kv.reserve(table, prefix + own)
    k_flat, v_flat = kv.flat_kv(0)
    slots = kv.slot_ids(table, 0, prefix)
    k_flat[slots] = torch.randn(prefix, hkv, d, generator=generator)
    v_flat[slots] = torch.randn(prefix, hkv, d, generator=generator)
    q = torch.randn(own, hq, d, generator=generator)
    k_own, v_own = torch.randn(own, hkv, d, generator=generator), torch.randn(own, hkv, d, generator=generator)
    plan = backend.plan_prefix([prefix], [table.pages], [own])  # one request, its own rows of q
    out_prefix, lse_prefix = backend.attend_prefix(0, q, plan)
    valid = torch.ones(own, own, dtype=torch.bool).tril()
    out_own, lse_own = dense_attention(q, k_own[None].expand(own, -1, -1, -1), v_own[None].expand(own, -1, -1, -1),
                                       valid, backend.scaling)
    merged = merge_attention(out_prefix, lse_prefix, out_own, lse_own)
    batch = AttentionBatch([own], [prefix + own], [table.pages], kv.slot_ids(table, prefix, prefix + own),
                           torch.arange(prefix, prefix + own), [valid])
    want = backend.run(0, q, k_own, v_own, backend.plan(batch))
    torch.testing.assert_close(merged, want, rtol=1e-5, atol=1e-5)


def test_decode_attention_mode_verifies_as_prefill_mode_does():
    """--speculative-attention-mode decode (tree nodes as decode rows over the prefix, merged with the tree's
    own nodes under its mask): greedy NGRAM speculation gives prefill mode's outputs token for token, with
    drafts accepted and no fallbacks, and every verify step went through the decode-mode plan."""
    from test_speculative import PROMPTS, REPETITIVE, ngram, run
    from transformers import AutoTokenizer

    from splitspec.runtime.attention.tree_decode import DecodeModeBackend, TreePlan
    from splitspec.runtime.sampling_params import SamplingParams
    from splitspec.verifier_svc.engine import SpecConfig

    target = demo_model_dirs()["target"]
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = [tokenizer.encode(PROMPTS[i]) for i in REPETITIVE]
    params = [SamplingParams(temperature=0.0, max_new_tokens=32, ignore_eos=True)] * len(prompts)
    outputs = {}
    for mode in ("prefill", "decode"):
        runner = ModelRunner.load(RuntimeConfig(model_path=str(target), dtype="float32", device="cpu",
                                                max_total_tokens=4096, page_size=16, attention_mode=mode))
        assert isinstance(runner.backend, DecodeModeBackend) == (mode == "decode")
        tree_plans = 0
        if mode == "decode":
            plan = runner.backend.plan

            def counting(batch):
                nonlocal tree_plans
                made = plan(batch)
                tree_plans += isinstance(made, TreePlan)
                return made

            runner.backend.plan = counting
        outputs[mode] = run(runner, prompts, params, ngram(), SpecConfig(num_draft_tokens=8), batch=len(prompts))
    verify_steps = sum(r.stats.verify_steps for r in outputs["decode"])
    assert verify_steps > 0 and tree_plans > 0
    for a, b in zip(outputs["prefill"], outputs["decode"]):
        assert a.output_ids == b.output_ids
        assert b.stats.accepted_tokens > 0 and b.stats.fallbacks == 0
