"""The verifier's warm-up (verifier_svc/warmup.py): it runs on the engine before serving and leaves nothing
behind that a user could meet: no pages held, an empty prefix cache, no counted evictions, and the first
user's requests generate (and speculate) exactly as on an engine that never warmed up."""

from __future__ import annotations

from splitspec.demo import demo_model_dirs
from splitspec.drafter_svc.ngram import NgramConfig, NgramDrafter
from splitspec.generate import generate_ids
from splitspec.runtime.runner import ModelRunner, RuntimeConfig
from splitspec.runtime.sampling_params import SamplingParams
from splitspec.verifier_svc.drafter_client import InProcessDrafterClient
from splitspec.verifier_svc.engine import Engine, SpecConfig
from splitspec.verifier_svc.prefix_cache import PrefixCache
from splitspec.verifier_svc.warmup import PROMPT_TOKENS, WARM_TREE, warm_up


def test_warm_up_leaves_no_trace_and_outputs_stay_plain_decodings():
    runner = ModelRunner.load(RuntimeConfig(model_path=str(demo_model_dirs()["target"]), dtype="float32", device="cpu",
                                            max_total_tokens=4096))
    allocator = runner.kv_cache.allocator
    cache = PrefixCache(allocator, runner.kv_cache.page_size)
    engine = Engine(runner, InProcessDrafterClient(NgramDrafter(NgramConfig())), SpecConfig(num_draft_tokens=6), set(),
                    prefix_cache=cache)
    before = allocator.num_free
    batches = []  # every forward's sequences: (new tokens, tree parents or None)
    forward = runner.forward
    runner.forward = lambda batch, **kw: (batches.append(list(zip(batch.attention.q_lens, batch.attention.trees))),
                                          forward(batch, **kw))[1]
    assert warm_up(engine) > 0
    runner.forward = forward
    # a draft tree was verified beside a prompt chunk (the custom-mask attention compiled before serving)
    assert any(len(b) == 2 and b[0] == (PROMPT_TOKENS, None) and b[1] == (len(WARM_TREE), WARM_TREE) for b in batches), batches
    assert not engine.has_work and allocator.num_used == 0 and allocator.num_free == before
    assert cache.num_pages == 0 and cache.evicted_pages == 0
    assert PROMPT_TOKENS > 2 * runner.kv_cache.page_size  # the second request met a cached prefix

    prompts = [list(range(13, 13 + n)) * 3 for n in (5, 9, 7)]
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    reference = [g.output_ids for g in generate_ids(runner, prompts, [params] * len(prompts), set())]
    requests = [engine.add_request(prompt, params) for prompt in prompts]
    drafted = accepted = fallbacks = 0
    while engine.has_work:
        engine.step()
        drafted += engine.report.draft_tokens
        accepted += engine.report.accepted_tokens
        fallbacks += engine.report.fallbacks
    assert [r.output_ids for r in requests] == reference
    assert drafted > 0 and accepted > 0 and fallbacks == 0, (drafted, accepted, fallbacks)
