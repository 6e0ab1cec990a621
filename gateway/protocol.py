"""OpenAI request bodies checked into plain objects, and the error object (REFERENCES §7).

Every parameter of OpenAI's CreateChatCompletionRequest / CreateCompletionRequest is known here: the
ones splitspec serves are checked for type and range; the ones it does not serve are accepted at their
neutral value (null, false, an empty list, "auto", ...) and refused with a 400 naming them otherwise;
a parameter OpenAI does not define is refused too (OpenAI answers "Unrecognized request argument").
Extensions, as in vLLM and SGLang: `top_k`, `repetition_penalty`, `ignore_eos`, `speculative`
(false: no drafts for this request).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from splitspec.runtime.sampling_params import MAX_SEED, MAX_TOP_LOGPROBS

MAX_STOP_SEQUENCES = 4
MAX_N = 16
MAX_BATCH_CHOICES = 128  # completions: prompts x n in one request
ROLES = ("system", "developer", "user", "assistant", "tool")


class APIError(Exception):
    """An OpenAI error: HTTP status, message, type, param, code."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str | None, message: str, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


@dataclass
class Generation:
    """What one request asks for, endpoint-independent."""

    model: str
    prompts: list[str | list[int]] = field(default_factory=list)  # completions: texts or token ids, one or a batch
    messages: list[dict] | None = None  # chat
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    speculative: bool = True
    user: str | None = None


# neutral values of the OpenAI parameters splitspec does not serve
def _none(v):
    return v is None


def _empty(v):
    return v is None or v == [] or v == {}


def _false(v):
    return v is None or v is False


NEUTRAL_CHAT = {
    "logit_bias": _empty, "tools": _empty, "functions": _empty, "function_call": lambda v: v in (None, "none", "auto"),
    "tool_choice": lambda v: v in (None, "none", "auto"), "parallel_tool_calls": lambda v: v is None or isinstance(v, bool),
    "response_format": lambda v: v is None or v == {"type": "text"}, "audio": _none, "modalities": lambda v: v in (None, ["text"]),
    "prediction": _none, "reasoning_effort": _none, "web_search_options": _none, "store": _false,
    "metadata": lambda v: v is None or isinstance(v, dict), "service_tier": lambda v: v in (None, "auto", "default"),
    "verbosity": _none, "prompt_cache_key": lambda v: v is None or isinstance(v, str),
    "safety_identifier": lambda v: v is None or isinstance(v, str),
}
NEUTRAL_COMPLETION = {
    "logit_bias": _empty, "echo": _false, "best_of": lambda v: v in (None, 1), "suffix": lambda v: v in (None, ""),
}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not _is_number(v):
        raise invalid(name, f"'{name}' must be a number, got {_show(v)}", "invalid_type")
    if v < low or v > high or (low_open and v == low):
        bracket = "(" if low_open else "["
        raise invalid(name, f"'{name}' must be in {bracket}{low}, {high}], got {v}")
    return float(v)


def _int(body: dict, name: str, default, low: int, high: int):
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v):
        raise invalid(name, f"'{name}' must be an integer, got {_show(v)}", "invalid_type")
    if not low <= v <= high:
        raise invalid(name, f"'{name}' must be in [{low}, {high}], got {v}")
    return v


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(name, f"'{name}' must be a boolean, got {_show(v)}", "invalid_type")
    return v


def _show(v) -> str:
    text = repr(v)
    return f"{type(v).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"


def _common(body: dict, neutral: dict, served: set[str]) -> Generation:
    for name, value in body.items():
        if name in served:
            continue
        if name in neutral:
            if not neutral[name](value):
                raise invalid(name, f"'{name}' is not supported by this server (only its neutral value is accepted)",
                              "unsupported_parameter")
            continue
        raise invalid(name, f"Unrecognized request argument supplied: {name}", "unknown_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "'model' is required and must be a non-empty string", "missing_required_parameter"
                      if model is None else "invalid_type")
    g = Generation(model=model)
    g.temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    g.top_p = _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)
    top_k = _int(body, "top_k", -1, -1, 2**31 - 1)
    g.top_k = -1 if top_k == 0 else top_k
    g.seed = _int(body, "seed", None, -(2**63), 2**64 - 1)
    if g.seed is not None:
        g.seed %= MAX_SEED  # OpenAI takes any int64; the engine keys noise by a non-negative one
    g.n = _int(body, "n", 1, 1, MAX_N)
    g.stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None:
        if not g.stream:
            raise invalid("stream_options", "'stream_options' is only allowed when 'stream' is true")
        if not isinstance(options, dict) or set(options) - {"include_usage", "include_obfuscation"}:
            raise invalid("stream_options", "'stream_options' must be an object with 'include_usage'", "invalid_type")
        g.include_usage = _bool(options, "include_usage", False)
    g.frequency_penalty = _number(body, "frequency_penalty", 0.0, -2.0, 2.0)
    g.presence_penalty = _number(body, "presence_penalty", 0.0, -2.0, 2.0)
    g.repetition_penalty = _number(body, "repetition_penalty", 1.0, 0.0, 10.0, low_open=True)
    g.ignore_eos = _bool(body, "ignore_eos", False)
    g.speculative = _bool(body, "speculative", True)
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise invalid("stop", "'stop' must be a string or a list of strings", "invalid_type")
        if len(stops) > MAX_STOP_SEQUENCES:
            raise invalid("stop", f"'stop' takes at most {MAX_STOP_SEQUENCES} sequences, got {len(stops)}")
        g.stop = [s for s in stops if s]
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise invalid("user", "'user' must be a string", "invalid_type")
    g.user = user
    return g


