"""The gateway against real processes: a `splitspec verifier` (demo target), a `splitspec drafter`
(the demo EAGLE head, over ZeroMQ) and a `splitspec gateway`, driven by the official `openai` client and
raw HTTP. Every body is validated against OpenAI's OpenAPI document (../shared/schemas)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from helpers import spawn_service
from test_verifier_service import free_port, scrape, start_verifier, stop, token_delta

from splitspec import lifeline
from splitspec.demo import demo_model_dirs

SCHEMAS = [Path(os.environ.get("SPLITSPEC_SCHEMAS", "")), Path(__file__).resolve().parents[2] / "shared" / "schemas",
           Path("/work/shared/schemas")]
MODEL = "demo-code"


def openapi_validator():
    from jsonschema import Draft202012Validator
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT202012

    path = next((p / "openai-openapi.json" for p in SCHEMAS if (p / "openai-openapi.json").is_file()), None)
    if path is None:
        pytest.skip("../shared/schemas/openai-openapi.json is not on this machine (CI always has it)")
    document = openapi_nullable(json.loads(path.read_text()))
    registry = Registry().with_resource("urn:openai", Resource.from_contents(document, default_specification=DRAFT202012))

    def validate(body: dict, name: str) -> None:
        validator = Draft202012Validator({"$ref": f"urn:openai#/components/schemas/{name}"}, registry=registry)
        errors = sorted(validator.iter_errors(body), key=lambda e: list(e.path))
        assert not errors, f"{name}: " + "; ".join(f"{list(e.path)}: {e.message}" for e in errors[:5])

    return validate


def openapi_nullable(node):
    """The document still marks some schemas with OpenAPI 3.0's `nullable: true`, which JSON Schema does
    not know: read each as OpenAPI defines it, the schema or null."""
    if isinstance(node, list):
        return [openapi_nullable(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = {k: openapi_nullable(v) for k, v in node.items()}
    if node.pop("nullable", False) is True:
        annotations = {k: node.pop(k) for k in ("description", "deprecated", "default") if k in node}
        return {"anyOf": [node, {"type": "null"}], **annotations}
    return node


@pytest.fixture(scope="module")
def validate():
    return openapi_validator()


def start_gateway(verifier_port: int, *extra: str, env: dict | None = None):
    port = free_port()
    process = spawn_service([sys.executable, "-P", "-m", "splitspec", "gateway", "--port", str(port), "--verifier",
                                f"127.0.0.1:{verifier_port}", "--log-level", "warning", *extra], env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        assert process.poll() is None, process.stderr.read()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    process.kill()
    raise AssertionError("the gateway did not become healthy")


@pytest.fixture(scope="module")
def stack():
    """verifier (EAGLE, demo target) + drafter process (demo EAGLE head) + gateway."""
    dirs = demo_model_dirs(heads=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    flags = ["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", str(dirs["eagle"]),
             "--speculative-num-steps", "5", "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8"]
    drafter = spawn_service([sys.executable, "-P", "-m", "splitspec", "drafter", "--verifier-drafter-addr", address,
                                "--model-path", str(dirs["target"]), "--dtype", "float32", *flags, "--log-level", "warning"])
    verifier, stub = start_verifier("--model-path", str(dirs["target"]), "--max-total-tokens", "32768",
                                    "--served-model-name", MODEL, "--drafter-bind-addr", address, "--wait-for-drafters", "1",
                                    "--drafter-timeout-ms", "5000",
                                    *flags)
    port = stub.port
    gateway, url = start_gateway(port)
    yield {"url": url, "stub": stub, "dirs": dirs, "gateway": gateway}
    gateway.kill()
    gateway.wait(timeout=30)
    stop(verifier, stub)
    drafter.kill()
    drafter.wait(timeout=30)


def client(stack):
    from openai import OpenAI

    return OpenAI(base_url=stack["url"] + "/v1", api_key="unused", max_retries=0, timeout=120)


def sse(url: str, body: dict) -> list[dict]:
    """A streamed request read line by line: the JSON chunks, ending with [DONE] (checked)."""
    chunks, done = [], False
    with httpx.stream("POST", url, json=body, timeout=120) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            if line == "data: [DONE]":
                done = True
                continue
            assert not done
            chunks.append(json.loads(line[len("data: "):]))
    assert done
    return chunks


CHATS = [[{"role": "user", "content": "def fibonacci(n):"}],
         [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "import os\n\ndef walk(path):"}],
         [{"role": "user", "content": "class Stack:"}, {"role": "assistant", "content": "    def __init__(self):"},
          {"role": "user", "content": "go on"}],
         [{"role": "user", "content": "for i in range(10):\n    print(i)\nfor i in range(10):"}]]


def test_chat_equals_transformers_and_speculates(stack, validate):
    """Greedy chat text equals transformers' apply_chat_template + generate on the demo target; the
    response validates and reports accepted drafts."""
    from helpers import hf_model
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(stack["dirs"]["target"])
    model = hf_model(stack["dirs"]["target"])  # float32, as the verifier runs here
    accepted = 0
    for messages in CHATS:
        raw = client(stack).chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=40,
                                                                      temperature=0)
        body = json.loads(raw.text)
        validate(body, "CreateChatCompletionResponse")
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        out = model.generate(**ids, max_new_tokens=40, do_sample=False)
        expected = tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
        assert body["choices"][0]["message"]["content"] == expected
        assert body["usage"]["prompt_tokens"] == ids["input_ids"].shape[1]
        spec = body["speculative"]
        assert spec["algorithm"] == "EAGLE" and spec["verify_steps"] > 0
        accepted += spec["accepted_tokens"]
    assert accepted > 0


def test_streams_equal_whole_responses_and_validate(stack, validate):
    url = stack["url"]
    for chat in (True, False):
        body = {"model": MODEL, "max_tokens": 32, "temperature": 0.8, "seed": 11, "n": 2}
        body.update({"messages": CHATS[0]} if chat else {"prompt": "import sys\n\n\ndef main():\n"})
        endpoint = url + ("/v1/chat/completions" if chat else "/v1/completions")
        whole = httpx.post(endpoint, json=body, timeout=120).json()
        validate(whole, "CreateChatCompletionResponse" if chat else "CreateCompletionResponse")
        chunks = sse(endpoint, {**body, "stream": True, "stream_options": {"include_usage": True}})
        texts = {0: "", 1: ""}
        for chunk in chunks:
            if chat:
                validate(chunk, "CreateChatCompletionStreamResponse")
            else:  # OpenAI streams finish_reason null until the end, which the shared schema does not allow
                fixed = {**chunk, "choices": [{**c, "finish_reason": c["finish_reason"] or "stop"} for c in chunk["choices"]]}
                validate(fixed, "CreateCompletionResponse")
            for c in chunk["choices"]:
                texts[c["index"]] += (c["delta"].get("content") or "") if chat else c["text"]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
        assert all(c.get("usage", "absent") == (None if chat else "absent") for c in chunks[:-1])
        if chat:
            assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
        assert len(finals) == 2 and all(f["speculative"]["algorithm"] == "EAGLE" for f in finals)
        for choice in whole["choices"]:
            text = choice["message"]["content"] if chat else choice["text"]
            assert texts[choice["index"]] == text
        assert whole["choices"][0] != whole["choices"][1]  # two samples (seeds 11 and 12)
        # vLLM's continuous_usage_stats: every chunk carries the usage so far, ending at the whole answer's
        running = sse(endpoint, {**body, "stream": True, "stream_options": {"include_usage": True,
                                                                           "continuous_usage_stats": True}})
        counts = [chunk["usage"]["completion_tokens"] for chunk in running]
        assert counts == sorted(counts) and counts[0] < counts[-1] == whole["usage"]["completion_tokens"]
        assert all(chunk["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"] for chunk in running)
        assert running[-1]["usage"] == whole["usage"]
        for chunk in running[:-1]:
            if chat:
                validate(chunk, "CreateChatCompletionStreamResponse")


def test_openai_client_streaming_logprobs_models_and_stop(stack, validate):
    c = client(stack)
    models = json.loads(c.models.with_raw_response.list().text)
    validate(models, "ListModelsResponse")
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert c.models.retrieve(MODEL).id == MODEL
    pieces = [chunk.choices[0].delta.content or "" for chunk in c.chat.completions.create(
        model=MODEL, messages=CHATS[1], max_tokens=24, temperature=0, stream=True) if chunk.choices]
    whole = c.chat.completions.create(model=MODEL, messages=CHATS[1], max_tokens=24, temperature=0)
    assert "".join(pieces) == whole.choices[0].message.content
    lp = c.chat.completions.create(model=MODEL, messages=CHATS[0], max_tokens=12, temperature=0, logprobs=True,
                                   top_logprobs=3)
    content = lp.choices[0].logprobs.content
    assert len(content) == 12 and all(len(t.top_logprobs) == 3 for t in content)
    assert "".join(bytes(t.bytes).decode("utf-8", "replace") for t in content) == lp.choices[0].message.content
    assert all(t.logprob == t.top_logprobs[0].logprob for t in content)  # greedy: the chosen token is the likeliest
    completion = c.completions.create(model=MODEL, prompt="import os\n", max_tokens=10, temperature=0, logprobs=2)
    assert len(completion.choices[0].logprobs.tokens) == 10
    # a stop string: the text ends right before it, in both shapes
    text = c.completions.create(model=MODEL, prompt="def f(x):\n", max_tokens=40, temperature=0).choices[0].text
    stop = text[12:15]
    assert len(stop) == 3 and text.find(stop) >= 0
    stopped = c.completions.create(model=MODEL, prompt="def f(x):\n", max_tokens=40, temperature=0, stop=[stop, "@@@"])
    assert stopped.choices[0].text == text[: text.find(stop)] and stopped.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=MODEL, prompt="def f(x):\n", max_tokens=40, temperature=0, stop=stop, stream=True) if ch.choices)
    assert streamed == text[: text.find(stop)]
    aborts = [line for line in httpx.get(stack["url"] + "/metrics", timeout=10).text.splitlines()
              if line.startswith('splitspec:gateway_aborts_total{cause="stop_string"}')]
    assert aborts and float(aborts[0].split()[-1]) >= 2  # each hit stopped the verifier's request


def test_a_batch_of_prompts_with_n(stack, validate):
    """OpenAI's batched completions: choices indexed prompt by prompt, n each, texts and token ids mixed."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(stack["dirs"]["target"])
    prompts = ["def add(a, b):\n", tokenizer.encode("class Point:\n"), "import json\n"]
    body = {"model": MODEL, "prompt": prompts, "n": 2, "max_tokens": 12, "temperature": 0}
    r = httpx.post(stack["url"] + "/v1/completions", json=body, timeout=120).json()
    validate(r, "CreateCompletionResponse")
    assert [c["index"] for c in r["choices"]] == list(range(6))
    for i, prompt in enumerate(prompts):
        alone = httpx.post(stack["url"] + "/v1/completions", json={**body, "prompt": prompt, "n": 1}, timeout=60).json()
        assert r["choices"][2 * i]["text"] == r["choices"][2 * i + 1]["text"] == alone["choices"][0]["text"]
    assert r["usage"]["prompt_tokens"] == sum(len(tokenizer.encode(p)) if isinstance(p, str) else len(p) for p in prompts)
    assert r["usage"]["completion_tokens"] == 6 * 12


