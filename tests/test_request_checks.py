"""A request body's checks as functions (the gateway's HTTP tests send the same bodies over the wire): token-id lists
take JSON's integral numbers and nothing else, and the body parser's shortcut (no walk where no string can hold a
lone surrogate and nothing can nest too deep) refuses what the walk refuses."""

from __future__ import annotations

import json

import pytest

from splitspec.gateway.body import BodyError, parse_body
from splitspec.gateway.protocol import APIError, parse_chat, parse_completion
from splitspec.gateway.tokenize_models import parse_detokenize

VOCAB = 4096


def completion(**fields):
    return parse_completion({"model": "m", **fields}, VOCAB)


def test_token_ids_take_integral_numbers_as_ints():
    g = completion(prompt=[1, 2.0, 3], stop_token_ids=[7.0, 8], max_tokens=4.0)
    assert g.prompts == [[1, 2, 3]] and [type(t) for t in g.prompts[0]] == [int, int, int]
    assert g.stop_token_ids == [7, 8] and type(g.stop_token_ids[0]) is int
    assert g.max_tokens == 4 and type(g.max_tokens) is int
    batch = completion(prompt=[[5, 6.0], "text"])
    assert batch.prompts == [[5, 6], "text"]
    assert parse_detokenize({"tokens": [1.0, 2]}, VOCAB).tokens == [1, 2]


@pytest.mark.parametrize("fields, param", [
    ({"prompt": [1, 2.5]}, "prompt"),  # not an integer
    ({"prompt": [1, True]}, "prompt"),  # JSON's true is not a number
    ({"prompt": [1, "2"]}, "prompt"),  # nor is a string of digits
    ({"prompt": [1, -1]}, "prompt"),
    ({"prompt": [1, VOCAB]}, "prompt"),  # outside the vocabulary
    ({"prompt": [[1, 2], [3, VOCAB + 5.0]]}, "prompt"),
    ({"prompt": [1], "stop_token_ids": [2.5]}, "stop_token_ids[0]"),
    ({"prompt": [1], "stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"prompt": [1], "max_tokens": 3.5}, "max_tokens"),
])
def test_token_ids_refuse_what_is_not_an_id(fields, param):
    with pytest.raises(APIError) as caught:
        completion(**fields)
    assert caught.value.status == 400 and caught.value.param == param, caught.value.body()


def test_a_vocabulary_bound_names_the_first_id_outside_it():
    with pytest.raises(APIError) as caught:
        completion(prompt=[1, VOCAB + 7, VOCAB + 1])
    assert f"token id {VOCAB + 7}" in caught.value.message


def test_detokenize_refuses_ids_that_are_not_integral():
    for tokens in ([1.5], [True], [VOCAB]):
        with pytest.raises(APIError):
            parse_detokenize({"tokens": tokens}, VOCAB)


@pytest.mark.parametrize("raw, why", [
    (b'{"prompt": "a \\ud800 b"}', "surrogate"),
    (b'{"\\udfff": 1}', "surrogate"),
    (b'{"prompt": "\\\\u is text, \\udc00 is not"}', "surrogate"),
    (b'{"prompt": ' + b"[" * 129 + b"]" * 129 + b"}", "deeper"),
    (b'{"a": ' * 129 + b"1" + b"}" * 129, "deeper"),
])
def test_the_body_parser_refuses_lone_surrogates_and_depth(raw, why):
    with pytest.raises(BodyError) as caught:
        parse_body(raw)
    assert why in str(caught.value)


@pytest.mark.parametrize("value", [
    {"prompt": "[" * 300 + "{" * 300},  # brackets in a string do not nest
    {"prompt": "\\u00e9 is an escaped backslash, then u", "x": "\u00e9\u4e2d\U0001f600"},
    {"messages": [{"role": "user", "content": "\U0001f600 escaped (ensure_ascii) as a surrogate pair: one character"}]},
    {"nested": [[[[1]]]] * 40},
])
def test_the_body_parser_takes_what_json_holds(value):
    raw = json.dumps(value).encode()
    assert parse_body(raw) == json.loads(raw)
    raw_unicode = json.dumps(value, ensure_ascii=False).encode()
    assert parse_body(raw_unicode) == value


def test_chat_token_limits_take_integral_numbers():
    g = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5.0,
                    "stop_token_ids": [3.0]}, VOCAB)
    assert g.max_tokens == 5 and g.stop_token_ids == [3]
