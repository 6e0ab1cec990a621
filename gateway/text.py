"""Text in the gateway, without torch or transformers: the model's tokenizer (`tokenizers`), its chat
template rendered the way transformers renders it (a sandboxed Jinja environment with the same
options, filters and globals), incremental detokenization and stop strings.

- Chat prompts are rendered with `add_generation_prompt=True` (unless the request's template options,
  chat_template_options.py, say otherwise) and encoded without adding special tokens (transformers'
  `apply_chat_template(tokenize=True)`); completion prompts are encoded with them (the tokenizer's
  post-processor, e.g. a BOS), as vLLM and SGLang do.
- `IncrementalDecoder` yields text only once its bytes form whole UTF-8 characters (tokenizers'
  DecodeStream), so no chunk ever carries half a character; whatever is still pending when a request
  ends is flushed with U+FFFD replacements.
- `StopMatcher` holds back the shortest tail that could still begin a stop string, so a stop string
  split across tokens is never emitted; the text before it is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' tag: a template that keeps it verbatim keeps its space


class TemplateError(ValueError):
    """The chat template refused the messages (its raise_exception), failed to render, or cannot continue them."""


@dataclass
class TemplateOptions:
    """What render_chat passes the template beyond the messages, and whether the final message is continued."""

    kwargs: dict[str, Any] = field(default_factory=lambda: {"add_generation_prompt": True})
    continue_final: bool = False


def tag_final_message(messages: list[dict]) -> list[dict]:
    """The messages with the tag after the final one's text (a copy; the caller's are untouched)."""
    if not messages or not isinstance(messages[-1].get("content"), str) or not messages[-1]["content"]:
        raise TemplateError("'continue_final_message' needs a final message with text to continue")
    return [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + CONTINUE_TAG}]


def cut_at_tag(rendered: str) -> str:
    """The rendered chat up to the tag (transformers' rule: where the template trimmed the message's trailing
    spaces, the text before the tag loses its trailing spaces too)."""
    at = rendered.rfind(CONTINUE_TAG.strip())
    if at < 0:
        raise TemplateError("'continue_final_message': this model's chat template does not render the final message's "
                            "text as given, so it cannot be continued")
    if rendered[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()


class ChatMessages(list):
    """A chat's messages (dicts, as the template gets them), the tools offered with them (None: none), which the
    template renders too (transformers' `tools` argument), and the request's template options."""

    def __init__(self, messages: list[dict], tools: list[dict] | None = None, options: TemplateOptions | None = None):
        super().__init__(messages)
        self.tools, self.options = tools, options


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character a ByteLevel vocabulary uses for each byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    codes, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, codes)}


class TextCodec:
    """The served model's tokenizer and chat template, loaded from a model or tokenizer directory."""

    def __init__(self, path: str | Path):
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path} (the gateway reads fast tokenizers only)")
        self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        config_file = path / "tokenizer_config.json"
        self.config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self.special_tokens = {key: _content(self.config.get(key)) for key in SPECIAL_TOKEN_KEYS if self.config.get(key)}
        self.chat_template = _find_chat_template(path, self.config)
        self._template = None
        decoder = json.loads(self.tokenizer.to_str()).get("decoder") or {}
        self._byte_level = decoder.get("type") == "ByteLevel"
        self._bytes = _byte_decoder() if self._byte_level else {}
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)

    # prompts ---------------------------------------------------------------------------------------
    def render_chat(self, messages: list[dict], **kwargs) -> str:
        """The chat's prompt text: its options' variables (ChatMessages.options; default: add_generation_prompt)
        over the special tokens and tools, kwargs over those."""
        options = getattr(messages, "options", None) or TemplateOptions()
        tools = getattr(messages, "tools", None)
        variables = {**self.special_tokens, **({"tools": tools} if tools is not None else {}), **options.kwargs, **kwargs}
        if self.chat_template is None:
            raise TemplateError("this model has no chat template; use /v1/completions")
        if self._template is None:
            self._template = _compile(self.chat_template)
        try:
            if options.continue_final:
                return cut_at_tag(self._template.render(**variables, messages=tag_final_message(list(messages))))
            return self._template.render(**variables, messages=list(messages))
        except TemplateError:
            raise
        except Exception as exc:  # noqa: BLE001 (a template can fail in many ways on odd input)
            raise TemplateError(f"the chat template failed on these messages: {exc}") from None

    def encode_batch(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def encode(self, text: str) -> list[int]:
        """One completion prompt's ids, special tokens added (transformers' `tokenizer.encode`)."""
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def eos_token_id(self) -> int | None:
        eos = self.special_tokens.get("eos_token")
        return self.tokenizer.token_to_id(eos) if eos else None

    # logprobs ---------------------------------------------------------------------------------------
    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (byte-level vocabularies map exactly; others via decoding)."""
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level and all(ch in self._bytes for ch in piece):
            return bytes(self._bytes[ch] for ch in piece)
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode()

    def token_text(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")


class IncrementalDecoder:
    def __init__(self, codec: TextCodec, skip_special_tokens: bool = True):
        self.codec = codec
        self.skip_special_tokens = skip_special_tokens
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.pending: list[int] = []

    def step(self, token_id: int) -> str:
        piece = self.stream.step(self.codec.tokenizer, token_id)
        if piece is None:
            self.pending.append(token_id)
            return ""
        self.pending = []
        return piece

    def flush(self) -> str:
        """Text of tokens that never completed a character (U+FFFD stands for the broken bytes)."""
        text = self.codec.decode(self.pending, self.skip_special_tokens) if self.pending else ""
        self.pending = []
        return text


class StopMatcher:
    """Feeds text; returns what may be sent now and whether a stop string was hit (whatever follows the stop
    string is never sent, nor the stop string itself unless `include`: vLLM's include_stop_str_in_output).

    It keeps only the text a later match can need: what it holds back (a tail that may begin a stop string) and
    the last len(longest stop) - 1 characters before it, so a long output costs time in proportion to its length,
    not to its square (a whole-text buffer copied itself at every token)."""

    def __init__(self, stops: list[str], include: bool = False):
        self.stops, self.include = [s for s in stops if s], include
        self.longest = max((len(s) for s in self.stops), default=0)
        self.text = ""  # the kept text: some already-sent characters, then the unsent ones from self.sent on
        self.sent = 0
        self.hit: str | None = None

    def feed(self, piece: str) -> str:
        if self.hit is not None:
            return ""
        if not self.stops:
            return piece
        self.text += piece
        window = max(0, self.sent - self.longest + 1)
        found = [(self.text.find(s, window), s) for s in self.stops]
        found = [(at, s) for at, s in found if at >= 0]
        if found:
            at, self.hit = min(found)
            return self._release(at + len(self.hit) if self.include else at)
        return self._release(len(self.text) - self._held_tail())

    def finish(self) -> str:
        """Everything not yet sent (the request ended without a stop-string hit)."""
        return "" if self.hit is not None else self._release(len(self.text))

    def _held_tail(self) -> int:
        """Length of the longest suffix of the unsent text that begins some stop string."""
        unsent = self.text[self.sent :]
        for n in range(min(len(unsent), self.longest - 1), 0, -1):
            tail = unsent[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0

    def _release(self, end: int) -> str:
        end = max(end, self.sent)
        piece = self.text[self.sent : end]
        keep = max(0, end - self.longest + 1)  # the next search starts there at the earliest
        self.text, self.sent = self.text[keep:], end - keep
        return piece


def _content(value) -> str:
    return value.get("content", "") if isinstance(value, dict) else str(value)


def _find_chat_template(path: Path, config: dict) -> str | None:
    """transformers' order: chat_template.jinja, then chat_template.json, then tokenizer_config.json."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    if (path / "chat_template.json").is_file():
        return json.loads((path / "chat_template.json").read_text()).get("chat_template")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def _compile(source: str):
    """A template compiled as transformers compiles chat templates."""
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):  # `{% generation %}...{% endgeneration %}` marks assistant text; it renders as is
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    def raise_exception(message):
        raise TemplateError(f"the chat template refused these messages: {message}")

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
