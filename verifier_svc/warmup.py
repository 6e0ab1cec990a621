"""The verifier's warm-up before it reports serving (SGLang warms its server up the same way; its flag
--skip-server-warmup skips it here too).

On a GPU, kernels compile on their first use: FlashInfer JIT-compiles each attention family (about 40 s
each on a cold cache) and Triton each kernel. CUDA-graph capture compiled the decode and tree-verification
kernels; a prompt's prefill, a prompt over a cached prefix and the samplers compile on the first request
that needs them, so without this the first users wait a minute and a deployment's readiness says nothing.
Two requests run through the engine before the step loop starts, with no drafting and no metrics: a
greedy prompt (prefill, then decode) and the same prompt sampled (a cached prefix, the sampling kernels).
Then one forward verifies a small draft tree beside a prompt chunk, eagerly: attention under a custom mask is
a FlashInfer family of its own, and a step that mixes a prompt with drafts (or verifies trees of a size no
graph holds) would otherwise compile it for the first users, the engine silent meanwhile (seen on an H200:
"the engine has sent nothing for 15 s", for about 50 s, in a served EAGLE-3 run's first load).
Their pages are freed again (the prefix cache evicts them), so no user prompt meets them, and the load-adaptive
policy starts fresh after them (a forward that compiled for a minute is not what a step costs).
"""

from __future__ import annotations

import logging
import time

from splitspec.runtime.batch import SequenceInput
from splitspec.runtime.kv_cache import BlockTable
from splitspec.runtime.sampling_params import SamplingParams
from splitspec.runtime.tree import positions, tree_mask
from splitspec.verifier_svc.engine import Engine

logger = logging.getLogger("splitspec.verifier")
PROMPT_TOKENS = 40  # two full KV pages of 16 and a partial one: a cached prefix and a new tail


def warm_up(engine: Engine) -> float:
    """Run the warm-up requests to the end; the seconds it took."""
    began = time.perf_counter()
    vocab = engine.runner.config.vocab_size
    prompt = [(7 + 31 * i) % vocab for i in range(PROMPT_TOKENS)]
    for params in (SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True),
                   SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=0, max_new_tokens=4, ignore_eos=True)):
        engine.add_request(prompt, params, speculate=False)
        while engine.has_work:
            engine.step()
    _warm_tree_attention(engine)
    engine.restart_adaptive()  # its first forwards' compile times are not what a step costs
    cache = engine.prefix_cache
    if cache is not None:  # not a user's eviction: the count stays as it was
        evicted = cache.evicted_pages
        cache.evict(cache.num_evictable)
        cache.evicted_pages = evicted
    seconds = time.perf_counter() - began
    logger.info("warmed up in %.1f s (prefill, a cached prefix, decode, sampling and tree attention compiled before "
                "serving)", seconds)
    return seconds


WARM_TREE = (-1, 0, 0, 1)  # a root, two children and a grandchild: a mask that is neither causal nor full


def _warm_tree_attention(engine: Engine) -> None:
    """One eager forward of a draft tree (after a committed context) beside a prompt chunk, in pages of its own,
    released after."""
    runner, kv = engine.runner, engine.runner.kv_cache
    vocab = runner.config.vocab_size
    tokens = [(11 + 17 * i) % vocab for i in range(PROMPT_TOKENS)]
    context, prompt = BlockTable(), BlockTable()
    try:
        runner.forward(runner.batch([SequenceInput(context, tokens, logits="none")]))
        kv.set_length(context, len(tokens))
        tree = [tokens[-1], *tokens[: len(WARM_TREE) - 1]]
        runner.forward(runner.batch([
            SequenceInput(prompt, tokens, logits="last"),
            SequenceInput(context, tree, positions(WARM_TREE, len(tokens)), tree_mask(WARM_TREE), "all", WARM_TREE)]))
    finally:
        kv.release(context)
        kv.release(prompt)
