"""Tool calls' gateway side (gateway/tools.py): the plans tool_choice makes, the grammars of required and named
calls (compiled by the verifier's grammar engine here, and their JSON validated), the parsers of the two common
call formats, and streaming that holds back exactly the text that may be a call. The HTTP path is in
tests/test_gateway.py (test_tool_calls_through_the_openai_client)."""

from __future__ import annotations

import json

import pytest
from pydantic_core import PydanticCustomError

from splitspec.gateway.protocol import APIError, parse_chat
from splitspec.gateway.text import ChatMessages, TextCodec
from splitspec.gateway.tools import PYTHON_TAG, ToolFields, ToolOutput, parse_auto

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 20},
                                                "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
    "zone": {"type": "string", "maxLength": 16}}, "required": ["zone"]}}}
NAMES = {"get_weather", "get_time"}


def plan_of(**fields):
    return ToolFields.model_validate(fields).tool_plan()


def test_plans_follow_tool_choice_and_refuse_what_cannot_be_served():
    assert plan_of() is None and plan_of(tools=[WEATHER], tool_choice="none") is None
    auto = plan_of(tools=[WEATHER, TIME])
    assert auto.mode == "auto" and auto.names == NAMES and auto.grammar() is None
    assert auto.tools[0] == WEATHER  # what the chat template gets, as sent
    named = plan_of(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.mode == "named" and json.loads(named.grammar()[1]) == TIME["function"]["parameters"]
    required = plan_of(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    kind, text = required.grammar()
    schema = json.loads(text)
    assert kind == "json_schema" and schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [c["properties"]["name"] for c in schema["items"]["anyOf"]] == [{"enum": ["get_weather"]}, {"enum": ["get_time"]}]
    for fields, param in [(dict(tool_choice="required"), "tool_choice"),
                          (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
                          (dict(tools=[WEATHER, WEATHER]), "tools")]:
        with pytest.raises(PydanticCustomError) as refused:
            plan_of(**fields)
        assert refused.value.type == param
    for body, param in [({"tool_choice": "required"}, "tool_choice"),
                        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
                        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
                         "tool_choice"),
                        ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type")]:
        with pytest.raises(APIError) as refused:
            parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], **body})
        assert refused.value.status == 400 and refused.value.param == param, refused.value.message


def test_the_constrained_grammars_compile_and_their_outputs_parse():
    """required's and named's schemas compile in xgrammar (as the verifier compiles them) and a JSON they allow
    parses into OpenAI's calls."""
    from splitspec.runtime import grammar

    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        plan = plan_of(tools=[WEATHER, TIME], tool_choice=choice)
        grammar.check(*plan.grammar())
    required = ToolOutput(plan_of(tools=[WEATHER, TIME], tool_choice="required"))
    text = json.dumps([{"name": "get_time", "parameters": {"zone": "UTC"}},
                       {"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}])
    content, calls = required.result(text)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Oslo", "unit": "c"}
    assert calls[0]["id"].startswith("call_") and calls[0]["id"] != calls[1]["id"] and calls[0]["type"] == "function"
    assert required.finish_reason("stop", calls) == "tool_calls" and required.finish_reason("length", calls) == "length"
    cut = required.result(text[:20])  # a length cut: no calls, the text as content
    assert cut == (text[:20], [])


def test_auto_parses_hermes_and_llama_formats_and_leaves_other_text():
    hermes = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "c"}}\n'
              '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>')
    content, calls = parse_auto(hermes, NAMES)
    assert content == "Let me check." and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome", "unit": "c"}
    llama = PYTHON_TAG + '{"name": "get_time", "parameters": {"zone": "PST"}}'
    assert [c["function"]["name"] for c in parse_auto(llama, NAMES)[1]] == ["get_time"]
    two = '{"name": "get_time", "parameters": {"zone": "A"}}; {"name": "get_time", "parameters": {"zone": "B"}}'
    assert [json.loads(c["function"]["arguments"])["zone"] for c in parse_auto(two, NAMES)[1]] == ["A", "B"]
    for text in ('{"name": "launch", "parameters": {}}', "no call here", "<tool_call>{not json</tool_call>",
                 '{"answer": 42}'):
        assert parse_auto(text, NAMES) == (text, [])  # unknown functions, prose and broken calls are text


def stream(output: ToolOutput, pieces: list[str]) -> tuple[str, list[dict]]:
    deltas = [d for p in pieces for d in output.feed(p)] + output.finish()
    content = "".join(d.get("content") or "" for d in deltas)
    return content, [c for d in deltas for c in d.get("tool_calls", [])]


def test_streaming_holds_back_only_what_may_be_a_call():
    auto = plan_of(tools=[WEATHER, TIME])
    text = 'Sure <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    output = ToolOutput(auto)
    early = output.feed("Sure <tool")  # "<tool" may begin the tag: held
    assert early == [{"content": "Sure "}]
    content, pieces = stream(output, [text[len("Sure <tool"):]])
    assert content == "" and len(pieces) == 1 and pieces[0]["index"] == 0 and pieces[0]["function"]["name"] == "get_time"
    whole_content, whole_calls = ToolOutput(auto).result(text)
    assert whole_content == "Sure" and json.loads(pieces[0]["function"]["arguments"]) == json.loads(
        whole_calls[0]["function"]["arguments"])
    assert stream(ToolOutput(auto), ["Plain ", "prose < 3 ", "ends."]) == ("Plain prose < 3 ends.", [])
    assert stream(ToolOutput(auto), ['{"answ', 'er": 1}']) == ('{"answer": 1}', [])  # JSON but no call: text
    named = ToolOutput(plan_of(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    deltas = named.feed('{"city": ') + named.feed('"Oslo", "unit": "f"}') + named.finish()
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas) == '{"city": "Oslo", "unit": "f"}'
    assert all(d["tool_calls"][0]["index"] == 0 for d in deltas) and "id" not in deltas[1]["tool_calls"][0]


def test_templates_get_the_tools_and_earlier_calls(tmp_path):
    """The chat template renders `tools` (transformers' argument) and an assistant turn's calls, with arguments as
    an object, and the tool's answer."""
    from splitspec.demo import demo_model_dirs

    target = demo_model_dirs()["target"]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((target / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text(
        "{% if tools %}{% for t in tools %}[tool {{ t.function.name }}]{% endfor %}{% endif %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} {{ c.function.arguments.city }}]{% endfor %}"
        "{% if m.tool_call_id %}[for {{ m.tool_call_id }}]{% endif %};{% endfor %}")
    codec = TextCodec(tmp_path)
    body = {"model": "m", "tools": [WEATHER, TIME], "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
        {"role": "tool", "content": "12 C", "tool_call_id": "call_1"}]}
    g = parse_chat(body)
    assert isinstance(g.messages, ChatMessages)
    assert codec.render_chat(g.messages) == ("[tool get_weather][tool get_time]user:weather?;assistant:"
                                             "[call get_weather Oslo];tool:12 C[for call_1];")
    none = parse_chat({**body, "tool_choice": "none"})  # none: the tools are not rendered
    assert codec.render_chat(none.messages).startswith("user:weather?;")
