"""The head's catch-up queued before acceptance (verifier_svc.catch_up_ahead): the demo EAGLE-3 head caught up on
every row of a verified chain and kept to its accepted rows is in the state a catch-up on the accepted rows alone
leaves (the same length, root, and next drafts); in the engine, top-1 drafting with it gives plain decoding's greedy
outputs and a seeded request's text unchanged, drafts what the catch-up after acceptance drafts, launches the next
draft with it, and a drafter that fails there falls back to sending the states."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from test_draft_loading import eagle3_flags
from test_launched_draft import eagle3_drafter, opened
from test_speculative import PROMPTS

from splitspec import kernels
from splitspec.demo import demo_model_dirs
from splitspec.draft_models import build_drafter
from splitspec.engine_args import in_process_drafter
from splitspec.generate import generate_ids
from splitspec.runtime.runner import ModelRunner, RuntimeConfig
from splitspec.runtime.sampling_params import SamplingParams
from splitspec.speculation import resolve
from splitspec.verifier_svc import catch_up_ahead


def acceptance(tokens: torch.Tensor, accepted: list[int], lengths: list[int]) -> torch.Tensor:
    """kernels.chain_acceptance of chains verified by tokens [B, n] (the target's) whose drafts equal the first
    accepted[b] of them and nothing after."""
    count, n = tokens.shape
    ids = torch.full((count, n), -1, dtype=tokens.dtype, device=tokens.device)  # -1 equals no token
    for b, a in enumerate(accepted):
        ids[b, 1 : a + 1] = tokens[b, :a]
    out = kernels.chain_acceptance(tokens.reshape(-1).contiguous(), ids.reshape(-1),
                                   torch.tensor(lengths, device=tokens.device), n)
    assert out[0].tolist() == accepted and out[2].tolist() == [v + 1 + a for v, a in zip(lengths, accepted)]
    return out


def test_a_chain_caught_up_ahead_and_kept_leaves_the_head_as_a_catch_up_of_the_accepted_rows():
    """Two drafters in the same state; a step's chains of 5 rows (random target tokens and states) accepting 0, 2 and
    4 drafts. One is extended with each chain's accepted rows and drafts; the other catches up on every row ahead,
    keeps the accepted ones and drafts: the same lengths, roots and trees, and the ahead rows' pages go back."""
    n, accepted = 5, [0, 2, 4]
    generator = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, 4096, (3, n), generator=generator)
    trees, roots, lengths, states = {}, {}, {}, None
    for how in ("after", "ahead"):
        drafter = eagle3_drafter(1, 4, n)
        ids = opened(drafter, [9, 14, 6], seed=5)
        drafter.launch(ids, [n] * 3).trees()  # caught up on what was opened: nothing pending, as after a drafted step
        if states is None:
            states = torch.randn(3 * n, drafter.runner.model.fc_input_size, generator=generator)
        if how == "after":
            for k, (r, a) in enumerate(zip(ids, accepted)):
                drafter.extend(r, tokens[k, : a + 1].tolist(), states[k * n : k * n + a + 1])
        else:
            verified = [drafter.states[r].table.num_tokens for r in ids]
            free = drafter.runner.kv_cache.allocator.num_free
            wrong = [v + 1 for v in verified]
            assert not drafter.catch_up_ahead(ids, wrong, tokens, states, acceptance(tokens, accepted, wrong))
            assert drafter.runner.kv_cache.allocator.num_free == free  # declined: nothing reserved, nothing queued
            assert drafter.catch_up_ahead(ids, verified, tokens, states, acceptance(tokens, accepted, verified))
            drafter.keep_ahead({r: tokens[k, : a + 1].tolist() for k, (r, a) in enumerate(zip(ids, accepted))})
            with pytest.raises(RuntimeError):
                drafter.keep_ahead({})  # spent
        trees[how] = drafter.launch(ids, [n] * 3).trees()
        roots[how] = [drafter.states[r].root_feature.clone() for r in ids]
        lengths[how] = [(drafter.states[r].table.num_tokens, len(drafter.states[r].table.pages)) for r in ids]
    assert lengths["ahead"] == lengths["after"]
    for a, b in zip(roots["ahead"], roots["after"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert [(t.tokens, t.parents) for t in trees["ahead"]] == [(t.tokens, t.parents) for t in trees["after"]]


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("SPLITSPEC_TEST_DEVICE") != "cuda",
    reason="needs a CUDA device and SPLITSPEC_TEST_DEVICE=cuda"))]