def test_speculation_can_be_switched_off_per_request(stack):
    body = {"model": MODEL, "prompt": "for i in range(3):\n", "max_tokens": 24, "temperature": 0}
    on = httpx.post(stack["url"] + "/v1/completions", json=body, timeout=60).json()
    off = httpx.post(stack["url"] + "/v1/completions", json={**body, "speculative": False}, timeout=60).json()
    assert on["choices"][0]["text"] == off["choices"][0]["text"]
    assert on["speculative"]["verify_steps"] > 0 and off["speculative"]["verify_steps"] == 0
    assert off["speculative"]["algorithm"] is None


def test_hostile_bodies_get_openai_errors_never_5xx(stack, validate):
    url = stack["url"] + "/v1/chat/completions"
    good = {"model": MODEL, "messages": CHATS[0], "max_tokens": 4}
    cases = {
        "invalid json": (b"{not json", 400), "invalid utf-8": (b'{"model": "\xff\xfe"}', 400),
        "not an object": (b"[1, 2]", 400), "no messages": ({"model": MODEL}, 400),
        "empty messages": ({**good, "messages": []}, 400),
        "unknown role": ({**good, "messages": [{"role": "wizard", "content": "x"}]}, 400),
        "empty role": ({**good, "messages": [{"role": "", "content": "x"}]}, 400),
        "content type": ({**good, "messages": [{"role": "user", "content": 5}]}, 400),
        "max_tokens string": ({**good, "max_tokens": "many"}, 400), "max_tokens negative": ({**good, "max_tokens": -1}, 400),
        "max_tokens huge": ({**good, "max_tokens": 10**12}, 400), "temperature": ({**good, "temperature": -0.5}, 400),
        "temperature nan": (b'{"model": "demo-code", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400),
        "top_p": ({**good, "top_p": 0}, 400), "n": ({**good, "n": 0}, 400), "bool as int": ({**good, "n": True}, 400),
        "stop": ({**good, "stop": ["a", "b", "c", "d", "e"]}, 400), "penalty": ({**good, "frequency_penalty": 3}, 400),
        "top_logprobs alone": ({**good, "top_logprobs": 2}, 400), "unknown parameter": ({**good, "foo": 1}, 400),
        "custom tool": ({**good, "tools": [{"type": "custom", "custom": {"name": "f"}}]}, 400),
        "tool_choice without tools": ({**good, "tool_choice": "required"}, 400),
        "functions": ({**good, "functions": [{"name": "f"}]}, 400),
        "unknown model": ({**good, "model": "gpt-9"}, 404),
        "context length": ({**good, "messages": [{"role": "user", "content": "x " * 5000}]}, 400),
        "oversized": (b'{"model": "' + b"a" * (9 << 20) + b'"}', 413),
        "lone surrogate": (b'{"model": "demo-code", "messages": [{"role": "user", "content": "\\ud800"}]}', 400),
    }
    for name, (body, status) in cases.items():
        if isinstance(body, bytes):
            r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=60)
        else:
            r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == status, (name, r.status_code, r.text[:300])
        validate(r.json(), "ErrorResponse")
    completions = stack["url"] + "/v1/completions"
    for body in ({"model": MODEL, "prompt": [1, 99999]}, {"model": MODEL, "prompt": ""}, {"model": MODEL, "prompt": 5},
                 {"model": MODEL, "prompt": ["ok", ""]}, {"model": MODEL, "prompt": [[1, 2], [3, "x"]]},
                 {"model": MODEL, "prompt": "x", "echo": 1}, {"model": MODEL, "prompt": "x", "logprobs": 9}):
        r = httpx.post(completions, json=body, timeout=60)
        assert r.status_code == 400, (body, r.text)
        validate(r.json(), "ErrorResponse")
    r = httpx.get(stack["url"] + "/v1/nothing", timeout=10)
    assert r.status_code == 404
    validate(r.json(), "ErrorResponse")
    r = httpx.get(completions, timeout=10)  # only a POST takes the completion routes' way past the app's router
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed", r.text
    validate(r.json(), "ErrorResponse")
    ok = httpx.post(url, json={**good, "logit_bias": {}, "response_format": {"type": "text"}, "store": False}, timeout=60)
    assert ok.status_code == 200  # OpenAI parameters at their neutral values are accepted


def test_logit_bias_and_stop_token_ids_through_the_openai_client(stack):
    """OpenAI's logit_bias reaches the verifier's target logits: +100 on a token id makes a greedy completion that
    token repeated (the text the tokenizer makes of it), streamed or whole, chat or completions, while the request
    speculates; a token id outside the vocabulary is a 400 naming logit_bias."""
    import openai
    from transformers import AutoTokenizer

    c = client(stack)
    tokenizer = AutoTokenizer.from_pretrained(stack["dirs"]["target"])
    token = tokenizer.encode(" x", add_special_tokens=False)[-1]
    expected = tokenizer.decode([token] * 12)
    whole = c.completions.create(model=MODEL, prompt="def f(x):\n", max_tokens=12, temperature=0,
                                 logit_bias={str(token): 100})
    assert whole.choices[0].text == expected
    assert whole.model_extra["speculative"]["draft_tokens"] > 0  # the stack's EAGLE head drafted; the bias verified them
    streamed = "".join(chunk.choices[0].text for chunk in c.completions.create(
        model=MODEL, prompt="def f(x):\n", max_tokens=12, temperature=0, logit_bias={str(token): 100}, stream=True))
    assert streamed == expected
    chat = c.chat.completions.create(model=MODEL, messages=CHATS[0], max_tokens=12, temperature=0,
                                     logit_bias={str(token): 100})
    assert chat.choices[0].message.content == expected
    with pytest.raises(openai.BadRequestError) as refused:
        c.completions.create(model=MODEL, prompt="x", max_tokens=4, logit_bias={"99999999": 5})
    assert refused.value.body["param"] == "logit_bias"
    # vLLM's and SGLang's stop_token_ids (extra_body, as their clients send it): the forced token ends the request
    # at once, in the output (not a special token) with finish reason stop; an id never produced lets it run out
    stopped = c.completions.create(model=MODEL, prompt="def f(x):\n", max_tokens=12, temperature=0,
                                   logit_bias={str(token): 100}, extra_body={"stop_token_ids": [token]})
    assert (stopped.choices[0].text, stopped.choices[0].finish_reason, stopped.usage.completion_tokens) == (
        tokenizer.decode([token]), "stop", 1)
    other = (token + 1) % 4096
    ran = c.chat.completions.create(model=MODEL, messages=CHATS[0], max_tokens=6, temperature=0,
                                    logit_bias={str(token): 100}, extra_body={"stop_token_ids": [other]})
    assert ran.choices[0].finish_reason == "length" and ran.usage.completion_tokens == 6
    with pytest.raises(openai.BadRequestError) as refused:
        c.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body={"stop_token_ids": [10**9]})
    assert refused.value.body["param"] == "stop_token_ids"


