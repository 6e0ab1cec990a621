"""A chat request's options for its chat template, as vLLM's and SGLang's chat endpoints take them (mixed into the
chat and /tokenize request models):

- `chat_template_kwargs`: more variables for the template (e.g. Qwen3's `enable_thinking`, a date, a persona);
  as in vLLM they override the server's own (`add_generation_prompt`, `tools`, the special tokens), never
  `messages`.
- `add_generation_prompt`: the template's assistant header after the messages (default true).
- `continue_final_message`: the final message is continued, not answered (an assistant's reply prefilled): the
  template renders it without its end-of-turn, as transformers' `apply_chat_template(continue_final_message=True)`
  does: the message is tagged, rendered, and the text cut at the tag. It turns `add_generation_prompt`'s default to
  false; both true is a 400.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field
from pydantic_core import PydanticCustomError

CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' tag: a template that keeps it verbatim keeps its space
RESERVED_KWARGS = ("messages",)


class TemplateError(ValueError):
    """The chat template refused the messages (its raise_exception), failed to render, or cannot continue them."""


@dataclass
class TemplateOptions:
    """What render_chat passes the template beyond the messages, and whether the final message is continued."""

    kwargs: dict[str, Any] = field(default_factory=lambda: {"add_generation_prompt": True})
    continue_final: bool = False


class ChatTemplateFields(BaseModel):
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description="vLLM's and SGLang's: more variables for the chat template (e.g. enable_thinking); "
        "they override the server's own, except messages")
    add_generation_prompt: bool | None = Field(
        default=None, description="vLLM's: the template's assistant header after the messages (default true; false "
        "with continue_final_message)")
    continue_final_message: bool | None = Field(
        default=None, description="vLLM's and SGLang's: continue the final message (an assistant's prefill) instead of "
        "answering it")

    def template_options(self) -> TemplateOptions:
        """The request's options. Raises PydanticCustomError."""
        continuing = bool(self.continue_final_message)
        if continuing and self.add_generation_prompt:
            raise PydanticCustomError("continue_final_message", "'continue_final_message' continues the final message "
                                      "and 'add_generation_prompt' starts a new one: set one of them")
        reserved = next((k for k in RESERVED_KWARGS if k in (self.chat_template_kwargs or {})), None)
        if reserved is not None:
            raise PydanticCustomError("chat_template_kwargs", "'chat_template_kwargs' may not set '{key}': the "
                                      "request's own field gives it", {"key": reserved})
        generation_prompt = not continuing if self.add_generation_prompt is None else self.add_generation_prompt
        return TemplateOptions({"add_generation_prompt": generation_prompt, **(self.chat_template_kwargs or {})},
                               continuing)


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
