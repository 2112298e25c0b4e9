"""Conversation -> prompt, for `k3 serve` (/v1/chat/completions) and `k3 chat`: the model's chat format
(k3.chat), read from its tokenizer or tokenizer directory; a model without one (every `k3 train` run) gets
the built-in "plain" format, one "Role: text" line per message:

    System: You are terse.
    User: hello
    Assistant: hi
    User: and now?
    Assistant:

A reply in that format ends at the first newline (the next speaker's turn), so it brings the stop string
"\\n" with it; the Kimi-K2 format ends a reply at <|im_end|>, the k3 format at the tokenizer's EOS.
"""

from __future__ import annotations

import os
from typing import Any

from k3.chat import ChatFormat, builtin_template, load_chat_format


class ChatTemplate(ChatFormat):
    """A ChatFormat with `stop`, the stop strings a reply in it needs. ChatTemplate() is the plain format."""

    def __init__(self, template: str | None = None, source: str = "built-in plain", bos_token: str = "",
                 eos_token: str = "") -> None:
        super().__init__(template or builtin_template("plain"), source, bos_token, eos_token)

    @property
    def stop(self) -> list[str]:
        return [self.end_of_turn] if self.end_of_turn else []


def render_default(messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
    return ChatTemplate().render(messages, add_generation_prompt=add_generation_prompt)


def load_chat_template(tokenizer, directory: str | os.PathLike | None = None) -> ChatTemplate:
    """The tokenizer's own template, else one in `directory` (a tokenizer or HF model directory), else Kimi-K2's
    for a Kimi tokenizer, else the plain format."""
    fmt = load_chat_format(tokenizer, directory, default="plain")
    return ChatTemplate(fmt.template, fmt.source, fmt.bos_token, fmt.eos_token)