def test_min_p_min_tokens_and_special_tokens_through_the_openai_client(stack):
    """vLLM's and SGLang's extensions as their clients send them (extra_body): min_p 1 at temperature 1 is greedy
    decoding (only the most likely token survives), while the request speculates; min_tokens holds back a stop
    token that logit_bias forces everywhere until that many tokens are out; skip_special_tokens false shows the
    special tokens' text; min_tokens above max_tokens is a 400 naming it."""
    import openai
    from transformers import AutoTokenizer

    c = client(stack)
    tokenizer = AutoTokenizer.from_pretrained(stack["dirs"]["target"])
    greedy = c.completions.create(model=MODEL, prompt="def f(x):\n", max_tokens=16, temperature=0)
    top_only = c.completions.create(model=MODEL, prompt="def f(x):\n", max_tokens=16, temperature=1.0, seed=3,
                                    extra_body={"min_p": 1.0})
    assert top_only.choices[0].text == greedy.choices[0].text
    assert top_only.model_extra["speculative"]["draft_tokens"] > 0
    token = tokenizer.encode(" x", add_special_tokens=False)[-1]
    held = c.completions.create(model=MODEL, prompt="def f(x):\n", max_tokens=12, temperature=0,
                                logit_bias={str(token): 100}, extra_body={"stop_token_ids": [token], "min_tokens": 5})
    assert (held.choices[0].finish_reason, held.usage.completion_tokens) == ("stop", 6)
    assert held.choices[0].text.endswith(tokenizer.decode([token])) and held.choices[0].text.count(" x") == 1
    special = tokenizer.eos_token_id
    assert special in tokenizer.all_special_ids
    forced = dict(model=MODEL, prompt="def f(x):\n", max_tokens=3, temperature=0, logit_bias={str(special): 100},
                  extra_body={"ignore_eos": True})
    assert c.completions.create(**forced).choices[0].text == ""
    shown = c.completions.create(**{**forced, "extra_body": {"ignore_eos": True, "skip_special_tokens": False,
                                                             "spaces_between_special_tokens": True}})
    assert shown.choices[0].text == tokenizer.decode([special] * 3, skip_special_tokens=False) != ""
    streamed = "".join(chunk.choices[0].text for chunk in c.completions.create(
        **{**forced, "extra_body": {"ignore_eos": True, "skip_special_tokens": False}}, stream=True))
    assert streamed == shown.choices[0].text
    with pytest.raises(openai.BadRequestError) as refused:
        c.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body={"min_tokens": 5})
    assert refused.value.body["param"] == "min_tokens"


def test_structured_outputs_through_the_openai_client(stack, validate):
    """response_format json_schema (strict) and json_object on chat, SGLang's regex on completions (extra_body),
    streamed and whole, while the requests speculate: every complete answer parses and matches; a bad schema or
    regex is a 400 naming its field, and the server keeps serving."""
    import openai
    from test_structured_outputs import SCHEMA, valid

    c = client(stack)
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Describe a shape as JSON."}], max_tokens=64,
               temperature=0)
    raw = c.chat.completions.with_raw_response.create(**ask, response_format={
        "type": "json_schema", "json_schema": {"name": "shape", "schema": SCHEMA, "strict": True}})
    validate(json.loads(raw.text), "CreateChatCompletionResponse")
    shaped = raw.parse()
    assert shaped.choices[0].finish_reason == "stop" and valid(shaped.choices[0].message.content), shaped
    assert shaped.model_extra["speculative"]["draft_tokens"] > 0
    mode = c.chat.completions.create(**ask, response_format={"type": "json_object"}, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in mode if chunk.choices)
    whole = c.chat.completions.create(**ask, response_format={"type": "json_object"}).choices[0]
    assert text == whole.message.content and (whole.finish_reason == "length" or isinstance(json.loads(text), dict))
    pattern = r"(yes|no), [a-z]{2,8}\."
    matched = c.completions.create(model=MODEL, prompt="Answer: ", max_tokens=24, temperature=0,
                                   extra_body={"regex": pattern}).choices[0]
    assert matched.finish_reason == "stop" and re.fullmatch(pattern, matched.text), matched
    for extra, field in (({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "objectx"}}}}, "response_format"), ({"extra_body": {"regex": "a(b"}}, "regex")):
        with pytest.raises(openai.BadRequestError) as refused:
            c.chat.completions.create(**ask, **extra)
        assert refused.value.body["param"] == field and "invalid" in refused.value.body["message"]
    assert c.chat.completions.create(**ask).choices[0].message.content  # still serving


