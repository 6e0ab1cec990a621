"""Property-based fuzzing of the gateway from its own OpenAPI document (schemathesis + hypothesis).

The document at /openapi.json is generated from the typed, bounded models that check requests
(gateway/protocol.py), so the cases come from the same source as the validation. Against real processes
(a `splitspec verifier` with the demo target, NGRAM drafting, a short context; a `splitspec gateway`),
every operation gets positive cases (bodies the schema allows) and negative ones (bodies it does not).
Each case is classified again here with jsonschema against the served document, and then:
  - nothing answers 5xx, and every error is OpenAI's error object;
  - a body outside the schema is refused with 4xx;
  - a body inside the schema completes (200, a valid OpenAI response or a stream ending in [DONE]), or
    is refused for what no JSON schema can say (the prompt's length in tokens against the context, and
    the few checks across fields, each named here).
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings  # schemathesis brings hypothesis
from schemathesis.generation import GenerationMode
from test_gateway import MODEL, openapi_validator, start_gateway
from test_verifier_service import scrape, start_verifier, stop

from splitspec.demo import demo_model_dirs

CONTEXT = 48  # tokens: keeps every generated completion short on a CPU
EXAMPLES = {GenerationMode.POSITIVE: int(os.environ.get('FUZZ_POS', 50)), GenerationMode.NEGATIVE: int(os.environ.get('FUZZ_NEG', 300))}  # per POST operation (FUZZ_POS / FUZZ_NEG: a longer run); GETs take 60
# what a body the schema allows may still be refused for, by (param, code): no JSON schema states these
ALLOWED_REFUSALS = {
    ("max_tokens", "context_length_exceeded"), ("messages", "context_length_exceeded"),
    ("prompt", "context_length_exceeded"), ("stream_options", "invalid_value"), ("top_logprobs", "invalid_value"),
    ("prompt", "invalid_value"),  # prompts x n over the batch limit
    ("logit_bias", "invalid_value"),  # a logit_bias token id past the vocabulary (the schema bounds the keys as ids only)
    ("min_tokens", "invalid_value"),  # min_tokens above the tokens the request may generate (a check across fields)
    ("max_tokens", "invalid_value"),  # completions' max_tokens 0 without echo (a check across fields)
    # structured outputs: a schema, regex or grammar that does not parse (no JSON schema states their syntax), or
    # more than one of them
    ("response_format", "invalid_value"), ("regex", "invalid_value"), ("ebnf", "invalid_value"),
    ("json_schema", "invalid_value"), ("guided_json", "invalid_value"), ("guided_regex", "invalid_value"),
    ("guided_grammar", "invalid_value"), ("structured_outputs.json", "invalid_value"),
    ("structured_outputs.regex", "invalid_value"), ("structured_outputs.grammar", "invalid_value"),
    # chat template options: both continue_final_message and add_generation_prompt, chat_template_kwargs setting
    # messages, a final message with no text to continue (or variables the template then fails on: messages)
    ("continue_final_message", "invalid_value"), ("chat_template_kwargs", "invalid_value"), ("messages", "invalid_value"),
    # tool calls: a function's parameters that do not compile as a schema, a tool_choice naming a function not among
    # the tools (or needing tools that are not there), a function named twice
    ("tools", "invalid_value"), ("tool_choice", "invalid_value"),
}
GRAMMAR_FIELDS = ("response_format", "regex", "ebnf", "json_schema", "tools", "guided_json", "guided_regex", "guided_grammar",
                  "structured_outputs.json", "structured_outputs.regex", "structured_outputs.grammar")
ALLOWED_REFUSAL_PREFIXES = ("prompt[",)  # prompt[i] context_length_exceeded in a batch


@pytest.fixture(scope="module")
def fuzz_stack():
    dirs = demo_model_dirs()
    verifier, stub = start_verifier("--model-path", str(dirs["target"]), "--max-total-tokens", "16384",
                                    "--served-model-name", MODEL, "--context-length", str(CONTEXT),
                                    "--speculative-num-draft-tokens", "3")  # small trees: random text accepts little
    gateway, url = start_gateway(stub.port)
    yield {"url": url, "stub": stub, "gateway": gateway}
    gateway.kill()
    gateway.wait(timeout=30)
    stop(verifier, stub)


def _document_validator(document: dict):
    from jsonschema import Draft202012Validator
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT202012

    registry = Registry().with_resource("urn:gateway", Resource.from_contents(document, default_specification=DRAFT202012))

    def valid(body, name: str) -> bool:
        return Draft202012Validator({"$ref": f"urn:gateway#/components/schemas/{name}"}, registry=registry).is_valid(body)

    return valid


def test_the_schema_is_the_models(fuzz_stack):
    """The served document names the request models, bounded as they are, and the served model."""
    document = httpx.get(fuzz_stack["url"] + "/openapi.json", timeout=30).json()
    chat = document["components"]["schemas"]["ChatCompletionRequest"]
    assert chat["additionalProperties"] is False and chat["required"] == ["model", "messages"]
    assert chat["properties"]["model"]["enum"] == [MODEL]
    n = chat["properties"]["n"]["anyOf"][0]
    assert (n["type"], n["minimum"], n["maximum"]) == ("integer", 1, 16)
    body = document["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/CompletionRequest"}
    ids = json.dumps(document["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"])
    info_vocab = scrape_vocab(fuzz_stack)
    assert f'"maximum": {info_vocab - 1}' in ids  # token ids bounded by the served vocabulary


def scrape_vocab(stack) -> int:
    from splitspec.protos import verifier_pb2 as pb

    return stack["stub"].GetModelInfo(pb.ModelInfoRequest(), timeout=10).vocab_size


def test_fuzz_every_operation_from_the_openapi_document(fuzz_stack):
    url = fuzz_stack["url"]
    document = httpx.get(url + "/openapi.json", timeout=30).json()
    schema = schemathesis.openapi.from_dict(document)
    schema.config.update(base_url=url)
    openai = openapi_validator()
    valid = _document_validator(document)
    session = httpx.Client(timeout=120)
    tally: Counter = Counter()
    failures: list[str] = []

    def check(case, mode: GenerationMode) -> None:
        path, method = case.operation.path, case.operation.method.upper()
        request = case.as_transport_kwargs(base_url=url)
        started = time.perf_counter()
        r = session.request(request["method"], request["url"], headers=request.get("headers"),
                            params=request.get("params"), content=_content(request))
        tally["cases"] += 1
        tally[f"{method} {path} {mode.value} {r.status_code}"] += 1
        tally["seconds"] += time.perf_counter() - started
        where = f"{method} {path} {mode.value}: {str(case.body)[:300]!r} -> {r.status_code} {r.text[:300]!r}"
        if r.status_code >= 500:
            failures.append("5xx: " + where)
            return
        if r.status_code >= 400:
            try:
                openai(r.json(), "ErrorResponse")
            except (AssertionError, ValueError) as exc:
                failures.append(f"not an OpenAI error ({exc}): " + where)
                return
        if method != "POST":
            return
        model = "ChatCompletionRequest" if path.endswith("chat/completions") else "CompletionRequest"
        json_body = request.get("json", "not json") if "content" not in request and "data" not in request else "not json"
        inside = json_body != "not json" and request.get("headers", {}).get("Content-Type", "application/json") \
            .startswith("application/json") and valid(json_body, model)
        tally["inside schema" if inside else "outside schema"] += 1
        if not inside:
            if r.status_code < 400:
                failures.append("accepted outside the schema: " + where)
            return
        if r.status_code >= 400:
            error = r.json()["error"]
            if (error["param"], error["code"]) not in ALLOWED_REFUSALS and not (
                    error["code"] == "context_length_exceeded" and str(error["param"]).startswith(ALLOWED_REFUSAL_PREFIXES)):
                failures.append("refused inside the schema: " + where)
            else:
                tally[f"refused inside: {error['param']} {error['code']}"] += 1
                if error["param"] in GRAMMAR_FIELDS:  # a random string as a regex, grammar or schema: refused by the
                    tally["grammars refused"] += 1  # verifier's grammar compiler (or the gateway's JSON check)
            return
        tally["completed"] += 1
        if json_body.get("stream"):
            if not r.text.rstrip().endswith("data: [DONE]"):
                failures.append("a stream without [DONE]: " + where)
        else:
            try:
                openai(r.json(), "CreateChatCompletionResponse" if model.startswith("Chat") else "CreateCompletionResponse")
            except AssertionError as exc:
                failures.append(f"response outside OpenAI's schema ({exc}): " + where)

    posts = [("/v1/chat/completions", "POST"), ("/v1/completions", "POST")]
    runs = [(schema[p][m], mode, count) for p, m in posts for mode, count in EXAMPLES.items()]
    runs += [(schema[p]["GET"], GenerationMode.POSITIVE, 60) for p in ("/v1/models", "/v1/models/{model_id}", "/health")]
    for operation, mode, count in runs:
        before = tally["cases"]

        @settings(max_examples=count, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=mode))
        def run(case):
            check(case, mode)

        clock = time.perf_counter()
        run()
        print(f"{operation.method.upper()} {operation.path} {mode.value}: {tally['cases'] - before} cases in "
              f"{time.perf_counter() - clock:.1f} s")
    session.close()
    for key in sorted(tally):
        print(f"  {key}: {tally[key]:.1f}" if key == "seconds" else f"  {key}: {tally[key]}")
    kinds = Counter(f.split(":", 1)[0] + " " + f.split("-> ", 1)[-1][:120] for f in failures)
    assert not failures, f"{len(failures)} failures; by kind: {kinds.most_common(8)}; the first: " + "\n".join(failures[:3])
    # the fuzzer reached the engine, both ways, and hundreds of times in all
    assert tally["cases"] >= 700 and tally["completed"] + tally["grammars refused"] >= 40 and tally["completed"] >= 25 \
        and tally["outside schema"] >= 450, tally
    metrics = scrape(fuzz_stack["stub"].metrics_url)
    drafted = sum(v for (name, _), v in metrics.items() if name == "splitspec:spec_decode_num_draft_tokens_total")
    accepted = sum(v for (name, _), v in metrics.items() if name == "splitspec:spec_decode_num_accepted_tokens_total")
    print(f"  draft tokens proposed {drafted:.0f}, accepted {accepted:.0f}")
    assert drafted > 0 and accepted > 0, "no drafts were proposed and accepted during the fuzzing"
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "def f(x):", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200  # and it still serves


HOSTILE_BODIES = {  # bodies Python's JSON parser cannot hold, or holds as text nothing can encode again
    "nested 100,000 deep": b'{"model": "m", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "nested 100,000 deep, objects": b'{"a": ' * 100_000 + b"1" + b"}" * 100_000,
    "nested 200 deep": b'{"model": "m", "prompt": "x", "user": ' + b"[" * 200 + b"]" * 200 + b"}",
    "invalid UTF-8": b'{"model": "m", "prompt": "\xff\xfe"}',
    "a lone surrogate": b'{"model": "m", "prompt": "abc \\ud800 def", "max_tokens": 2}',
    "a lone surrogate in a key": b'{"model": "m", "\\udc00": 1}',
    "NaN": b'{"model": "m", "prompt": "x", "temperature": NaN}',
    "an integer of 5,000 digits": b'{"model": "m", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
}


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_bodies_the_parser_cannot_hold_answer_400(fuzz_stack, endpoint):
    """Depth, invalid UTF-8, lone surrogates, JSON's missing constants, Python's digit limit: each a 400 in
    OpenAI's error shape that says why, never a 5xx, and the gateway serves on."""
    url = fuzz_stack["url"]
    openai = openapi_validator()
    for name, body in HOSTILE_BODIES.items():
        r = httpx.post(url + endpoint, content=body, headers={"Content-Type": "application/json"}, timeout=60)
        assert r.status_code == 400, (name, r.status_code, r.text[:300])
        openai(r.json(), "ErrorResponse")
        message = r.json()["error"]["message"]
        assert r.json()["error"]["code"] == "invalid_json" and message, (name, message)
        if "deep" in name:
            assert "deeper than" in message, message
        if "surrogate" in name:
            assert "surrogate" in message, message
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "def f(x):", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200  # and it still serves


def _content(request: dict):
    if "json" in request:
        return json.dumps(request["json"]).encode()
    return request.get("content", request.get("data"))
