"""OpenAI request bodies as typed, bounded models (pydantic), the error object (REFERENCES §7), and the
request schema the gateway publishes at /openapi.json -- generated from the same models that check
requests, so what the schema says and what the server accepts cannot drift apart.

Every parameter of OpenAI's CreateChatCompletionRequest / CreateCompletionRequest is known here: the
ones splitspec serves are checked for type and range; the ones it does not serve are typed as their
neutral value (null, false, an empty list, "auto", ...) and refused with a 400 naming them otherwise;
a parameter OpenAI does not define is refused too (OpenAI answers "Unrecognized request argument").
Extensions, as in vLLM and SGLang: `top_k`, `repetition_penalty`, `ignore_eos`, `speculative`
(false: no drafts for this request). Types are strict, as JSON's: 1 is not a boolean, "2" not a number.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, ValidationError, ValidationInfo, WrapValidator,
                      model_validator)
from pydantic.json_schema import models_json_schema
from pydantic_core import PydanticCustomError

from splitspec.gateway.chat_template_options import ChatTemplateFields, TemplateOptions
from splitspec.gateway.numbers import integer, integers, number
from splitspec.gateway.structured import StructuredFields
from splitspec.gateway.text import ChatMessages
from splitspec.gateway.tools import ToolCallIn, ToolFields, ToolPlan, template_calls
from splitspec.runtime.sampling_params import MAX_SEED, MAX_TOP_LOGPROBS

MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 1024  # one stop string (a stop longer than any completion can never match)
MAX_N = 16
MAX_BATCH_CHOICES = 128  # completions: prompts x n in one request
MAX_MESSAGES = 8192
MAX_TOKENS = 2**31 - 1
MAX_NAME_CHARS = 256  # model, message names, user
MAX_LOGIT_BIAS = 1024  # logit_bias entries (OpenAI's limit is lower)
MAX_STOP_TOKEN_IDS = 64  # vLLM's and SGLang's stop_token_ids
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
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: every chunk carries the usage so far
    logprobs: bool = False
    top_logprobs: int = 0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    speculative: bool = True
    user: str | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop_token_ids: list[int] = field(default_factory=list)
    min_p: float = 0.0
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop: bool = False  # the stop string that ended the output stays in it
    echo: bool = False  # completions: the prompt's text (and logprobs) before the completion
    grammar: tuple[str, str] | None = None  # structured outputs: (kind, text), gateway/structured.py
    grammar_field: str | None = None  # the request field that carried it (a grammar the verifier refuses names it)
    tools: ToolPlan | None = None  # chat tool calls: gateway/tools.py

    def most_tokens(self, prompt_len: int, context: int) -> int:
        """The tokens a choice may generate: max_tokens, or what the context leaves after its prompt."""
        return self.max_tokens if self.max_tokens is not None else context - prompt_len


# --- the models ------------------------------------------------------------------------------------

def _one_of(what: str):
    """A union's errors as one: 'x' must be <what> (pydantic reports each member's failure apart)."""

    def check(value, handler):
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("invalid_type", "must be " + what) from None

    return WrapValidator(check)


def _false_only(value):
    """A neutral `false`: JSON's false alone (pydantic's Literal[False] would take 0, which equals False)."""
    if value is not False and value is not None:
        raise PydanticCustomError("literal_error", "Input should be false")
    return value


NeutralFalse = Annotated[Literal[False], BeforeValidator(_false_only)]


NonEmpty = Annotated[str, Field(min_length=1)]
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]
Empty = Annotated[list[Any], Field(max_length=0)]
StopText = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
Stop = Annotated[Union[StopText, Annotated[list[StopText], Field(max_length=MAX_STOP_SEQUENCES)]],
                 _one_of(f"a string or a list of at most {MAX_STOP_SEQUENCES} strings of at most {MAX_STOP_CHARS} "
                         "characters")]
TokenIds = integers(0, MAX_TOKENS, min_length=1)
TokenIdKey = Annotated[str, Field(pattern=r"^(0|[1-9][0-9]{0,9})$", max_length=10)]  # a token id as a JSON key
LogitBias = Annotated[dict[TokenIdKey, Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]],
                      Field(max_length=MAX_LOGIT_BIAS, json_schema_extra={  # every key a token id, not only those that look
                          "propertyNames": {"pattern": r"^(0|[1-9][0-9]{0,9})$", "maxLength": 10},  # like one
                          "additionalProperties": False})]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = Field(default=None, description="vLLM's: with include_usage, every chunk "
                                                "carries the usage so far")
    include_obfuscation: bool | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class _Message(_Strict):
    name: Name | None = None
    tool_call_id: str | None = None
    tool_calls: Empty | None = Field(default=None, description="only an assistant's message carries tool calls")
    refusal: str | None = None


Content = Annotated[Union[str, list[TextPart]], _one_of("a string or a list of text parts ({'type': 'text', 'text': ...})")]


class Message(_Message):
    """A system, developer, user or tool message: text content (a string or text parts)."""

    role: Literal["system", "developer", "user", "tool"]
    content: Content


class AssistantMessage(_Message):
    """An assistant's earlier turn: text content, or none, and the tool calls it made."""

    role: Literal["assistant"]
    content: Annotated[Union[str, list[TextPart], None], _one_of("a string, a list of text parts or null")] = None
    tool_calls: Annotated[list[ToolCallIn], Field(max_length=128)] | None = None