def test_vllms_structured_outputs_fields_through_the_openai_client(stack):
    """vLLM's structured_outputs (json, regex, choice, grammar, json_object) and its older guided_* fields, as its
    clients send them (extra_body), while the requests speculate: every answer matches its constraint (a choice one
    of the strings, quotes and all); two constraints, or a bad one, are 400s naming the field."""
    import openai
    from test_structured_outputs import SCHEMA, valid

    c = client(stack)
    choices = ["positive", "negative", 'say "hi"\n']
    checks = [({"structured_outputs": {"json": SCHEMA}}, lambda t: valid(t)),
              ({"guided_json": json.dumps(SCHEMA)}, lambda t: valid(t)),
              ({"structured_outputs": {"regex": r"(yes|no)!"}}, lambda t: t in ("yes!", "no!")),
              ({"guided_regex": r"[a-c]{3}"}, lambda t: re.fullmatch(r"[a-c]{3}", t)),
              ({"structured_outputs": {"choice": choices}}, lambda t: t in choices),
              ({"guided_choice": choices}, lambda t: t in choices),
              ({"structured_outputs": {"grammar": 'root ::= "x" [0-9] [0-9]'}}, lambda t: re.fullmatch(r"x[0-9]{2}", t)),
              ({"guided_grammar": 'root ::= "q" | "r"'}, lambda t: t in ("q", "r")),
              ({"structured_outputs": {"json_object": True}}, lambda t: isinstance(json.loads(t), dict))]
    drafted = 0
    for extra, check in checks:
        answer = c.completions.create(model=MODEL, prompt="Describe a shape as JSON: ", max_tokens=96, temperature=0,
                                      extra_body=extra)
        assert answer.choices[0].finish_reason == "stop" and check(answer.choices[0].text), (extra, answer)
        drafted += answer.model_extra["speculative"]["draft_tokens"]
    assert drafted > 0
    chat = c.chat.completions.create(model=MODEL, messages=CHATS[0], max_tokens=8, temperature=0,
                                     extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert chat.choices[0].message.content in ("yes", "no")
    for extra, field in (({"guided_choice": ["a"], "regex": "a"}, "response_format"),
                         ({"structured_outputs": {"json": "{x"}}, "structured_outputs.json"),
                         ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
                         ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
                         ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern")):
        with pytest.raises(openai.BadRequestError) as refused:
            c.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=extra)
        assert refused.value.body["param"] == field, (extra, refused.value.body)


def test_tool_calls_through_the_openai_client(stack, validate):
    """tools with tool_choice required and a named function (constrained decoding, while the requests speculate),
    whole and streamed, through the openai client: OpenAI's tool_calls, arguments that validate against the
    function's parameters, the same calls streamed as whole; auto on a model that answers in prose: content, no
    calls; the calls sent back with the tool's answer; unknown tools and bad schemas are 400s naming the field."""
    import openai
    from test_structured_outputs import valid
    from test_tools import TIME, WEATHER

    c = client(stack)
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "What is the weather in Oslo?"}], max_tokens=96,
               temperature=0, tools=[WEATHER, TIME])
    one = dict(tool_choice="required", parallel_tool_calls=False)  # one call: the demo model would list calls to the end
    raw = c.chat.completions.with_raw_response.create(**ask, **one)
    validate(json.loads(raw.text), "CreateChatCompletionResponse")
    required = raw.parse().choices[0]
    assert required.finish_reason == "tool_calls" and required.message.content is None, required
    assert len(required.message.tool_calls) == 1
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in required.message.tool_calls:
        assert call.type == "function" and valid(call.function.arguments, schemas[call.function.name]), call
    assert raw.parse().model_extra["speculative"]["draft_tokens"] > 0
    plain = c.chat.completions.create(**ask, **one, extra_body={"speculative": False}).choices[0]  # lossless
    assert [(t.function.name, t.function.arguments) for t in plain.message.tool_calls] == [
        (t.function.name, t.function.arguments) for t in required.message.tool_calls]
    streamed = {}
    for chunk in c.chat.completions.create(**ask, **one, stream=True):
        for piece in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            entry = streamed.setdefault(piece.index, {"name": None, "arguments": ""})
            entry["name"] = piece.function.name or entry["name"]
            entry["arguments"] += piece.function.arguments or ""
    assert [(e["name"], json.loads(e["arguments"])) for _, e in sorted(streamed.items())] == [
        (t.function.name, json.loads(t.function.arguments)) for t in required.message.tool_calls]
    named_choice = {"type": "function", "function": {"name": "get_time"}}
    named = c.chat.completions.create(**ask, tool_choice=named_choice).choices[0]
    assert named.finish_reason in ("stop", "length") and len(named.message.tool_calls) == 1
    call = named.message.tool_calls[0]
    assert call.function.name == "get_time" and (named.finish_reason == "length" or valid(call.function.arguments,
                                                                                            schemas["get_time"]))
    chunks = list(c.chat.completions.create(**ask, tool_choice=named_choice, stream=True))
    arguments = "".join(p.function.arguments or "" for k in chunks if k.choices for p in k.choices[0].delta.tool_calls or [])
    assert arguments == call.function.arguments and chunks[-1].choices[0].finish_reason == named.finish_reason
    auto = c.chat.completions.create(**ask).choices[0]  # the demo model writes code, never a call
    assert auto.message.tool_calls is None and auto.message.content and auto.finish_reason in ("stop", "length")
    answer = c.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, tools=[WEATHER, TIME], messages=[
        *ask["messages"], {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": "get_time", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "12:00"}])
    assert answer.choices[0].message.content is not None
    bad_schema = {"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}
    for extra, field in ((dict(tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
                         (dict(tools=[bad_schema], tool_choice="required"), "tools")):
        with pytest.raises(openai.BadRequestError) as refused:
            c.chat.completions.create(**{**ask, **extra})
        assert refused.value.body["param"] == field, refused.value.body
    assert c.chat.completions.create(**ask, tool_choice="none").choices[0].message.content  # still serving


def test_echo_with_prompt_logprobs_as_lm_eval_harness_asks(stack, validate):
    """Completions with echo (lm-eval-harness's loglikelihood requests: echo, logprobs, max_tokens 0 or 1): the
    prompt's text comes back before the completion's, and with logprobs the prompt tokens' too, the first null,
    each equal to a transformers forward's log-softmax on the demo target within 1e-4 (fp32), with the top
    alternatives; streamed the same; max_tokens 0 without echo is a 400 naming max_tokens. (OpenAI's document
    types every entry as a number; the first token's is null, as OpenAI's legacy API and vLLM return it: the
    answer validates once that entry is set aside.)"""
    import openai
    from helpers import hf_model
    from transformers import AutoTokenizer

    c = client(stack)
    target = stack["dirs"]["target"]
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompt = "def fibonacci(n):\n    if n < 2:\n        return n\n"
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        reference = hf_model(target)(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    expected = [reference[j, ids[j + 1]].item() for j in range(len(ids) - 1)]
    only = c.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=2, temperature=0)
    body = only.model_dump(exclude_unset=True)
    for key in ("token_logprobs", "top_logprobs", "tokens", "text_offset"):
        body["choices"][0]["logprobs"][key] = body["choices"][0]["logprobs"][key][1:]
    validate(body, "CreateCompletionResponse")
    choice = only.choices[0]
    assert (choice.text, choice.finish_reason, only.usage.completion_tokens) == (prompt, "length", 0)
    lps = choice.logprobs
    assert lps.tokens == [tokenizer.decode([t]) for t in ids] and lps.token_logprobs[0] is None
    assert max(abs(a - b) for a, b in zip(lps.token_logprobs[1:], expected)) < 1e-4
    assert lps.top_logprobs[0] is None and all(len(top) == 2 for top in lps.top_logprobs[1:])
    best = reference[:-1].argmax(-1).tolist()
    assert all(tokenizer.decode([b]) in top for b, top in zip(best, lps.top_logprobs[1:]))
    # max_tokens 1 (lm-eval's loglikelihood): the prompt's entries, then the completion's token after them
    plain = c.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=0)
    echoed = c.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=0, echo=True)
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    assert echoed.choices[0].logprobs.token_logprobs[: len(ids)] == lps.token_logprobs
    assert echoed.choices[0].logprobs.token_logprobs[len(ids):] == pytest.approx(  # recomputed, not from the cache:
        plain.choices[0].logprobs.token_logprobs, abs=1e-4)  # fp32 sums in another order
    assert echoed.choices[0].logprobs.text_offset[len(ids)] == len(prompt)
    assert echoed.usage.completion_tokens == 4 and echoed.model_extra["speculative"]["draft_tokens"] > 0
    chunks = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=0, echo=True,
                                       stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == echoed.choices[0].text
    streamed = [lp for ch in chunks if ch.choices and ch.choices[0].logprobs for lp in ch.choices[0].logprobs.token_logprobs]
    assert streamed == echoed.choices[0].logprobs.token_logprobs
    bare = c.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True)  # token ids echo as their text
    assert bare.choices[0].text == tokenizer.decode(ids) and bare.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError) as refused:
        c.completions.create(model=MODEL, prompt=prompt, max_tokens=0)
    assert refused.value.body["param"] == "max_tokens"


def test_tokenize_and_detokenize_as_vllm_and_sglang_serve_them(stack, validate):
    """POST /tokenize: a prompt's ids as the tokenizer makes them (special tokens added unless asked not to), a
    chat's as its completion counts them (the template rendered); POST /detokenize gives the text back; bad
    bodies get OpenAI's error object."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(stack["dirs"]["target"])
    base = stack["url"]
    text = "def fibonacci(n):\n    return n"
    r = httpx.post(base + "/tokenize", json={"model": MODEL, "prompt": text}, timeout=60)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["tokens"] == tokenizer.encode(text) and answer["count"] == len(answer["tokens"])
    assert answer["max_model_len"] > 0
    bare = httpx.post(base + "/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=60).json()
    assert bare["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    chat = httpx.post(base + "/tokenize", json={"messages": CHATS[0]}, timeout=60).json()
    completion = client(stack).chat.completions.create(model=MODEL, messages=CHATS[0], max_tokens=2, temperature=0)
    assert chat["count"] == completion.usage.prompt_tokens
    back = httpx.post(base + "/detokenize", json={"model": MODEL, "tokens": bare["tokens"]}, timeout=60)
    assert back.status_code == 200 and back.json() == {"prompt": text}
    for path, body in (("/tokenize", {"prompt": "x", "messages": CHATS[0]}), ("/tokenize", {}),
                       ("/tokenize", {"prompt": 5}), ("/detokenize", {"tokens": [1, 10**9]}),
                       ("/detokenize", {"tokens": "x"}), ("/tokenize", {"model": "nope", "prompt": "x"})):
        r = httpx.post(base + path, json=body, timeout=60)
        assert r.status_code in (400, 404), (path, body, r.status_code, r.text)
        validate(r.json(), "ErrorResponse")


def test_chat_template_options_and_kept_stop_strings_through_the_openai_client(stack, validate):
    """vLLM's and SGLang's chat extensions as their clients send them (extra_body): continue_final_message continues
    an assistant's prefill (the chat's greedy answer equals a completion of the ids /tokenize gives for the same
    options), chat_template_kwargs reach the template, conflicting options are 400s naming their field;
    include_stop_str_in_output (SGLang: no_stop_trim) keeps the stop string, whole and streamed."""
    import openai

    c = client(stack)
    prefilled = [{"role": "user", "content": "Write add."}, {"role": "assistant", "content": "def add(a, b):"}]
    options = {"continue_final_message": True}
    ids = httpx.post(stack["url"] + "/tokenize", json={"messages": prefilled, **options}, timeout=60).json()["tokens"]
    whole = httpx.post(stack["url"] + "/tokenize", json={"messages": prefilled}, timeout=60).json()["tokens"]
    assert whole[:len(ids)] == ids and len(whole) > len(ids)  # the turn's end and the next header are left out
    chat = c.chat.completions.create(model=MODEL, messages=prefilled, max_tokens=12, temperature=0, extra_body=options)
    text = c.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert chat.choices[0].message.content == text.choices[0].text and chat.usage.prompt_tokens == len(ids)
    assert chat.model_extra["speculative"]["draft_tokens"] > 0
    kwargs = c.chat.completions.create(model=MODEL, messages=CHATS[0], max_tokens=4, temperature=0,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert kwargs.choices[0].message.content == c.chat.completions.create(
        model=MODEL, messages=CHATS[0], max_tokens=4, temperature=0).choices[0].message.content  # unused by this template
    for extra, field in (({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
                         ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
                         ({"chat_template_kwargs": [1]}, "chat_template_kwargs")):
        with pytest.raises(openai.BadRequestError) as refused:
            c.chat.completions.create(model=MODEL, messages=prefilled, max_tokens=4, extra_body=extra)
        assert refused.value.body["param"] == field, refused.value.body
    with pytest.raises(openai.BadRequestError) as refused:  # nothing to continue
        c.chat.completions.create(model=MODEL, messages=[*prefilled[:1], {"role": "assistant", "content": ""}],
                                  max_tokens=4, extra_body=options)
    assert refused.value.body["param"] == "messages" and "continue" in refused.value.body["message"]
    free = c.completions.create(model=MODEL, prompt="def f(x):\n", max_tokens=24, temperature=0).choices[0].text
    stop = free[len(free) // 2:len(free) // 2 + 2]
    cut = c.completions.create(model=MODEL, prompt="def f(x):\n", max_tokens=24, temperature=0, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == free[:free.index(stop)]
    for name in ("include_stop_str_in_output", "no_stop_trim"):
        kept = c.completions.create(model=MODEL, prompt="def f(x):\n", max_tokens=24, temperature=0, stop=[stop],
                                    extra_body={name: True}).choices[0]
        assert kept.finish_reason == "stop" and kept.text == cut.text + stop
        streamed = "".join(chunk.choices[0].text for chunk in c.completions.create(
            model=MODEL, prompt="def f(x):\n", max_tokens=24, temperature=0, stop=[stop], stream=True,
            extra_body={name: True}) if chunk.choices)
        assert streamed == kept.text


def test_sixty_four_concurrent_streams_equal_their_twins(stack):
    url = stack["url"] + "/v1/completions"
    prompts = [f"def task_{i}(x):\n    return x" for i in range(64)]

    async def main():
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=200)) as http:
            async def streamed(prompt):
                text = ""
                async with http.stream("POST", url, json={"model": MODEL, "prompt": prompt, "max_tokens": 16,
                                                          "temperature": 0, "stream": True}) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
                return text

            async def whole(prompt):
                r = await http.post(url, json={"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0})
                return r.json()["choices"][0]["text"]

            streams = await asyncio.gather(*(streamed(p) for p in prompts))
            twins = await asyncio.gather(*(whole(p) for p in prompts))
            return streams, twins

    streams, twins = asyncio.run(main())
    assert streams == twins and all(streams)
    metrics = {line.split(" ")[0]: float(line.split(" ")[1]) for line in httpx.get(stack["url"] + "/metrics").text.splitlines()
               if line.startswith("splitspec:gateway_tokenize_batch_size_")}
    batches = next(v for k, v in metrics.items() if k.startswith("splitspec:gateway_tokenize_batch_size_count"))
    requests = next(v for k, v in metrics.items() if k.startswith("splitspec:gateway_tokenize_batch_size_sum"))
    assert requests > batches  # requests that arrived together were tokenized together


def test_an_unstreamed_answer_reaches_the_gateway_in_two_deltas_unless_stop_strings_are_matched(stack):
    """A request the gateway does not stream asks the verifier for deltas of 50 tokens (SubmitRequest.stream_interval):
    its first token, then the rest at its end, so the gateway handles two deltas, not one per step; with stop strings
    to match as the text grows (or streamed) it gets every step's. Counted by the gateway's inter-token latency
    histogram (one observation per delta after the first); the texts are the same either way."""
    def gaps() -> float:
        return sum(float(line.split(" ")[1]) for line in httpx.get(stack["url"] + "/metrics", timeout=10).text.splitlines()
                   if line.startswith("splitspec:inter_token_latency_seconds_count"))

    body = {"model": MODEL, "prompt": "def fibonacci(n):\n", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    texts, grew = {}, {}
    for name, extra in (("whole", {}), ("stop strings", {"stop": ["qqqzzzxxx"]}), ("streamed", {"stream": True})):
        before = gaps()
        with httpx.stream("POST", stack["url"] + "/v1/completions", json={**body, **extra}, timeout=120) as r:
            assert r.status_code == 200
            raw = r.read().decode()
        if extra.get("stream"):
            events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
            texts[name] = "".join(e["choices"][0]["text"] for e in events if e["choices"])
        else:
            texts[name] = json.loads(raw)["choices"][0]["text"]
        grew[name] = gaps() - before
    assert texts["whole"] == texts["stop strings"] == texts["streamed"] != ""
    assert grew["whole"] == 1 and grew["stop strings"] > 1 and grew["streamed"] > 1, grew


async def streamed_tokens(client, request_id: str, queue) -> int:
    """The tokens a request submitted on a VerifierClient streams until its last delta."""
    tokens = 0
    while True:
        delta = await asyncio.wait_for(queue.get(), 120)
        tokens += len(delta.token_ids)
        if delta.finish_reason:
            client.done(request_id)
            return tokens


def test_a_burst_reaches_the_verifier_while_the_gateway_still_takes_it(stack):
    """A burst of requests whose handlers are ready together: the first submissions are written to the verifier's
    stream while the later handlers have not yet run (client.turn parks them once a submission has waited
    TURN_SECONDS), not all at once after the last handler; every request is still answered. Each stand-in handler
    does 1 ms of work (a wall-clock spin), so 24 of them take 24 ms, well past TURN_SECONDS, on any machine."""
    from splitspec.gateway.client import TURN_SECONDS, VerifierClient
    from splitspec.protos import verifier_pb2 as pb

    assert TURN_SECONDS < 0.02

    async def burst() -> tuple[list[int], list[int]]:
        client = VerifierClient(f"127.0.0.1:{stack['stub'].port}")
        writes, made = [], []
        real = client._submissions

        def submissions(submits):  # the real client's writes, observed
            writes.append(len(submits))
            return real(submits)

        client._submissions = submissions
        sampling = pb.SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)

        async def handler(k: int) -> int:
            await client.turn()
            made.append(len(writes))  # how many writes had gone out when this handler began its work
            end = time.perf_counter() + 0.001
            while time.perf_counter() < end:
                pass
            queue = client.submit(f"burst-{k}", [5 + k, 6, 7, 8], sampling, speculate=False)
            return await streamed_tokens(client, f"burst-{k}", queue)

        try:
            await client.model_info(timeout=30)
            tokens = await asyncio.gather(*(handler(k) for k in range(24)))
        finally:
            await client.close()
        assert tokens == [2] * 24
        return writes, made

    writes, made = asyncio.run(burst())
    assert sum(writes) == 24 and len(writes) >= 2, writes
    assert writes[0] < 24 and made[-1] >= 1, (writes, made)  # the last handler ran after the first write


def test_a_steps_deltas_reach_their_streams_with_the_loop_turning_between(stack):
    """A verifier message holding many requests' deltas (a step's) is handed to their queues FANOUT at a time with the
    event loop turning in between, so other work (the next requests' handlers, in a server) runs before the last of
    them: a task that only yields sees a message part-way handed out. The real verifier's messages, observed."""
    from splitspec.gateway.client import FANOUT, VerifierClient
    from splitspec.protos import verifier_pb2 as pb

    assert 0 < FANOUT < 8

    async def run() -> tuple[list[int], list[tuple[int, int]]]:
        client = VerifierClient(f"127.0.0.1:{stack['stub'].port}")
        sizes, partial, state = [], [], {"handed": 0, "size": 0, "done": False}
        generate = client.stub.Generate

        def observed(requests):  # the real call; each message's size noted as the reader takes it
            call = generate(requests)

            class Call:
                def cancel(self):
                    return call.cancel()

                async def __aiter__(self):
                    async for response in call:
                        sizes.append(len(response.deltas))
                        state["handed"], state["size"] = 0, len(response.deltas)
                        yield response

            return Call()

        client.stub.Generate = observed

        async def watch():  # only yields: runs whenever the reader lets the loop turn
            while not state["done"]:
                if 0 < state["handed"] < state["size"]:
                    partial.append((state["handed"], state["size"]))
                await asyncio.sleep(0)

        sampling = pb.SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)

        async def request(k: int) -> int:
            queue = client.submit(f"fan-{k}", [9 + k, 6, 7, 8], sampling, speculate=False)
            put = queue.put_nowait

            def counted(delta):
                state["handed"] += 1
                put(delta)

            queue.put_nowait = counted
            return await streamed_tokens(client, f"fan-{k}", queue)

        try:
            await client.model_info(timeout=30)
            watcher = asyncio.get_running_loop().create_task(watch())
            tokens = await asyncio.gather(*(request(k) for k in range(24)))
            state["done"] = True
            await watcher
        finally:
            await client.close()
        assert tokens == [2] * 24
        return sizes, partial

    sizes, partial = asyncio.run(run())
    assert sum(sizes) == 48 and max(sizes) > FANOUT, sizes  # 24 first and 24 last tokens, some messages many at once
    assert partial and all(handed % FANOUT == 0 for handed, _ in partial), (sizes, partial)


