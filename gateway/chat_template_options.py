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
The options themselves (TemplateOptions) and the continuation's tag are text.py's, which renders them without pydantic
(the engine side reads tokenizers through it).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field
from pydantic_core import PydanticCustomError

from splitspec.gateway.text import TemplateOptions

RESERVED_KWARGS = ("messages",)


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