AnyMessage = Annotated[Union[Message, AssistantMessage], Field(discriminator="role")]


class _Request(_Strict, StructuredFields):
    """What chat and text completions share."""

    DEFAULT_MAX_TOKENS: ClassVar[int | None] = None  # None: what the context leaves

    model: Annotated[NonEmpty, Field(max_length=MAX_NAME_CHARS)]
    temperature: number(0.0, 2.0) | None = None
    top_p: number(0.0, 1.0, positive=True) | None = None
    top_k: integer(-1, 2**31 - 1) | None = Field(default=None, description="-1 or 0: all tokens")
    seed: integer(-(2**63), 2**64 - 1) | None = None
    n: integer(1, MAX_N) | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: Stop | None = None
    frequency_penalty: number(-2.0, 2.0) | None = None
    presence_penalty: number(-2.0, 2.0) | None = None
    repetition_penalty: number(0.0, 10.0, positive=True) | None = None
    ignore_eos: bool | None = None
    speculative: bool | None = Field(default=None, description="false: no drafts for this request")
    user: Name | None = None
    logit_bias: LogitBias | None = Field(default=None, description="token id -> bias in [-100, 100], added to its logit")
    stop_token_ids: integers(0, MAX_TOKENS, max_length=MAX_STOP_TOKEN_IDS) | None = Field(
        default=None, description="vLLM's and SGLang's: token ids that end the request (in the output unless special)")
    min_p: number(0.0, 1.0) | None = Field(
        default=None, description="vLLM's and SGLang's: tokens less likely than min_p x the most likely are removed")
    min_tokens: integer(0, MAX_TOKENS) | None = Field(
        default=None, description="vLLM's and SGLang's: tokens before EOS or stop_token_ids may end the request")
    skip_special_tokens: bool | None = Field(default=None, description="vLLM's and SGLang's: special tokens left out "
                                             "of the text (default true)")
    spaces_between_special_tokens: bool | None = Field(
        default=None, description="vLLM's: accepted; this server's fast tokenizers decode special tokens adjacent either "
        "way, as vLLM's fast detokenizer does")
    include_stop_str_in_output: bool | None = Field(default=None, description="vLLM's: the stop string that ended the "
                                                    "output stays in it")
    no_stop_trim: bool | None = Field(default=None, description="SGLang's name for include_stop_str_in_output")

    _grammar: tuple[str, tuple[str, str]] | None = PrivateAttr(default=None)  # (field, (kind, text))

    @model_validator(mode="after")
    def _stream_options(self, info: ValidationInfo):
        self._grammar = self.grammar()  # structured outputs: one constraint, parsed (gateway/structured.py)
        if self.stream_options is not None and not self.stream:
            raise PydanticCustomError("stream_options", "'stream_options' is only allowed when 'stream' is true")
        vocab = (info.context or {}).get("vocab_size")
        bad = next((k for k in self.logit_bias or {} if vocab is not None and int(k) >= vocab), None)
        if bad is not None:
            raise PydanticCustomError("logit_bias", "'logit_bias' token id {bad} is outside the vocabulary [0, {vocab})",
                                      {"bad": bad, "vocab": vocab})
        max_tokens = getattr(self, "max_completion_tokens", None) or getattr(self, "max_tokens", None) \
            or self.DEFAULT_MAX_TOKENS
        if self.min_tokens and max_tokens is not None and self.min_tokens > max_tokens:
            raise PydanticCustomError("min_tokens", "'min_tokens' ({min}) must not exceed the maximum tokens ({max})",
                                      {"min": self.min_tokens, "max": max_tokens})
        bad = next((t for t in self.stop_token_ids or [] if vocab is not None and t >= vocab), None)
        if bad is not None:
            raise PydanticCustomError("stop_token_ids", "'stop_token_ids' token id {bad} is outside the vocabulary "
                                      "[0, {vocab})", {"bad": bad, "vocab": vocab})
        return self

    def generation(self) -> Generation:
        g = Generation(model=self.model)
        g.temperature = 1.0 if self.temperature is None else self.temperature
        g.top_p = 1.0 if self.top_p is None else self.top_p
        g.top_k = -1 if self.top_k in (None, 0) else self.top_k
        g.seed = None if self.seed is None else self.seed % MAX_SEED  # OpenAI: any int64; the engine: non-negative
        g.n = self.n or 1
        g.stream = bool(self.stream)
        g.include_usage = bool(self.stream_options and self.stream_options.include_usage)
        g.continuous_usage = g.include_usage and bool(self.stream_options.continuous_usage_stats)
        g.frequency_penalty = self.frequency_penalty or 0.0
        g.presence_penalty = self.presence_penalty or 0.0
        g.repetition_penalty = 1.0 if self.repetition_penalty is None else self.repetition_penalty
        g.ignore_eos = bool(self.ignore_eos)
        g.speculative = self.speculative is not False
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        g.stop = [s for s in stops if s]
        g.user = self.user
        g.logit_bias = {int(k): v for k, v in (self.logit_bias or {}).items() if v}
        g.stop_token_ids = list(self.stop_token_ids or [])
        g.min_p = self.min_p or 0.0
        g.min_tokens = self.min_tokens or 0
        g.skip_special_tokens = self.skip_special_tokens is not False
        g.include_stop = bool(self.include_stop_str_in_output or self.no_stop_trim)
        g.grammar_field, g.grammar = self._grammar or (None, None)
        return g


