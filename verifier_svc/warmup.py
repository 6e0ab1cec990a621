"""The verifier's warm-up before it reports serving (SGLang warms its server up the same way; its flag
--skip-server-warmup skips it here too).

On a GPU, kernels compile on their first use: FlashInfer JIT-compiles each attention family (about 40 s
each on a cold cache) and Triton each kernel. CUDA-graph capture compiled the decode and tree-verification
kernels; a prompt's prefill, a prompt over a cached prefix and the samplers compile on the first request
that needs them, so without this the first users wait a minute and a deployment's readiness says nothing.
Two requests run through the engine before the step loop starts, with no drafting and no metrics: a
greedy prompt (prefill, then decode) and the same prompt sampled (a cached prefix, the sampling kernels).
Their pages are freed again (the prefix cache evicts them), so no user prompt meets them, and the load-adaptive
policy starts fresh after them (a forward that compiled for a minute is not what a step costs).
"""

from __future__ import annotations

import logging
import time

from splitspec.runtime.sampling_params import SamplingParams
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
    engine.restart_adaptive()  # its first forwards' compile times are not what a step costs
    cache = engine.prefix_cache
    if cache is not None:  # not a user's eviction: the count stays as it was
        evicted = cache.evicted_pages
        cache.evict(cache.num_evictable)
        cache.evicted_pages = evicted
    seconds = time.perf_counter() - began
    logger.info("warmed up in %.1f s (prefill, a cached prefix, decode and sampling compiled before serving)", seconds)
    return seconds