CHAT_SERVED = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop",
               "n", "stream", "stream_options", "user", "logprobs", "top_logprobs", "frequency_penalty", "presence_penalty",
               "repetition_penalty", "ignore_eos", "speculative"}
COMPLETION_SERVED = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream",
                     "stream_options", "user", "logprobs", "frequency_penalty", "presence_penalty", "repetition_penalty",
                     "ignore_eos", "speculative"}


def parse_chat(body) -> Generation:
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object", "invalid_type")
    g = _common(body, NEUTRAL_CHAT, CHAT_SERVED)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "'messages' must be a non-empty list", "invalid_type" if messages is not None
                      else "missing_required_parameter")
    g.messages = [_message(i, m) for i, m in enumerate(messages)]
    limit = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    g.max_tokens = _int(body, limit, None, 1, 2**31 - 1)
    g.logprobs = _bool(body, "logprobs", False)
    g.top_logprobs = _int(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
    if body.get("top_logprobs") is not None and not g.logprobs:
        raise invalid("top_logprobs", "'top_logprobs' needs 'logprobs' set to true")
    return g


def _message(i: int, m) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise invalid(where, f"'{where}' must be an object", "invalid_type")
    role = m.get("role")
    if role not in ROLES:
        raise invalid(f"{where}.role", f"'{where}.role' must be one of {', '.join(ROLES)}, got {_show(role)}")
    content = m.get("content")
    if isinstance(content, list):  # content parts: text only
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid(f"{where}.content[{j}]", f"'{where}.content[{j}]' must be a text part "
                              "({'type': 'text', 'text': ...}); this server reads text only")
            texts.append(part["text"])
        content = "".join(texts)
    if content is None and role == "assistant":
        content = ""
    if not isinstance(content, str):
        raise invalid(f"{where}.content", f"'{where}.content' must be a string or a list of text parts", "invalid_type")
    message = {"role": role, "content": content}
    name = m.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise invalid(f"{where}.name", f"'{where}.name' must be a string", "invalid_type")
        message["name"] = name
    for key in m:
        if key not in ("role", "content", "name", "tool_call_id", "tool_calls", "refusal"):
            raise invalid(f"{where}.{key}", f"Unrecognized field '{where}.{key}'", "unknown_parameter")
    if m.get("tool_calls"):
        raise invalid(f"{where}.tool_calls", "tool calls are not supported by this server", "unsupported_parameter")
    return message


def parse_completion(body, vocab_size: int) -> Generation:
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object", "invalid_type")
    g = _common(body, NEUTRAL_COMPLETION, COMPLETION_SERVED)
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt)):
        batch = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        batch = prompt  # OpenAI's batch: several texts or token-id lists
    else:
        raise invalid("prompt", "'prompt' must be a string, a list of token ids, or a non-empty list of either",
                      "missing_required_parameter" if prompt is None else "invalid_type")
    if len(batch) * g.n > MAX_BATCH_CHOICES:
        raise invalid("prompt", f"{len(batch)} prompts x n={g.n} choices is more than {MAX_BATCH_CHOICES}")
    for i, p in enumerate(batch):
        where = "prompt" if len(batch) == 1 else f"prompt[{i}]"
        if isinstance(p, str):
            if not p:
                raise invalid(where, f"'{where}' is empty")
        elif not p or not all(_is_int(t) for t in p):
            raise invalid(where, f"'{where}' must be a non-empty string or list of token ids", "invalid_type")
        else:
            bad = next((t for t in p if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise invalid(where, f"token id {bad} in '{where}' is outside the vocabulary [0, {vocab_size})")
        g.prompts.append(p if isinstance(p, str) else list(p))
    g.max_tokens = _int(body, "max_tokens", 16, 1, 2**31 - 1)  # OpenAI's default for completions
    lp = _int(body, "logprobs", None, 0, 5)  # OpenAI's limit for completions
    g.logprobs, g.top_logprobs = lp is not None, lp or 0
    return g