def test_disconnect_mid_stream_frees_the_kv_pages(stack):
    metrics_url = stack["stub"].metrics_url

    def used_pages():  # pages held by running requests (the prefix cache keeps finished prompts' pages)
        values = scrape(metrics_url)
        return sum(v for (name, _), v in values.items() if name == "splitspec:kv_pages_used") - sum(
            v for (name, _), v in values.items() if name == "splitspec:prefix_cache_pages")

    with httpx.stream("POST", stack["url"] + "/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": "import os\n", "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
                            "stream": True}) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        assert used_pages() > 0
    deadline = time.time() + 10
    while used_pages() > 0 and time.time() < deadline:
        time.sleep(0.1)
    assert used_pages() == 0
    # a non-streamed request whose client gives up
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(stack["url"] + "/v1/completions", timeout=httpx.Timeout(60, read=2.0),
                   json={"model": MODEL, "prompt": "import sys\n", "max_tokens": 1500, "temperature": 0, "ignore_eos": True})
    deadline = time.time() + 10
    while used_pages() > 0 and time.time() < deadline:
        time.sleep(0.1)
    assert used_pages() == 0
    aborts = [line for line in httpx.get(stack["url"] + "/metrics", timeout=10).text.splitlines()
              if line.startswith('splitspec:gateway_aborts_total{cause="disconnect"}')]
    assert aborts and float(aborts[0].split()[-1]) >= 2
    log = stack["gateway"].stderr.read()  # a client leaving is an ordinary end: no traceback for it
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]