@pytest.mark.parametrize("device", DEVICES)
def test_a_draft_launched_with_the_catch_up_ahead_is_the_draft_launched_after_it(device):
    """The draft loop launched with a catch-up ahead (DraftLoop.launch_ahead: each request's key count known on the
    device only; on a GPU written into the graph's attention arena after its plan) and taken by the next launch()
    drafts what a loop launched after acceptance from the same roots drafts: the same chains, the same scores."""
    extra = ("--device", "cuda", "--dtype", "bfloat16", "--attention-backend", "flashinfer") if device == "cuda" else ()
    n, accepted = 6, [1, 5, 3]
    drafter = build_drafter(resolve(eagle3_flags(demo_model_dirs(heads=True)["eagle3"], "--speculative-num-steps", "5",
                                                 "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(n),
                                                 "--max-total-tokens", "4096", *extra)))
    if device == "cuda":
        assert drafter.loop.graphs, "no draft loop graphs captured"
    ids = opened(drafter, [40, 75, 23], seed=2)
    drafter.launch(ids, [n] * 3).trees()
    generator = torch.Generator().manual_seed(4)
    width = drafter.runner.model.fc_input_size
    tokens = torch.randint(0, 4096, (3, n), generator=generator).to(device)
    states = torch.randn(3 * n, width, generator=generator).to(device, drafter.runner.dtype)
    lengths = [drafter.states[r].table.num_tokens for r in ids]
    assert drafter.catch_up_ahead(ids, lengths, tokens, states, acceptance(tokens, accepted, lengths))
    assert drafter._ahead_run is not None  # launched with it
    drafter.keep_ahead({r: tokens[k, : a + 1].tolist() for k, (r, a) in enumerate(zip(ids, accepted))})
    taken = drafter.launch(ids, [n] * 3).trees()
    assert drafter._ahead_run is None
    states_now = [drafter.states[r] for r in ids]
    again = drafter.loop.launch([s.last_token for s in states_now], states_now[0].root_logit_rows,
                                states_now[0].root_rows, [s.table for s in states_now], [n] * 3).finish()
    assert [(t.tokens, t.parents) for t in taken] == [(t.tokens, t.parents) for t in again]
    assert [t.scores for t in taken] == [t.scores for t in again]
    assert [s.table.num_tokens for s in states_now] == [length + a + 1 for length, a in zip(lengths, accepted)]


@pytest.fixture(scope="module")
def demo_pair():
    from transformers import AutoTokenizer

    target_dir = demo_model_dirs()["target"]
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    return target_dir, [tokenizer.encode(p) for p in PROMPTS[:6]]


def _run(target_dir, prompts, params, batch: int, ahead: bool, monkeypatch, broken: bool = False):
    """The demo target with its EAGLE-3 head in process, top-1 chains of 4 drafts, fixed budget; (requests, how many
    verified chains the head caught up on ahead and kept, how many draft loops were launched when asked, not with a
    catch-up ahead)."""
    monkeypatch.setenv(catch_up_ahead.ENV, "1" if ahead else "0")
    runner = ModelRunner.load(RuntimeConfig(model_path=str(target_dir), dtype="float32", device="cpu", max_total_tokens=4096))
    flags = eagle3_flags(demo_model_dirs(heads=True)["eagle3"], "--speculative-num-steps", "4", "--speculative-eagle-topk",
                         "1", "--speculative-num-draft-tokens", "5", "--dtype", "float32", "--device", "cpu")
    client, spec = in_process_drafter(resolve(flags), 4096, runner)
    kept, launched = [], []
    keep, launch = client.drafter.keep_ahead, client.drafter.loop.launch
    client.drafter.keep_ahead = lambda got: (kept.append(len(got)), keep(got))[1]
    client.drafter.loop.launch = lambda *args: (launched.append(1), launch(*args))[1]  # not with the catch-up ahead
    if broken:
        def fail(*args, **kwargs):
            raise RuntimeError("a drafter that fails to catch up ahead")
        client.drafter.catch_up_ahead = fail
    out = []
    for start in range(0, len(prompts), batch):
        out += generate_ids(runner, prompts[start : start + batch], params[start : start + batch], set(),
                            drafter=client, spec=spec)
    assert runner.kv_cache.allocator.num_used == 0 and client.drafter.runner.kv_cache.allocator.num_used == 0
    return out, sum(kept), len(launched)