class ChatCompletionRequest(_Request, ToolFields, ChatTemplateFields):
    """POST /v1/chat/completions."""

    messages: Annotated[list[AnyMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_tokens: integer(1, MAX_TOKENS) | None = None
    max_completion_tokens: integer(1, MAX_TOKENS) | None = None
    logprobs: bool | None = None
    top_logprobs: integer(0, MAX_TOP_LOGPROBS) | None = None
    # not served: neutral values only
    functions: Empty | None = None
    function_call: Literal["none", "auto"] | None = None
    audio: None = None
    modalities: Annotated[list[Literal["text"]], Field(min_length=1, max_length=1)] | None = None
    prediction: None = None
    reasoning_effort: None = None
    web_search_options: None = None
    store: NeutralFalse | None = None
    metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default"] | None = None
    verbosity: None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    _tools: ToolPlan | None = PrivateAttr(default=None)
    _template: TemplateOptions | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _top_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise PydanticCustomError("top_logprobs", "'top_logprobs' needs 'logprobs' set to true")
        self._template = self.template_options()
        self._tools = self.tool_plan()
        if self._tools is not None and self._tools.mode != "auto" and self._grammar is not None:
            raise PydanticCustomError("tool_choice", "'tool_choice' {mode} constrains the output, and so does '{field}': "
                                      "give one", {"mode": self._tools.mode, "field": self._grammar[0]})
        return self

    def generation(self) -> Generation:
        g = super().generation()
        g.tools = self._tools
        grammar = g.tools.grammar() if g.tools is not None else None
        if grammar is not None:
            g.grammar_field, g.grammar = "tools", grammar
        g.messages = ChatMessages(template_messages(self.messages), tools=g.tools.tools if g.tools is not None else None,
                                  options=self._template)
        g.max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        g.logprobs = bool(self.logprobs)
        g.top_logprobs = self.top_logprobs or 0
        return g


Prompt = Annotated[
    Union[NonEmpty, TokenIds, Annotated[list[Union[NonEmpty, TokenIds]], Field(min_length=1, max_length=MAX_BATCH_CHOICES)]],
    _one_of("a non-empty string, a list of token ids, or a non-empty list of either"),
]


class CompletionRequest(_Request):
    """POST /v1/completions."""

    DEFAULT_MAX_TOKENS: ClassVar[int | None] = 16  # OpenAI's default for completions
    prompt: Prompt
    max_tokens: integer(0, MAX_TOKENS) | None = Field(default=None, description="default 16, as OpenAI's; 0 only with echo")
    logprobs: integer(0, 5) | None = None
    echo: bool | None = Field(default=None, description="the prompt before the completion (with logprobs: the "
                              "prompt tokens' too, the first null)")
    # not served: neutral values only
    best_of: integer(1, 1) | None = None
    suffix: Literal[""] | None = None

    @model_validator(mode="after")
    def _checks(self, info: ValidationInfo):
        batch, vocab = self.batch(), (info.context or {}).get("vocab_size")
        for i, p in enumerate(batch):
            bad = None if vocab is None or isinstance(p, str) or max(p) < vocab else next(t for t in p if t >= vocab)
            if bad is not None:
                where = "prompt" if batch is not self.prompt else f"prompt[{i}]"
                raise PydanticCustomError("prompt", "token id {bad} in '{where}' is outside the vocabulary [0, {vocab})",
                                          {"bad": bad, "where": where, "vocab": vocab})
        if self.max_tokens == 0 and not self.echo:
            raise PydanticCustomError("max_tokens", "'max_tokens' 0 needs 'echo' (the prompt, and its logprobs, alone)")
        if len(batch) * (self.n or 1) > MAX_BATCH_CHOICES:
            raise PydanticCustomError("prompt", "{prompts} prompts x n={n} choices is more than {limit}",
                                      {"prompts": len(batch), "n": self.n or 1, "limit": MAX_BATCH_CHOICES})
        return self

    def batch(self) -> list:
        p = self.prompt
        return [p] if isinstance(p, str) or isinstance(p[0], int) else p

    def generation(self) -> Generation:
        g = super().generation()
        g.prompts = [p if isinstance(p, str) else list(p) for p in self.batch()]
        g.max_tokens = self.DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens
        g.logprobs, g.top_logprobs = self.logprobs is not None, self.logprobs or 0
        g.echo = bool(self.echo)
        return g


NOT_SERVED = {"functions", "function_call", "audio", "modalities", "prediction", "reasoning_effort", "web_search_options", "store",
              "metadata", "service_tier", "verbosity", "prompt_cache_key", "safety_identifier", "best_of", "suffix"}


def template_messages(messages) -> list[dict]:
    """Chat messages as the chat template gets them: role, the text (parts joined), the name when given."""
    out = []
    for m in messages:
        content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or [])
        message = {"role": m.role, "content": content}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if getattr(m, "tool_calls", None):
            message["tool_calls"] = template_calls(m.tool_calls)
        out.append(message)
    return out


# --- errors ----------------------------------------------------------------------------------------

def _param(loc: tuple) -> str | None:
    out = ""
    for i, part in enumerate(loc):
        if i >= 2 and loc[i - 2] == "messages" and isinstance(loc[i - 1], int) and part in ROLES:
            continue  # the tag pydantic puts in a message's path (role-discriminated union)
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out or None


def _api_error(exc: ValidationError) -> APIError:
    """pydantic's first error as OpenAI's: param is the path (messages[2].role), code says which kind."""
    e = exc.errors(include_url=False)[0]
    kind, loc, msg = e["type"], tuple(e["loc"]), e["msg"]
    param = _param(loc)
    if kind in ("stream_options", "top_logprobs", "prompt", "logit_bias", "stop_token_ids", "tokenize", "tokens",
                "min_tokens", "max_tokens", "response_format", "regex", "ebnf", "json_schema", "tools",
                "tool_choice", "continue_final_message", "chat_template_kwargs", "guided_json",
                "structured_outputs.json"):  # already phrased
        return invalid(kind, msg)
    if kind == "model_type" and not loc:
        return invalid(None, "the request body must be a JSON object", "invalid_type")
    if kind in ("union_tag_invalid", "union_tag_not_found") and loc[:1] == ("response_format",):
        return invalid("response_format.type", "'response_format.type' must be one of text, json_object, json_schema",
                       "missing_required_parameter" if kind == "union_tag_not_found" else "invalid_value")
    if kind in ("union_tag_invalid", "union_tag_not_found"):  # a message's role
        role = e.get("input", {}).get("role") if isinstance(e.get("input"), dict) else None
        return invalid(f"{param}.role", f"'{param}.role' must be one of {', '.join(ROLES)}, got {role!r}",
                       "missing_required_parameter" if kind == "union_tag_not_found" else "invalid_value")
    if kind == "missing":
        return invalid(param, f"'{param}' is required", "missing_required_parameter")
    if kind == "extra_forbidden":
        if len(loc) == 1:
            return invalid(param, f"Unrecognized request argument supplied: {param}", "unknown_parameter")
        return invalid(param, f"Unrecognized field '{param}'", "unknown_parameter")
    if loc[:1] and loc[0] in NOT_SERVED or loc[-1:] == ("tool_calls",):
        return invalid(param, f"'{param}' is not supported by this server (only its neutral value is accepted)",
                       "unsupported_parameter")
    if kind == "invalid_type":  # a union's failure, phrased by _one_of
        return invalid(param, f"'{param}' {msg}", "invalid_type")
    typed = kind.endswith("_type") or kind.endswith("_parsing") or kind == "none_required"
    return invalid(param, f"'{param}': {msg}", "invalid_type" if typed else "invalid_value")


def parse_chat(body, vocab_size: int | None = None) -> Generation:
    try:
        return ChatCompletionRequest.model_validate(body, context={"vocab_size": vocab_size}).generation()
    except ValidationError as exc:
        raise _api_error(exc) from None


def parse_completion(body, vocab_size: int) -> Generation:
    try:
        return CompletionRequest.model_validate(body, context={"vocab_size": vocab_size}).generation()
    except ValidationError as exc:
        raise _api_error(exc) from None


# --- the published schema --------------------------------------------------------------------------

class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorBody


REQUEST_MODELS = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}


def request_schemas(model_name: str | None = None, vocab_size: int | None = None) -> dict:
    """The components/schemas of the request and error models; where the gateway knows them, the served
    model's name and the vocabulary bound the model field and the token ids."""
    _, top = models_json_schema([(m, "validation") for m in (*REQUEST_MODELS.values(), ErrorResponse)],
                                ref_template="#/components/schemas/{model}")
    schemas = top["$defs"]
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        if model_name is not None:
            schemas[name]["properties"]["model"] = {"type": "string", "enum": [model_name], "title": "Model"}
    if vocab_size is not None:
        _bound_token_ids(schemas["CompletionRequest"]["properties"]["prompt"], vocab_size - 1)
        for name in ("ChatCompletionRequest", "CompletionRequest"):
            _bound_token_ids(schemas[name]["properties"]["stop_token_ids"], vocab_size - 1)
    return schemas


def _bound_token_ids(node, maximum: int) -> None:
    if isinstance(node, dict):
        if node.get("type") == "integer" and node.get("maximum") == MAX_TOKENS and node.get("minimum") == 0:
            node["maximum"] = maximum
        for value in node.values():
            _bound_token_ids(value, maximum)
    elif isinstance(node, list):
        for value in node:
            _bound_token_ids(value, maximum)