def test_a_stalled_stream_reader_holds_no_one_else(stack):
    """A client that stops reading its stream: the verifier still finishes it at full speed (its pages are
    freed before the client reads a byte), others are served meanwhile, and when the client reads at
    last it gets the whole stream, equal to the same request answered whole."""
    host, port = stack["url"].removeprefix("http://").split(":")
    body = {"model": MODEL, "prompt": "def parse(text):", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "logprobs": 5}
    started = time.time()
    whole = httpx.post(stack["url"] + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    read_at_once = time.time() - started
    data = json.dumps({**body, "stream": True}).encode()
    slow = socket.socket()
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server's writes back up
    slow.connect((host, int(port)))
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(data), data))
    try:
        started = time.time()
        time.sleep(0.5)
        bound = 60 + 5 * read_at_once  # from the speed just measured: a starved CPU is slow for both
        while _held_pages(stack["stub"].metrics_url) > 0:  # the verifier runs it to the end unread
            assert time.time() - started < bound, "the verifier did not finish a request whose client stopped reading"
            time.sleep(0.1)
        finished = time.time() - started
        others_started = time.time()
        for prompt in ("x = 1\n", "import re\n", "class A:\n"):
            r = httpx.post(stack["url"] + "/v1/completions", timeout=120,
                           json={"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0})
            assert r.status_code == 200
        others = time.time() - others_started
        slow.settimeout(120)
        raw = b""
        while chunk := slow.recv(1 << 16):  # to the end: the gateway closes the connection (Connection: close)
            raw += chunk
    finally:
        slow.close()
    events = [json.loads(line[len("data: "):]) for line in raw.decode().splitlines()
              if line.startswith("data: {")]
    text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
    assert b"data: [DONE]" in raw and text == whole and events[-1]["choices"][0]["finish_reason"] == "length"
    print(f"a stalled reader: the verifier finished its 400 tokens {finished:.1f} s after the request, unread "
          f"(the same request read at once: {read_at_once:.1f} s); "
          f"3 other requests took {others:.1f} s meanwhile; the stream was {len(raw) / 1024:.0f} KiB")
    assert len(raw) > 64 << 10  # more than the socket buffers between them hold: the gateway held the rest


def test_log_requests_logs_each_answered_request_with_what_its_level_asks(stack):
    """--log-requests (SGLang's flag) on a gateway of its own over the stack's verifier: a line per answered request
    as it ends, streamed or whole: its id and status, tokens and finish reasons as the answer reports them, its accept
    length; level 1 adds the sampling parameters, 2 (the default) the prompt and the output text; level 0 neither."""
    from openai import OpenAI

    logs, answers = {}, {}
    for level in ("2", "0"):
        gateway, url = start_gateway(stack["stub"].port, "--log-requests", "--log-requests-level", level,
                                     "--log-level", "info")
        try:
            own = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
            whole = own.completions.create(model=MODEL, prompt="def parse(text):", max_tokens=12, temperature=0, seed=5)
            pieces = [ch.choices[0].delta.content or "" for ch in own.chat.completions.create(
                model=MODEL, messages=CHATS[1], max_tokens=10, temperature=0, stream=True,
                extra_body={"ignore_eos": True}) if ch.choices]
            answers[level] = whole, "".join(pieces)
        finally:
            gateway.terminate()
            gateway.wait(timeout=30)
        logs[level] = gateway.stderr.read().splitlines()
    whole, streamed_text = answers["2"]
    line = next(x for x in logs["2"] if f"/v1/completions {whole.id}: 200," in x)
    assert f"prompt {whole.usage.prompt_tokens} tokens, completion {whole.usage.completion_tokens} tokens" in line
    assert "finish ['length']" in line and '"max_tokens": 12' in line and '"seed": 5' in line
    assert 'prompt "def parse(text):"' in line and f"choice 0 {json.dumps(whole.choices[0].text)}" in line
    steps, accepted = whole.model_extra["speculative"]["verify_steps"], whole.model_extra["speculative"]["accepted_tokens"]
    assert f"accept length {1 + accepted / steps:.2f}" in line
    streamed = next(x for x in logs["2"] if "/v1/chat/completions chatcmpl-" in x and ": 200, streamed," in x)
    assert "completion 10 tokens" in streamed and "messages [" in streamed
    assert f"choice 0 {json.dumps(streamed_text)}" in streamed
    quiet = next(x for x in logs["0"] if f"/v1/completions {answers['0'][0].id}: 200," in x)
    assert "completion 12 tokens" in quiet and "sampling" not in quiet and "choice 0" not in quiet


def test_a_handler_that_falls_behind_takes_what_waited_as_one_delta():
    """A request's queue in the gateway (DeltaQueue): deltas that arrive while an unfinished one waits for its
    handler are merged into it (tokens and logprobs in order, the latest counts and finish), so a handler behind its
    stream writes one event for them; one taken is never changed, a finished one is never merged into, and a broken
    stream's marker stays apart."""
    from splitspec.gateway.client import DeltaQueue, StreamBroken
    from splitspec.protos import verifier_pb2 as pb

    async def run():
        queue = DeltaQueue()
        queue.put_nowait(token_delta("r", [1], verify_steps=1))
        first = await queue.get()  # taken at once: nothing to merge
        for d in (token_delta("r", [2, 3], verify_steps=2), token_delta("r", [4], verify_steps=3),
                  token_delta("r", [5], pb.FINISH_REASON_LENGTH, verify_steps=4), token_delta("r", [6])):
            queue.put_nowait(d)
        queue.put_nowait(StreamBroken("UNAVAILABLE", "the Generate stream ended"))
        assert list(first.token_ids) == [1] and queue.qsize() == 3
        merged, after, broken = [queue.get_nowait() for _ in range(3)]
        assert list(merged.token_ids) == [2, 3, 4, 5] and [lp.logprob for lp in merged.logprobs] == [-2, -3, -4, -5]
        assert merged.finish_reason == pb.FINISH_REASON_LENGTH and merged.speculation.verify_steps == 4
        assert list(merged.speculation.accepted_per_position) == [4, 3]
        assert list(after.token_ids) == [6] and isinstance(broken, StreamBroken)

    asyncio.run(run())


def test_an_idle_keep_alive_connection_outlives_the_clients_own_expiry(stack):
    """httpx (hence openai) drops an idle pooled connection after 5 s; the gateway keeps it longer (75 s), so a
    client never reuses a connection the server is closing at that very moment (uvicorn's 5 s raced it)."""
    host, port = stack["url"].removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "prompt": "x = ", "max_tokens": 2, "temperature": 0}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))

    def receive(sock) -> bytes:
        chunk = sock.recv(65536)
        assert chunk, "the gateway closed the idle keep-alive connection"
        return chunk

    def answer(sock) -> bytes:
        data = b""
        while b"\r\n\r\n" not in data:
            data += receive(sock)
        head, _, rest = data.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
        while len(rest) < length:
            rest += receive(sock)
        return head

    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(request)
        assert answer(sock).startswith(b"HTTP/1.1 200")
        time.sleep(6.5)  # idle past both sides' old 5 s
        sock.sendall(request)  # the same connection, still open
        assert answer(sock).startswith(b"HTTP/1.1 200")


def test_api_key(stack):
    port = stack["stub"].port
    process, url = start_gateway(port, "--api-key", "sekret")
    try:
        from openai import AuthenticationError, OpenAI

        with pytest.raises(AuthenticationError):
            OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        for stream in (False, True):  # the completion routes check the key too
            with pytest.raises(AuthenticationError):
                OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).completions.create(
                    model=MODEL, prompt="x = ", max_tokens=2, stream=stream)
        ok = OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0)
        assert ok.completions.create(model=MODEL, prompt="x = ", max_tokens=2).choices[0].finish_reason == "length"
    finally:
        process.kill()
        process.wait(timeout=30)


