"""Tool calls on the chat API: OpenAI's `tools` (function tools) with `tool_choice` none, auto, required or a named
function, and `parallel_tool_calls`, as vLLM and SGLang serve them.

- `none`: the tools are not rendered and nothing is parsed (vLLM's default for none).
- `required` and a named function are constrained decoding (the verifier's grammar engine, gateway/structured.py's
  path): required, a JSON array of {"name", "parameters"} objects, one per call (at most one without
  parallel_tool_calls), each matching its function's `parameters` schema; a named function, its arguments object.
  The output is then the calls: finish_reason "tool_calls" (required) or "stop" (named, as OpenAI answers).
- `auto` (the default when tools are given): the tools go to the model's chat template (`tools`, as transformers
  passes them), and the output is parsed for calls in the two common formats: Hermes / Qwen
  (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number) and Llama 3 JSON (the whole output one
  `{"name": ..., "parameters": {...}}` object, or several separated by `;`, after an optional `<|python_tag|>`).
  Calls of functions that were not offered are text. Text outside the calls is the message's content.

Streamed, calls go out as OpenAI streams them (`delta.tool_calls`: the first piece of a call carries its index, id,
type and name, the others argument text): a named function's arguments as they are generated; required's and
auto's calls once the output is complete (their text is held back from the first character that may begin a
call; text before it streams as content).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import PydanticCustomError

MAX_TOOLS = 128
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HERMES = re.compile(re.escape(HERMES_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(HERMES_CLOSE) + r"|$)", re.S)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionDefinition(_Strict):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = Field(default=None, description="a JSON schema of the arguments object")
    strict: bool | None = None


class FunctionTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class _ChosenName(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64)]


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: _ChosenName


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class CalledFunction(_Strict):
    name: str
    arguments: str


class ToolCallIn(_Strict):
    """A call in an earlier assistant turn (sent back by the client with the tool's answer)."""

    id: str
    type: Literal["function"]
    function: CalledFunction


class ToolFields(BaseModel):
    """The chat request's tool fields (mixed into ChatCompletionRequest)."""

    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = Field(default=None, description="none (the default without tools), auto (the "
                                           "default with them), required, or a named function")
    parallel_tool_calls: bool | None = Field(default=None, description="false: at most one call (required)")

    def tool_plan(self) -> ToolPlan | None:
        """The request's plan, or None (no tools, or tool_choice none). Raises PydanticCustomError."""
        choice, tools = self.tool_choice, self.tools
        if (isinstance(choice, NamedToolChoice) or choice == "required") and not tools:
            raise PydanticCustomError("tool_choice", "'tool_choice' {what} needs 'tools'", {"what": _describe(choice)})
        if not tools or choice == "none":
            return None
        names = [t.function.name for t in tools]
        duplicate = next((n for n in names if names.count(n) > 1), None)
        if duplicate is not None:
            raise PydanticCustomError("tools", "'tools' names the function {name!r} twice", {"name": duplicate})
        rendered = [t.model_dump(exclude_none=True) for t in tools]
        parallel = self.parallel_tool_calls is not False
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise PydanticCustomError("tool_choice", "'tool_choice' names the function {name!r}, which is not among "
                                          "'tools' ({names})", {"name": choice.function.name, "names": ", ".join(names)})
            return ToolPlan("named", rendered, set(names), choice.function.name, parallel)
        return ToolPlan(choice or "auto", rendered, set(names), None, parallel)


@dataclass
class ToolPlan:
    """What a request's tools ask of the generation and of its output."""

    mode: str  # "auto", "required" or "named" ("none" makes no plan)
    tools: list[dict]  # as the chat template gets them: {"type": "function", "function": {...}}
    names: set[str]
    name: str | None = None  # named: the function
    parallel: bool = True

    def grammar(self) -> tuple[str, str] | None:
        """(kind, JSON schema) of the constrained modes; None for auto."""
        params = {t["function"]["name"]: _parameters(t["function"]) for t in self.tools}
        if self.mode == "named":
            return "json_schema", json.dumps(params[self.name])
        if self.mode == "required":
            calls = [{"type": "object", "properties": {"name": {"enum": [name]}, "parameters": schema},
                      "required": ["name", "parameters"], "additionalProperties": False} for name, schema in params.items()]
            array = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
            if not self.parallel:
                array["maxItems"] = 1
            return "json_schema", json.dumps(array)
        return None


def _parameters(function: dict) -> dict:
    schema = function.get("parameters")
    return schema if schema else {"type": "object"}


def template_calls(calls: list[ToolCallIn]) -> list[dict]:
    """An earlier turn's calls as chat templates render them: arguments as an object where they parse."""
    out = []
    for c in calls:
        try:
            arguments = json.loads(c.function.arguments)
        except ValueError:
            arguments = c.function.arguments
        out.append({"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": arguments}})
    return out


def _describe(choice) -> str:
    return f"naming {choice.function.name!r}" if isinstance(choice, NamedToolChoice) else repr(choice)


