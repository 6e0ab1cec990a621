"""--log-requests (SGLang's flag): a line in the gateway's log for each request answered, as it ends. What it holds
grows with --log-requests-level, as SGLang's levels do: 0 the request's outcome (endpoint, id, status, choices, prompt
and completion tokens, finish reasons, seconds, speculation's accept length), 1 also its sampling parameters, 2 also
its prompt and each choice's text up to PARTIAL_CHARS characters each, 3 the whole texts."""

from __future__ import annotations

import json
import logging

logger = logging.getLogger("splitspec.gateway")

PARTIAL_CHARS = 2048
LEVELS = (0, 1, 2, 3)


def _cut(text: str, level: int, quote: bool = True) -> str:
    """The text (JSON-quoted unless it is JSON already), cut to PARTIAL_CHARS characters below level 3."""
    shown = text if level >= 3 else text[:PARTIAL_CHARS]
    more = f" (+{len(text) - len(shown)} characters)" if len(shown) < len(text) else ""
    return (json.dumps(shown, ensure_ascii=False) if quote else shown) + more


def _sampling(g) -> str:
    asked = {"max_tokens": g.max_tokens, "temperature": g.temperature, "top_p": g.top_p, "top_k": g.top_k, "n": g.n,
             "seed": g.seed, "stop": g.stop or None, "stream": g.stream, "logprobs": g.top_logprobs if g.logprobs else None,
             "frequency_penalty": g.frequency_penalty or None, "presence_penalty": g.presence_penalty or None,
             "repetition_penalty": g.repetition_penalty if g.repetition_penalty != 1.0 else None,
             "min_p": g.min_p or None, "min_tokens": g.min_tokens or None, "ignore_eos": g.ignore_eos or None,
             "speculative": None if g.speculative else False, "grammar": g.grammar[0] if g.grammar else None,
             "tools": len(g.tools.tools) if g.tools is not None else None}
    return json.dumps({k: v for k, v in asked.items() if v is not None})


def log_request(level: int, endpoint: str, rid: str, status: str, g, prompts: list[list[int]], choices: list,
                seconds: float) -> None:
    """One answered request's line (level: --log-requests-level); g: its protocol.Generation, choices: its
    generations.Choice (this module imports neither: the gateway's parser reads its levels)."""
    steps = sum(c.speculation.verify_steps for c in choices if c.speculation is not None)
    accepted = sum(c.speculation.accepted_tokens for c in choices if c.speculation is not None)
    line = (f"{endpoint} {rid}: {status}, {len(choices)} choice(s), prompt {sum(len(p) for p in prompts)} tokens, "
            f"completion {sum(c.tokens for c in choices)} tokens, finish {[c.finish_reason for c in choices]}, "
            f"{seconds:.3f} s" + (f", accept length {1 + accepted / steps:.2f}" if steps else ""))
    if level >= 1:
        line += f"; sampling {_sampling(g)}"
    if level >= 2:
        if g.messages is not None:
            prompt = "messages " + _cut(json.dumps(g.messages, ensure_ascii=False), level, quote=False)
        else:
            prompt = "prompt " + ", ".join(_cut(p, level) if isinstance(p, str) else f"[{len(p)} token ids]"
                                           for p in g.prompts)
        line += f"; {prompt}; " + "; ".join(f"choice {c.index} {_cut(c.text, level)}" for c in choices)
    logger.info("%s", line)
