"""The request bodies of POST /tokenize and /detokenize (vLLM's and SGLang's shape), validated like the completions'
bodies (protocol.py), with OpenAI's error object."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, ValidationError, ValidationInfo, model_validator
from pydantic_core import PydanticCustomError

from splitspec.gateway.chat_template_options import ChatTemplateFields
from splitspec.gateway.numbers import integers
from splitspec.gateway.protocol import MAX_MESSAGES, MAX_TOKENS, AnyMessage, Name, _api_error, _Strict

MAX_TOKENIZE_CHARS = 4 << 20  # /tokenize's prompt (the body limit bounds it too)
MAX_DETOKENIZE_IDS = 1 << 20


class TokenizeRequest(_Strict, ChatTemplateFields):
    """POST /tokenize (vLLM's and SGLang's): a prompt's or a chat's token ids, as a completion would see them (a chat's
    template options as the chat endpoint takes them)."""

    model: Name | None = None
    prompt: Annotated[str, Field(max_length=MAX_TOKENIZE_CHARS)] | None = None
    messages: Annotated[list[AnyMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    add_special_tokens: bool | None = Field(default=None, description="default: true for a prompt, false for messages")

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise PydanticCustomError("tokenize", "give exactly one of 'prompt' and 'messages'")
        if self.messages is None and self.model_fields_set & set(ChatTemplateFields.model_fields):
            raise PydanticCustomError("tokenize", "a prompt has no chat template: its options need 'messages'")
        self.template_options()  # its checks
        return self


class DetokenizeRequest(_Strict):
    """POST /detokenize: token ids back to text."""

    model: Name | None = None
    tokens: integers(0, MAX_TOKENS, max_length=MAX_DETOKENIZE_IDS)

    @model_validator(mode="after")
    def _in_vocabulary(self, info: ValidationInfo):
        vocab = (info.context or {}).get("vocab_size")
        bad = next((t for t in self.tokens if vocab is not None and t >= vocab), None)
        if bad is not None:
            raise PydanticCustomError("tokens", "token id {bad} is outside the vocabulary [0, {vocab})",
                                      {"bad": bad, "vocab": vocab})
        return self


def parse_tokenize(body) -> TokenizeRequest:
    try:
        return TokenizeRequest.model_validate(body)
    except ValidationError as exc:
        raise _api_error(exc) from None


def parse_detokenize(body, vocab_size: int) -> DetokenizeRequest:
    try:
        return DetokenizeRequest.model_validate(body, context={"vocab_size": vocab_size})
    except ValidationError as exc:
        raise _api_error(exc) from None