def new_call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": arguments}}


def _arguments(value) -> str:
    return value if isinstance(value, str) else json.dumps({} if value is None else value, ensure_ascii=False)


def _json_calls(text: str, names: set[str]) -> list[dict] | None:
    """Llama 3 JSON: the text is one call object, or several (a list, or objects separated by ';'); None otherwise."""
    text = text.strip()
    if text.startswith(PYTHON_TAG):
        text = text[len(PYTHON_TAG):].strip()
    candidates = []
    try:
        parsed = json.loads(text)
        candidates = parsed if isinstance(parsed, list) else [parsed]
    except json.JSONDecodeError:
        try:
            candidates = [json.loads(part) for part in text.split(";") if part.strip()]
        except json.JSONDecodeError:
            return None
    calls = []
    for c in candidates:
        if not isinstance(c, dict) or c.get("name") not in names:
            return None
        calls.append(new_call(c["name"], _arguments(c.get("parameters", c.get("arguments")))))
    return calls or None


def parse_auto(text: str, names: set[str]) -> tuple[str | None, list[dict]]:
    """(content, calls) of a model's output under tool_choice auto (see the module's doc)."""
    calls, kept = [], []
    last = 0
    for match in _HERMES.finditer(text):
        try:
            body = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if isinstance(body, dict) and body.get("name") in names:
            calls.append(new_call(body["name"], _arguments(body.get("arguments", body.get("parameters")))))
            kept.append(text[last:match.start()])
            last = match.end()
    if calls:
        content = ("".join(kept) + text[last:]).strip()
        return content or None, calls
    json_calls = _json_calls(text, names)
    if json_calls:
        return None, json_calls
    return text, []


def parse_required(text: str) -> list[dict] | None:
    """required's calls from its (grammar-constrained) JSON array; None where it is cut short."""
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(parsed, list):
        return None
    return [new_call(c["name"], _arguments(c.get("parameters"))) for c in parsed
            if isinstance(c, dict) and isinstance(c.get("name"), str)] or None


@dataclass
class ToolOutput:
    """One choice's output under a tool plan: parsed whole (result) or streamed (feed, finish)."""

    plan: ToolPlan
    held: str = ""  # streamed text kept back: it may be (part of) a call
    emitted: bool = False  # streamed: some content went out already
    calls: list[dict] = field(default_factory=list)
    _named: dict | None = None

    def result(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, calls) of a whole output."""
        if self.plan.mode == "named":
            return None, [new_call(self.plan.name, text)]
        if self.plan.mode == "required":
            calls = parse_required(text)
            return (None, calls) if calls else (text, [])
        return parse_auto(text, self.plan.names)

    def finish_reason(self, base: str, calls: list[dict]) -> str:
        """OpenAI's: tool_calls when calls were made by choice (auto, required), stop for a named function; a
        length cut stays length."""
        if base == "length" or not calls or self.plan.mode == "named":
            return base
        return "tool_calls"

    def feed(self, text: str) -> list[dict]:
        """Streamed: the deltas (content or tool_calls pieces) a new piece of text lets out now."""
        if not text:
            return []
        if self.plan.mode == "named":
            out = []
            if self._named is None:
                self._named = new_call(self.plan.name, "")
                self.calls.append(self._named)
                out.append({"tool_calls": [{"index": 0, "id": self._named["id"], "type": "function",
                                            "function": {"name": self.plan.name, "arguments": ""}}]})
            self._named["function"]["arguments"] += text
            return out + [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}]
        self.held += text
        if self.plan.mode == "required":
            return []
        return self._release()

    def _release(self) -> list[dict]:
        """auto: content up to where a call may begin (a Hermes tag, or an output that opens as JSON)."""
        text = self.held
        if not self.emitted:
            start = text.lstrip()
            if start[:1] == "{" or start.startswith(PYTHON_TAG) or (start and PYTHON_TAG.startswith(start)):
                return []  # the whole output may be a JSON call: held to the end
        at = text.find(HERMES_OPEN)
        if at < 0:  # keep back a tail that may be the tag's beginning
            at = next((len(text) - k for k in range(min(len(HERMES_OPEN) - 1, len(text)), 0, -1)
                       if HERMES_OPEN.startswith(text[-k:])), len(text))
        out, self.held = text[:at], text[at:]
        if not out:
            return []
        self.emitted = True
        return [{"content": out}]

    def finish(self) -> list[dict]:
        """Streamed: the deltas once the output is complete (held text parsed into calls, or let out as content)."""
        if self.plan.mode == "named":
            return []
        text, self.held = self.held, ""
        if self.plan.mode == "required":
            calls = parse_required(text)
            content = None if calls else text
        else:
            content, calls = parse_auto(text, self.plan.names)
        out = [{"content": content}] if content else []
        for index, call in enumerate(calls or []):
            out.append({"tool_calls": [{"index": index, **call}]})
        self.calls = calls or []
        return out