@pytest.mark.parametrize("batch", [1, 3])
def test_top1_drafting_with_the_catch_up_ahead_keeps_outputs_and_drafts_what_the_catch_up_after_drafts(demo_pair, batch,
                                                                                                      monkeypatch):
    """Greedy requests (and, at batch 3, a seeded sampled one beside them) with the catch-up ahead and without: the
    same outputs, and plain decoding's for the greedy ones; drafts proposed and accepted, the same numbers both ways
    (the head sees the same rows), no fallbacks; with it on, the head caught up ahead on every verified chain and
    kept its rows, but for each request's last."""
    target_dir, prompts = demo_pair
    greedy = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)
    params = [greedy] * len(prompts)
    if batch == 3:
        params[1] = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_new_tokens=20, ignore_eos=True)
    runner = ModelRunner.load(RuntimeConfig(model_path=str(target_dir), dtype="float32", device="cpu", max_total_tokens=4096))
    plain = generate_ids(runner, prompts, params, set())
    runs = {ahead: _run(target_dir, prompts, params, batch, ahead, monkeypatch) for ahead in (False, True)}
    (before, none, asked_before), (after, caught_up, asked_after) = runs[False], runs[True]
    assert none == 0
    for p, b, a in zip(plain, before, after):
        assert a.output_ids == b.output_ids
        if p.params.temperature == 0:
            assert a.output_ids == p.output_ids
        assert a.stats.fallbacks == 0 and b.stats.fallbacks == 0
    drafted = sum(r.stats.draft_tokens for r in after)
    assert drafted > 0 and sum(r.stats.accepted_tokens for r in after) > 0
    assert [(r.stats.draft_tokens, r.stats.accepted_tokens) for r in after] == \
        [(r.stats.draft_tokens, r.stats.accepted_tokens) for r in before]
    # every verified chain caught up ahead and kept, but the one that ends its request (nothing to keep then)
    chains = sum(r.stats.verify_steps for r in after)
    print(f"batch {batch}: {caught_up} of {chains} verified chains caught up ahead")
    assert caught_up >= chains - len(prompts) > 0, (caught_up, chains)
    # and the draft after it launched with it (DraftLoop.launch_ahead) and taken when asked: a loop launched when
    # asked only for a request's first draft, or where a batch's requests changed (one finished)
    assert asked_after <= len(prompts) < asked_before, (asked_after, asked_before)


def test_a_drafter_that_fails_to_catch_up_ahead_sends_the_states_as_before(demo_pair, monkeypatch, caplog):
    target_dir, prompts = demo_pair
    params = [SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)] * 2
    runner = ModelRunner.load(RuntimeConfig(model_path=str(target_dir), dtype="float32", device="cpu", max_total_tokens=4096))
    plain = generate_ids(runner, prompts[:2], params, set())
    with caplog.at_level(logging.ERROR):
        out, caught_up, _ = _run(target_dir, prompts[:2], params, 2, True, monkeypatch, broken=True)
    assert caught_up == 0 and "failed to catch up ahead" in caplog.text
    for p, s in zip(plain, out):
        assert s.output_ids == p.output_ids and s.stats.fallbacks == 0
    assert sum(s.stats.accepted_tokens for s in out) > 0