def test_the_gateway_never_imports_torch(stack):
    """The gateway process's modules, read through /proc: no torch (it serves text and token ids only)."""
    pid = stack["gateway"].pid
    maps = Path(f"/proc/{pid}/maps").read_text()
    assert "libtorch" not in maps and "/torch/" not in maps
    code = ("import sys; from splitspec.gateway.server import run, build_parser; import splitspec.gateway.app; "
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = lifeline.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


def test_metrics_through_prometheus(stack, tmp_path):
    """A fresh gateway on the same verifier, scraped by a real Prometheus server: its counters and
    histograms say what the responses said."""
    from test_verifier_service import Prometheus

    process, url = start_gateway(stack["stub"].port)
    port = int(url.rsplit(":", 1)[1])
    server = Prometheus(tmp_path, [port])
    try:
        bodies = [{"model": MODEL, "prompt": f"def f{i}(x):\n", "max_tokens": 8 + i, "temperature": 0} for i in range(4)]

        async def burst():
            async with httpx.AsyncClient(timeout=120) as http:
                return await asyncio.gather(*(http.post(url + "/v1/completions", json=b) for b in bodies))

        answers = [r.json() for r in asyncio.run(burst())]
        streamed = sse(url + "/v1/chat/completions", {"model": MODEL, "messages": CHATS[0], "max_tokens": 6,
                                                      "temperature": 0, "stream": True})
        assert streamed[-1]["choices"][0]["finish_reason"] == "length"
        assert httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": ""}, timeout=30).status_code == 400
        completion = sum(a["usage"]["completion_tokens"] for a in answers) + 6
        q = server.wait_for
        assert q("sum(splitspec:gateway_completion_tokens_total)", completion) == completion
        assert q("sum(splitspec:time_to_first_token_seconds_count)", 5) == 5
        assert q("sum(splitspec:e2e_request_latency_seconds_count)", 5) == 5
        assert q("sum(splitspec:inter_token_latency_seconds_count) > bool 0", 1) == 1
        assert q('sum(splitspec:gateway_http_requests_total{endpoint="/v1/completions",status_code="200"})', 4) == 4
        assert q('sum(splitspec:gateway_http_requests_total{status_code="400"})', 1) == 1
        assert q('sum(splitspec:gateway_finished_choices_total{finish_reason="length"})', 5) == 5
        assert q("sum(splitspec:gateway_requests_in_flight)", 0) == 0
        prompt_tokens = sum(a["usage"]["prompt_tokens"] for a in answers)
        assert q("sum(splitspec:gateway_prompt_tokens_total) - " + str(prompt_tokens) + " > bool 0", 1) == 1
        assert q("sum(splitspec:gateway_tokenize_batch_size_sum)", 5) == 5  # every tokenized request, once
    finally:
        server.close()
        process.kill()
        process.wait(timeout=30)


def test_queue_limit_answers_429_with_retry_after(stack, validate):
    process, url = start_gateway(stack["stub"].port, "--max-queued-requests", "2")
    try:
        async def burst():
            async with httpx.AsyncClient(timeout=120) as http:
                return await asyncio.gather(*(http.post(url + "/v1/completions", json={
                    "model": MODEL, "prompt": f"class C{i}:\n", "max_tokens": 64, "temperature": 0, "ignore_eos": True})
                    for i in range(6)))

        answers = asyncio.run(burst())
        codes = sorted(r.status_code for r in answers)
        assert codes.count(200) >= 2 and codes.count(429) >= 1 and set(codes) <= {200, 429}, codes
        for r in answers:
            if r.status_code == 429:
                assert r.headers["retry-after"] == "1"
                validate(r.json(), "ErrorResponse")
        after = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}, timeout=60)
        assert after.status_code == 200  # the budget came back
    finally:
        process.kill()
        process.wait(timeout=30)


def test_sigusr2_prints_the_gateways_tasks_open_requests_and_connections(stack):
    """`kill -USR2 <gateway>` while a stream is open: its asyncio tasks with their chains of awaits, the request open on
    the verifier stream and the HTTP connection's state go to its log (a stuck served bench's first evidence); the
    stream then ends as usual and a client that goes away is logged with its verifier request."""
    process, url = start_gateway(stack["stub"].port, "--log-level", "info")
    try:
        with httpx.stream("POST", url + "/v1/completions", timeout=120, json={
                "model": MODEL, "prompt": "def f(x):", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                "stream": True}) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            process.send_signal(signal.SIGUSR2)
            deadline = time.time() + 30
            while "http connection from" not in process.stderr.read() and time.time() < deadline:
                time.sleep(0.1)
        # the client left after one chunk: the gateway aborts the request and says so
        while "ended before its last event" not in process.stderr.read() and time.time() < deadline:
            time.sleep(0.1)
        log = process.stderr.read()
        assert re.search(r"\d+ asyncio tasks:", log) and "in run_asgi" in log, log[-3000:]  # the stream's handler
        assert re.search(r"gateway/client\.py:\d+ in _run", log), log[-3000:]  # the verifier stream's reader
        open_ = re.search(r"gateway: 1 choice\(s\) admitted, 1 open on the verifier stream: (\S+) \(\d+ queued\)", log)
        assert open_ is not None, log[-3000:]
        assert "response started True, complete False, disconnected False" in log
        assert re.search(r"ended before its last event \(CancelledError\) after \[\d+\] tokens: requests \['"
                         + re.escape(open_.group(1)), log), log[-3000:]
        after = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}, timeout=60)
        assert after.status_code == 200 and process.poll() is None  # still serving
    finally:
        process.kill()
        process.wait(timeout=30)


def test_verifier_down_is_503_and_a_dying_verifier_ends_requests_with_503(validate):
    process, url = None, None
    port = free_port()
    gateway = spawn_service([sys.executable, "-P", "-m", "splitspec", "gateway", "--port", str(gw := free_port()),
                                "--verifier", f"127.0.0.1:{port}", "--log-level", "warning"])
    url = f"http://127.0.0.1:{gw}"
    try:
        deadline = time.time() + 60
        while True:  # up, though the verifier is not
            try:
                health = httpx.get(url + "/health", timeout=2)
                break
            except httpx.HTTPError:
                assert time.time() < deadline and gateway.poll() is None
                time.sleep(0.3)
        assert health.status_code == 503
        for r in (httpx.get(url + "/v1/models", timeout=10),
                  httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=10)):
            assert r.status_code == 503
            validate(r.json(), "ErrorResponse")
        process, stub = start_verifier("--max-total-tokens", "8192", "--served-model-name", MODEL, port=port)
        deadline = time.time() + 60
        while httpx.get(url + "/health", timeout=5).status_code != 200:
            assert time.time() < deadline, "the gateway did not connect to the verifier that came up"
            time.sleep(0.3)
        ok = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x = ", "max_tokens": 3}, timeout=60)
        assert ok.status_code == 200

        async def doomed():
            async with httpx.AsyncClient(timeout=120) as http:
                task = asyncio.ensure_future(http.post(url + "/v1/completions", json={
                    "model": MODEL, "prompt": "import os\n", "max_tokens": 1900, "ignore_eos": True}))
                await asyncio.sleep(1.5)
                process.kill()
                return await task

        r = asyncio.run(doomed())
        assert r.status_code == 503, r.text
        validate(r.json(), "ErrorResponse")
        assert httpx.get(url + "/health", timeout=5).status_code == 503
    finally:
        gateway.kill()
        gateway.wait(timeout=30)
        if process is not None:
            process.kill()
            process.wait(timeout=30)


def _held_pages(metrics_url: str) -> float:
    """KV pages held by running requests (the prefix cache keeps finished prompts' pages)."""
    values = scrape(metrics_url)
    return sum(v for (name, _), v in values.items() if name == "splitspec:kv_pages_used") - sum(
        v for (name, _), v in values.items() if name == "splitspec:prefix_cache_pages")


async def _read_stream(http, url: str, prompt: str) -> tuple[list[dict], float]:
    """A streamed completion read to its end: (its data events, the time its last line came)."""
    events = []
    async with http.stream("POST", url + "/v1/completions", json={
            "model": MODEL, "prompt": prompt, "max_tokens": 1900, "temperature": 0, "ignore_eos": True,
            "stream": True}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[len("data: "):]))
    return events, time.time()


