"""The device-fed drafted step (verifier_svc.device_fed): the demo target with its EAGLE-3 head in process, top-1
chains, each next verification launched from the last one's device results before it lands. Outputs equal plain
decoding's (greedy), the same drafts are proposed and accepted as without it, steps were fed, and requests that end,
arrive and abort mid-run leave every page returned."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from test_catch_up_ahead import demo_pair  # noqa: F401 (a fixture)
from test_draft_loading import eagle3_flags

from splitspec.demo import demo_model_dirs
from splitspec.engine_args import in_process_drafter
from splitspec.generate import generate_ids
from splitspec.runtime.launched_draft import PendingChain
from splitspec.runtime.runner import ModelRunner, RuntimeConfig
from splitspec.runtime.sampling_params import SamplingParams
from splitspec.speculation import resolve
from splitspec.verifier_svc import device_fed
from splitspec.verifier_svc.engine import Engine


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("SPLITSPEC_TEST_DEVICE") != "cuda",
    reason="needs a CUDA device and SPLITSPEC_TEST_DEVICE=cuda"))]


def _runner(target_dir, device: str) -> ModelRunner:
    """The demo target: fp32 on a CPU; on a GPU bf16 with CUDA graphs (whose attention moves a fed batch back on the
    device: runtime.batch_shift)."""
    gpu = dict(dtype="bfloat16", device="cuda", attention_backend="flashinfer") if device == "cuda" else {}
    return ModelRunner.load(RuntimeConfig(model_path=str(target_dir), **{"dtype": "float32", "device": "cpu", **gpu},
                                          max_total_tokens=4096))


def _engine(target_dir, fed: bool, monkeypatch, device: str = "cpu"):
    """(engine, runner, drafter client, fed launches so far as a one-item list)."""
    monkeypatch.setenv(device_fed.ENV, "1" if fed else "0")
    runner = _runner(target_dir, device)
    extra = ("--dtype", "bfloat16", "--device", "cuda", "--attention-backend", "flashinfer") if device == "cuda" else \
        ("--dtype", "float32", "--device", "cpu")
    flags = eagle3_flags(demo_model_dirs(heads=True)["eagle3"], "--speculative-num-steps", "4", "--speculative-eagle-topk",
                         "1", "--speculative-num-draft-tokens", "5", *extra)
    client, spec = in_process_drafter(resolve(flags), 4096, runner)
    spec = dataclasses.replace(spec, adaptive=False)  # fixed trees (the CPU's default; --speculative-adaptive off)
    if device == "cuda":  # the verification's graphs, as the verifier captures them
        runner.capture_cuda_graphs(tree_nodes=(5,))
    engine = Engine(runner, client, spec, set(), overlap_schedule=True)
    assert engine.device_fed == fed
    launches = [0]
    launch = engine._launch_fed
    engine._launch_fed = lambda flight: (lambda got: (launches.__setitem__(0, launches[0] + (got is not None)), got)[1])(
        launch(flight))
    return engine, runner, client, launches


def _drive(engine, prompts, params, arrivals=(), aborts=()):
    """Every request to its end; arrivals: (step, prompt, params) added at that step; aborts: (step, index) aborted."""
    requests = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    step = 0
    while engine.has_work:
        for at, prompt, sp in arrivals:
            if at == step:
                requests.append(engine.add_request(prompt, sp))
        for at, index in aborts:
            if at == step:
                engine.abort(requests[index])
        engine.step()
        step += 1
    return requests


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch", [1, 3])
def test_fed_steps_keep_greedy_outputs_and_the_same_drafts(demo_pair, batch, device, monkeypatch):  # noqa: F811
    """On a GPU (bf16, graphs) against the same engine unfed: the same outputs, chains and scores (plain decoding's
    outputs may part from speculation's there at a bf16 near-tie)."""
    target_dir, prompts = demo_pair
    prompts = prompts[:batch]
    # different limits: requests end at different steps, one while its successor is in flight
    params = [SamplingParams(temperature=0.0, max_new_tokens=24 + 7 * i, ignore_eos=True) for i in range(batch)]
    plain = generate_ids(_runner(target_dir, device), prompts, params, set())
    runs, chains = {}, {}
    resolve = PendingChain.resolve
    for fed in (False, True):
        engine, runner, client, launches = _engine(target_dir, fed, monkeypatch, device)
        drafted = chains[fed] = []  # every verified chain's drafts and the head's scores for them, in order
        monkeypatch.setattr(PendingChain, "resolve", lambda chain, root, vocab: (lambda tree: (
            drafted.append((tree.tokens, tree.scores)), tree)[1])(resolve(chain, root, vocab)))
        used = runner.kv_cache.allocator.num_used, client.drafter.runner.kv_cache.allocator.num_used  # graphs' scratch
        out = _drive(engine, prompts, params)
        assert (runner.kv_cache.allocator.num_used, client.drafter.runner.kv_cache.allocator.num_used) == used
        assert not client.drafter._ahead  # every catch-up ahead kept
        runs[fed] = (out, launches[0])
    (before, none), (after, fed_steps) = runs[False], runs[True]
    # the head caught up on the fed steps at their lengths: the same chains, scored alike (not at shifted positions)
    assert len(chains[True]) == len(chains[False]) > 0
    for (tokens, scores), (want_tokens, want_scores) in zip(chains[True], chains[False]):
        assert tokens == want_tokens and scores == pytest.approx(want_scores, rel=1e-4 if device == "cpu" else 2e-2,
                                                                 abs=1e-6 if device == "cpu" else 1e-3)
    assert none == 0 and fed_steps > 0
    for p, b, a in zip(plain, before, after):
        assert a.output_ids == b.output_ids and (device != "cpu" or a.output_ids == p.output_ids)
        assert a.stats.fallbacks == 0
    assert sum(r.stats.accepted_tokens for r in after) > 0
    assert [(r.stats.draft_tokens, r.stats.accepted_tokens, r.stats.verify_steps) for r in after] == \
        [(r.stats.draft_tokens, r.stats.accepted_tokens, r.stats.verify_steps) for r in before]
    steps = sum(r.stats.verify_steps for r in after)
    print(f"batch {batch}: {fed_steps} of {steps} verifications launched fed")
    assert fed_steps >= steps // batch // 2  # most steps of a run fed (the first of each run is not)


def test_arrivals_and_aborts_end_a_fed_run_and_outputs_stay(demo_pair, monkeypatch):  # noqa: F811
    target_dir, prompts = demo_pair
    greedy = SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True)
    plain = generate_ids(ModelRunner.load(RuntimeConfig(model_path=str(target_dir), dtype="float32", device="cpu",
                                                        max_total_tokens=4096)), prompts[:4], [greedy] * 4, set())
    engine, runner, client, launches = _engine(target_dir, True, monkeypatch)
    out = _drive(engine, prompts[:2], [greedy] * 2, arrivals=[(4, prompts[2], greedy), (9, prompts[3], greedy)],
                 aborts=[(7, 1)])
    assert launches[0] > 0
    assert out[1].finish_reason == "abort" and len(out[1].output_ids) < 30
    assert out[1].output_ids == plain[1].output_ids[: len(out[1].output_ids)]
    for i in (0, 2, 3):
        assert out[i].output_ids == plain[i].output_ids and out[i].stats.accepted_tokens > 0
    assert runner.kv_cache.allocator.num_used == 0 and client.drafter.runner.kv_cache.allocator.num_used == 0
    assert not client.drafter._ahead
