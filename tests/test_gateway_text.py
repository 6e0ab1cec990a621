"""The gateway's text layer without services: chat templates render as transformers renders them,
incremental detokenization never splits a character, stop strings are found across token boundaries
and never sent."""

from __future__ import annotations

import json
import random

import pytest

from splitspec.demo import demo_model_dirs
from splitspec.gateway.text import IncrementalDecoder, StopMatcher, TemplateError, TextCodec

# A template in the style of Llama 3 / Qwen: a system default, loops, filters, tojson, raise_exception.
RICH_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = 'You are helpful.' %}{% endif %}"
    "<|system|>\n{{ system | trim }}\n"
    "{% for message in messages %}{% if message['role'] not in ['user', 'assistant'] %}"
    "{{ raise_exception('roles must be user or assistant') }}{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{% if loop.last and message['role'] == 'user' %}"
    " {{ {'n': loop.index, 'text': 'é'} | tojson }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
MESSAGES = [
    [{"role": "user", "content": "def fibonacci(n):"}],
    [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "hello"}, {"role": "user", "content": "多谢 🎉"}],
]


@pytest.fixture(scope="module")
def codec():
    return TextCodec(demo_model_dirs()["target"])


def test_chat_templates_render_as_transformers(codec, tmp_path):
    from transformers import AutoTokenizer

    target = demo_model_dirs()["target"]
    reference = AutoTokenizer.from_pretrained(target)
    for messages in MESSAGES:
        text = codec.render_chat(messages)
        assert text == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = reference.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)
        assert codec.encode_batch([text], add_special_tokens=False)[0] == list(ids["input_ids"])
    # the same tokenizer with a richer template in tokenizer_config.json
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((target / name).read_text())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": RICH_TEMPLATE}))
    rich, reference = TextCodec(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    for messages in MESSAGES:
        assert rich.render_chat(messages) == reference.apply_chat_template(messages, tokenize=False,
                                                                            add_generation_prompt=True)
    with pytest.raises(TemplateError, match="roles must be user or assistant"):
        rich.render_chat([{"role": "tool", "content": "x"}])


def test_incremental_decoding_never_splits_a_character(codec):
    text = "héllo → 世界 🎉 def f():\n    return '日本語'"
    ids = codec.encode_batch([text], add_special_tokens=False)[0]
    decoder = IncrementalDecoder(codec)
    pieces = [decoder.step(i) for i in ids]
    assert "".join(pieces) + decoder.flush() == text
    assert all("\ufffd" not in p for p in pieces)
    assert sum(p == "" for p in pieces) > 0  # some tokens carried part of a character and waited
    broken = IncrementalDecoder(codec)  # a dangling partial character is flushed as U+FFFD at the end
    partial = [i for i in ids if codec.token_bytes(i) and codec.token_bytes(i)[0] >= 0xE0 and len(codec.token_bytes(i)) == 1]
    assert partial, "expected a token holding a lone leading byte"
    assert broken.step(partial[0]) == "" and broken.flush() == "\ufffd"


class WholeTextStopMatcher:
    """The reference: StopMatcher as it was, searching the whole text it was fed (quadratic in the output's length)."""

    def __init__(self, stops):
        self.stops, self.text, self.sent, self.hit = [s for s in stops if s], "", 0, None

    def feed(self, piece):
        if self.hit is not None:
            return ""
        self.text += piece
        if not self.stops:
            return self._release(len(self.text))
        window = max(0, self.sent - max(len(s) for s in self.stops) + 1)
        found = [(at, s) for at, s in ((self.text.find(s, window), s) for s in self.stops) if at >= 0]
        if found:
            at, self.hit = min(found)
            return self._release(at)
        unsent, held = self.text[self.sent:], 0
        for n in range(min(len(unsent), max(len(s) for s in self.stops) - 1), 0, -1):
            if any(s.startswith(unsent[-n:]) for s in self.stops):
                held = n
                break
        return self._release(len(self.text) - held)

    def finish(self):
        return "" if self.hit is not None else self._release(len(self.text))

    def _release(self, end):
        end = max(end, self.sent)
        piece, self.sent = self.text[self.sent:end], end
        return piece


def test_stop_matching_keeps_only_what_a_match_can_need_and_releases_what_the_whole_text_search_did():
    """Random texts over a small alphabet (so stop strings recur, straddle pieces and overlap each other): every
    release and hit equals the whole-text reference's, and the kept text stays within the longest stop string
    plus what is held back, however long the output grows."""
    rng = random.Random(7)
    for trial in range(400):
        stops = ["".join(rng.choice("ab\n") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(0, 3))]
        if rng.random() < 0.2:
            stops.append("")  # an empty stop string is ignored
        ours, reference = StopMatcher(stops), WholeTextStopMatcher(stops)
        for _ in range(rng.randint(1, 60)):
            piece = "".join(rng.choice("abc\n") for _ in range(rng.randint(0, 5)))
            assert ours.feed(piece) == reference.feed(piece), (trial, stops)
            assert ours.hit == reference.hit
            longest = max((len(s) for s in stops), default=0)
            assert len(ours.text) <= max(0, longest - 1) + (len(ours.text) - ours.sent), (ours.text, ours.sent)
            assert len(ours.text) - ours.sent <= max(0, longest - 1) or ours.hit is not None
        assert ours.finish() == reference.finish()
    many = StopMatcher(["STOP"])
    for _ in range(10000):
        many.feed("tokens ")
    assert len(many.text) <= 3  # not the 70000 characters fed


def test_stop_strings_across_token_boundaries():
    m = StopMatcher(["STOP", "\n\n"])
    sent = [m.feed(p) for p in ["abc S", "T", "xST", "O", "P and more"]]
    assert "".join(sent) == "abc STx" and m.hit == "STOP"  # "abc STxSTOP and more" ends before STOP
    assert sent[0] == "abc " and sent[1] == ""  # "S" and "ST" were held back: they could begin STOP
    assert m.feed("later") == "" and m.finish() == ""
    m = StopMatcher(["\n\n"])
    assert m.feed("line\n") == "line" and m.feed("next") == "\nnext" and m.finish() == ""
    m = StopMatcher(["xyz"])
    assert m.feed("abxy") == "ab" and m.finish() == "xy" and m.hit is None  # no hit: the held text is sent at the end
    m = StopMatcher(["b", "abc"])
    assert m.feed("zabcd") == "z" and m.hit == "abc"  # the hit that starts first wins
    m = StopMatcher(["STOP", "\n\n"], include=True)  # vLLM's include_stop_str_in_output
    sent = [m.feed(p) for p in ["abc S", "T", "xST", "O", "P and more"]]
    assert "".join(sent) == "abc STxSTOP" and m.hit == "STOP" and m.finish() == ""


def test_chat_template_options_render_as_transformers(codec, tmp_path):
    """continue_final_message, add_generation_prompt and chat_template_kwargs (TemplateOptions, as the request models
    make them) render what transformers' apply_chat_template renders with the same arguments, on the demo template
    and on a richer one that reads a variable of its own and trims the final message; a chat whose final message
    has no text, or a template that drops it, cannot be continued (TemplateError, the gateway's 400)."""
    from transformers import AutoTokenizer

    from splitspec.gateway.protocol import parse_chat
    from splitspec.gateway.text import ChatMessages

    target = demo_model_dirs()["target"]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((target / name).read_text())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    own = RICH_TEMPLATE.replace("{{ message['content'] }}", "{{ message['content'] | trim }}").replace(
        "<|system|>", "{% if persona is defined %}<|persona|>{{ persona }}\n{% endif %}<|system|>")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": own}))
    prefilled = [{"role": "user", "content": "Write add."}, {"role": "assistant", "content": "def add(a, b): "}]
    asks = [({"continue_final_message": True}, {"continue_final_message": True, "add_generation_prompt": False}),
            ({"add_generation_prompt": False}, {"add_generation_prompt": False}),
            ({"chat_template_kwargs": {"persona": "terse"}}, {"add_generation_prompt": True, "persona": "terse"}),
            ({"continue_final_message": True, "add_generation_prompt": False, "chat_template_kwargs": {"persona": "x"}},
             {"continue_final_message": True, "add_generation_prompt": False, "persona": "x"})]
    for ours, reference in ((codec, AutoTokenizer.from_pretrained(target)),
                            (TextCodec(tmp_path), AutoTokenizer.from_pretrained(tmp_path))):
        for fields, arguments in asks:
            request = parse_chat({"model": "m", "messages": prefilled, **fields})
            assert ours.render_chat(request.messages) == reference.apply_chat_template(
                prefilled, tokenize=False, **arguments), fields
    continued = TextCodec(tmp_path).render_chat(ChatMessages(prefilled, options=parse_chat(
        {"model": "m", "messages": prefilled, "continue_final_message": True}).messages.options))
    assert continued.endswith("def add(a, b):")  # the template trimmed the message: so is the text before the tag
    no_text = [prefilled[0], {"role": "assistant", "content": ""}]
    with pytest.raises(TemplateError, match="needs a final message with text"):
        codec.render_chat(parse_chat({"model": "m", "messages": no_text, "continue_final_message": True})
                          .messages)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": own.replace(
        "{{ message['content'] | trim }}", "{{ message['content'][:3] }}")}))
    with pytest.raises(TemplateError, match="does not render the final message"):
        TextCodec(tmp_path).render_chat(parse_chat({"model": "m", "messages": prefilled, "continue_final_message": True})
                                        .messages)


def test_the_text_layer_needs_no_pydantic():
    """The verifier and `splitspec generate` read tokenizers through gateway/text.py (splitspec.tokenizer_loader.load_tokenizer),
    and the GPU image carries no pydantic for them: the text layer imports only tokenizers (and jinja2 when rendering)."""
    import subprocess
    import sys

    code = "import sys, splitspec.gateway.text; print(sorted(m for m in ('pydantic', 'torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out