def test_a_hung_verifier_ends_streams_with_an_error_and_the_gateway_recovers(validate):
    """The verifier's engine stopped with SIGSTOP mid-stream (a hung process: its sockets stay open, nothing
    answers): its gRPC front hears no beat from it for as long as gRPC's keepalive allows and ends the streams
    with UNAVAILABLE (a verifier in one process: the gateway's keepalive pings go unanswered), so every stream
    ends with a terminal SSE error event and [DONE] in seconds, not never, and a request sent meanwhile gets
    503; after SIGCONT the verifier aborts the orphans (their KV pages come back), and the gateway serves
    again on a new connection."""
    from splitspec.protos.channel import KEEPALIVE_SECONDS, KEEPALIVE_TIMEOUT_SECONDS

    process, stub = start_verifier("--max-total-tokens", "16384", "--served-model-name", MODEL)
    gateway, url = start_gateway(stub.port)
    try:
        ok = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x = ", "max_tokens": 4, "temperature": 0},
                        timeout=60)
        assert ok.status_code == 200

        async def main():
            async with httpx.AsyncClient(timeout=120) as http:
                streams = [asyncio.ensure_future(_read_stream(http, url, p)) for p in
                           ("import os\n", "def f(x):\n", "class A:\n", "for i in range(3):\n")]
                await asyncio.sleep(2.0)
                assert _held_pages(stub.metrics_url) > 0 and not any(s.done() for s in streams)
                os.kill(process.pid, signal.SIGSTOP)
                stopped = time.time()
                late = await http.post(url + "/v1/completions", json={"model": MODEL, "prompt": "y = ", "max_tokens": 4})
                return stopped, await asyncio.gather(*streams), late, time.time()

        stopped, results, late, late_at = asyncio.run(main())
        # ends "in seconds, not never": 15 s here alone (the front's silence bound), once 41 s in CI with the 2-core
        # machine under every other test's load; the client itself would give up at 120
        limit = 2 * (KEEPALIVE_SECONDS + KEEPALIVE_TIMEOUT_SECONDS) + 30
        for events, ended in results:
            assert events[-1] == "[DONE]" and "error" in events[-2], events[-3:]
            assert events[-2]["error"]["code"] and ended - stopped < limit, (events[-2], ended - stopped)
            assert any(e.get("choices") for e in events[:-2])  # tokens came before the hang
        assert late.status_code == 503 and late_at - stopped < limit, (late.status_code, late_at - stopped)
        print(f"a hung verifier: streams ended with an error {min(e for _, e in results) - stopped:.1f} to "
              f"{max(e for _, e in results) - stopped:.1f} s after SIGSTOP, a new request got 503 after "
              f"{late_at - stopped:.1f} s")
        validate(late.json(), "ErrorResponse")
        os.kill(process.pid, signal.SIGCONT)
        deadline = time.time() + 30
        while _held_pages(stub.metrics_url) > 0:  # the orphans aborted once the verifier runs and sees the stream gone
            assert time.time() < deadline, "the verifier kept the hung gateway's requests"
            time.sleep(0.2)
        deadline = time.time() + 60
        while True:
            r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x = ", "max_tokens": 4, "temperature": 0},
                           timeout=60)
            if r.status_code == 200:
                break
            assert r.status_code == 503 and time.time() < deadline, r.text
            time.sleep(0.5)
        assert r.json()["choices"][0]["text"] == ok.json()["choices"][0]["text"]
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGCONT)
        gateway.kill()
        gateway.wait(timeout=30)
        stop(process, stub)


def test_a_killed_gateway_has_its_requests_aborted_and_a_new_one_serves(validate):
    """kill -9 of the gateway while it streams: the verifier sees its Generate stream end and aborts every
    orphaned request at once (their KV pages back within the next step), and a gateway
    started again serves the same output."""
    process, stub = start_verifier("--max-total-tokens", "16384", "--served-model-name", MODEL)
    gateway, url = start_gateway(stub.port)
    try:
        first = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x = ", "max_tokens": 8,
                                                          "temperature": 0}, timeout=60).json()

        async def main():
            async with httpx.AsyncClient(timeout=120) as http:
                streams = [asyncio.ensure_future(_read_stream(http, url, p)) for p in ("import os\n", "def f(x):\n")]
                await asyncio.sleep(2.0)
                assert _held_pages(stub.metrics_url) > 0
                gateway.kill()
                killed = time.time()
                for s in streams:
                    with pytest.raises(httpx.HTTPError):
                        await s
                return killed

        killed = asyncio.run(main())
        while _held_pages(stub.metrics_url) > 0:
            assert time.time() - killed < 10, "the verifier kept the dead gateway's requests"
            time.sleep(0.05)
        freed = time.time() - killed
        gateway.wait(timeout=30)
        gateway, url = start_gateway(stub.port)
        again = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x = ", "max_tokens": 8,
                                                          "temperature": 0}, timeout=60)
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == first["choices"][0]["text"]
        print(f"a killed gateway's requests were aborted and their pages freed {freed:.2f} s after the kill")
    finally:
        gateway.kill()
        gateway.wait(timeout=30)
        stop(process, stub)


def _children(pid: int) -> set[int]:
    """The live processes whose parent is pid (read from /proc)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            found.add(int(stat.parent.name))
    return found


def _submitting_workers(prefix: Path) -> dict[int, int]:
    """Worker pid -> the verifier submissions its step log recorded (SPLITSPEC_STEP_LOG)."""
    counts = {}
    for path in prefix.parent.glob(prefix.name + ".gateway.*.jsonl"):
        events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        counts[int(path.name.split(".")[-2])] = sum(1 for e in events if e.get("name") == "gateway_submitted")
    return counts


def test_several_gateway_processes_serve_one_port_with_summed_metrics(tmp_path):
    """--tokenizer-worker-num 2: two gateway processes on one port (SO_REUSEPORT). Requests over fresh connections
    are spread over both by the kernel (each worker's step log records the submissions it made) and every answer for a
    prompt is the same; a real Prometheus server scraping the port sees every request counted, whichever worker
    answers its scrapes; a worker killed with SIGKILL is started again on its socket while the requests sent meanwhile
    are answered; SIGTERM stops every worker and removes their metrics directory, and a supervisor killed with SIGKILL
    takes its workers with it, its directory removed by the next gateway to start."""
    from test_verifier_service import Prometheus

    process, stub = start_verifier("--max-total-tokens", "16384", "--served-model-name", MODEL)
    prefix = tmp_path / "steps"
    temp = tmp_path / "tmp"  # the gateways' temporary directory (TMPDIR): their metrics directories, and nothing else
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp)}

    def metrics_dirs() -> list[str]:
        return sorted(p.name for p in temp.iterdir() if p.name.startswith("splitspec-gateway-metrics-"))

    gateway, url = start_gateway(stub.port, "--tokenizer-worker-num", "2", env={**env, "SPLITSPEC_STEP_LOG": str(prefix)})
    server = None
    try:
        workers = _children(gateway.pid)
        assert len(workers) == 2, workers
        prompts = ["def add(a, b):\n", "import sys\n", "class Point:\n"]

        def burst(n: int) -> list[dict]:
            async def one(body):  # a client of its own: a fresh connection, hashed to a worker by its port
                async with httpx.AsyncClient(timeout=120) as http:
                    response = await http.post(url + "/v1/completions", json=body)
                    assert response.status_code == 200, response.text
                    return response.json()

            async def main():
                return await asyncio.gather(*(one({"model": MODEL, "prompt": prompts[i % 3], "max_tokens": 6,
                                                   "temperature": 0}) for i in range(n)))

            return asyncio.run(main())

        answers = burst(24)
        texts = {}
        for i, answer in enumerate(answers):
            texts.setdefault(prompts[i % 3], set()).add(answer["choices"][0]["text"])
        assert all(len(t) == 1 for t in texts.values()), texts  # both workers answer a prompt alike
        submitted = _submitting_workers(prefix)
        assert sum(submitted.values()) == 24 and sum(1 for n in submitted.values() if n) == 2, submitted

        port = int(url.rsplit(":", 1)[1])
        server = Prometheus(tmp_path, [port])
        q = server.wait_for
        assert q('sum(splitspec:gateway_http_requests_total{endpoint="/v1/completions",status_code="200"})', 24) == 24
        assert q("sum(splitspec:time_to_first_token_seconds_count)", 24) == 24
        completion = sum(a["usage"]["completion_tokens"] for a in answers)
        assert q("sum(splitspec:gateway_completion_tokens_total)", completion) == completion
        assert q("sum(splitspec:gateway_requests_in_flight)", 0) == 0

        victim = sorted(workers)[0]
        os.kill(victim, signal.SIGKILL)
        again = burst(12)  # those hashed to the dead worker's socket wait for its successor
        assert all(a["choices"][0]["text"] in texts[prompts[i % 3]] for i, a in enumerate(again))
        deadline = time.time() + 60
        while len(_children(gateway.pid) - {victim}) < 2:
            assert time.time() < deadline, "the killed worker was not started again"
            time.sleep(0.2)
        assert victim not in _children(gateway.pid) and gateway.poll() is None
        # the dead worker's counts stay in the sums
        assert q('sum(splitspec:gateway_http_requests_total{endpoint="/v1/completions",status_code="200"})', 36) == 36

        workers = _children(gateway.pid)
        serving = metrics_dirs()
        assert len(serving) == 1 and serving[0].startswith(f"splitspec-gateway-metrics-{gateway.pid}-"), serving
        gateway.terminate()
        assert gateway.wait(timeout=60) == 0
        assert not any(Path(f"/proc/{pid}").exists() for pid in workers), workers  # stopped and reaped
        assert metrics_dirs() == []

        gateway, url = start_gateway(stub.port, "--tokenizer-worker-num", "2", env=env)
        workers = _children(gateway.pid)
        gateway.kill()
        gateway.wait(timeout=30)
        deadline = time.time() + 30
        while any(Path(f"/proc/{pid}").exists() for pid in workers):
            assert time.time() < deadline, "workers outlived their killed supervisor"
            time.sleep(0.1)
        orphan = metrics_dirs()
        assert len(orphan) == 1 and orphan[0].startswith(f"splitspec-gateway-metrics-{gateway.pid}-"), orphan
        gateway, url = start_gateway(stub.port, "--tokenizer-worker-num", "2", env=env)
        mine = metrics_dirs()
        assert len(mine) == 1 and mine[0].startswith(f"splitspec-gateway-metrics-{gateway.pid}-"), (orphan, mine)
    finally:
        if server is not None:
            server.close()
        gateway.kill()
        gateway.wait(timeout=30)
        stop(process, stub)
