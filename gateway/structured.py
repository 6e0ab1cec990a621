"""Structured outputs on the API: OpenAI's response_format (text, json_object, json_schema) on chat and text
completions, SGLang's extra request fields regex, ebnf and json_schema (a JSON string), and vLLM's
structured_outputs ({json, regex, choice, grammar, json_object}; its older guided_json, guided_regex,
guided_choice, guided_grammar too; a choice is a grammar of the literal strings). At most one
constraint per request, sent to the verifier as SamplingParams' (grammar_kind, grammar). What can be checked
without the grammar engine is checked here (a schema that is not JSON, an empty grammar); the verifier's engine
compiles the rest and refuses what does not compile (INVALID_ARGUMENT, "grammar: ..."), which the gateway returns
as a 400 naming the field that carried it. (xgrammar imports torch: the gateway, a light process, does not load it.)
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import PydanticCustomError

MAX_GRAMMAR_CHARS = 1 << 20  # a schema, regex or grammar of at most 1 MiB


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextFormat(_Strict):
    type: Literal["text"]


class JsonObjectFormat(_Strict):
    type: Literal["json_object"]


class JsonSchema(_Strict):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    schema_: Union[dict[str, Any], bool] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class JsonSchemaFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchema


ResponseFormat = Annotated[Union[TextFormat, JsonObjectFormat, JsonSchemaFormat], Field(discriminator="type")]
GrammarText = Annotated[str, Field(min_length=1, max_length=MAX_GRAMMAR_CHARS)]
Choices = Annotated[list[Annotated[str, Field(max_length=MAX_GRAMMAR_CHARS)]], Field(min_length=1, max_length=4096)]
Schema = Union[GrammarText, dict[str, Any], bool]  # vLLM's: a JSON schema as text or as JSON


class StructuredOutputs(_Strict):
    """vLLM's structured_outputs: one of its constraints."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    json_: Schema | None = Field(default=None, alias="json")
    regex: GrammarText | None = None
    choice: Choices | None = None
    grammar: GrammarText | None = None
    json_object: bool | None = None


def _choice_grammar(choices: list[str]) -> str:
    """The EBNF grammar (xgrammar's GBNF) whose strings are exactly the choices: JSON's string escapes are its own."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def _vllm_grammar(kind: str, value) -> tuple[str, str]:
    """(kind, text) of one of vLLM's constraints: a schema as text, a choice as the grammar of its strings."""
    if kind == "choice":
        return "ebnf", _choice_grammar(value)
    if kind == "json_schema":
        return kind, value if isinstance(value, str) else json.dumps(value)
    return kind, "" if kind == "json_object" else value


class StructuredFields(BaseModel):
    """The fields a request mixes in (chat and completions alike)."""

    response_format: ResponseFormat | None = None
    regex: GrammarText | None = Field(default=None, description="SGLang's: the output matches this regular expression")
    ebnf: GrammarText | None = Field(default=None, description="SGLang's: the output matches this EBNF grammar "
                                     "(xgrammar's GBNF, start rule root)")
    json_schema: GrammarText | None = Field(default=None, description="SGLang's: the output matches this JSON schema "
                                            "(a JSON string)")
    structured_outputs: StructuredOutputs | None = Field(
        default=None, description="vLLM's: one of json (a schema), regex, choice (strings), grammar (EBNF), json_object")
    guided_json: Schema | None = Field(default=None, description="vLLM's older name for structured_outputs.json")
    guided_regex: GrammarText | None = Field(default=None, description="vLLM's older structured_outputs.regex")
    guided_choice: Choices | None = Field(default=None, description="vLLM's older structured_outputs.choice")
    guided_grammar: GrammarText | None = Field(default=None, description="vLLM's older structured_outputs.grammar")

    def grammar(self) -> tuple[str, tuple[str, str]] | None:
        """(the field that carried it, (kind, text)) of the request's constraint; None when it has none. Raises
        PydanticCustomError."""
        asked = []
        fmt = self.response_format
        if isinstance(fmt, JsonObjectFormat):
            asked.append(("response_format", ("json_object", "")))
        elif isinstance(fmt, JsonSchemaFormat):
            schema = fmt.json_schema.schema_
            text = json.dumps({} if schema is None else schema)  # OpenAI: a missing schema allows any JSON value
            asked.append(("response_format", ("json_schema", text)))
        asked += [(name, (name, getattr(self, name))) for name in ("regex", "ebnf", "json_schema")
                  if getattr(self, name) is not None]
        vllm = self.structured_outputs or StructuredOutputs()
        for name, value, kind in (("structured_outputs.json", vllm.json_, "json_schema"),
                                  ("structured_outputs.regex", vllm.regex, "regex"),
                                  ("structured_outputs.choice", vllm.choice, "choice"),
                                  ("structured_outputs.grammar", vllm.grammar, "ebnf"),
                                  ("structured_outputs.json_object", vllm.json_object or None, "json_object"),
                                  ("guided_json", self.guided_json, "json_schema"),
                                  ("guided_regex", self.guided_regex, "regex"),
                                  ("guided_choice", self.guided_choice, "choice"),
                                  ("guided_grammar", self.guided_grammar, "ebnf")):
            if value is not None:
                asked.append((name, _vllm_grammar(kind, value)))
        if len(asked) > 1:
            raise PydanticCustomError("response_format", "only one of {fields} may be given",
                                      {"fields": ", ".join(f"'{name}'" for name, _ in asked)})
        if not asked:
            return None
        name, (kind, text) = asked[0]
        if kind == "json_schema":
            try:
                schema = json.loads(text)
            except json.JSONDecodeError as exc:
                raise PydanticCustomError(name, "'{field}': the JSON schema is not JSON: {problem}",
                                          {"field": name, "problem": str(exc)}) from None
            if not isinstance(schema, (dict, bool)):
                raise PydanticCustomError(name, "'{field}': a JSON schema must be an object or a boolean", {"field": name})
        return name, (kind, text)
